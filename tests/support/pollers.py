"""Utilisation pollers for sampler tests."""

from __future__ import annotations


def idle_poller():
    """A poller that reads an idle engine (utilisation 0: the policy says p = 1)."""
    from llm_otel.gpu.nvml import UtilizationPoller

    class Idle:
        def read(self) -> float:
            return 0.0

    poller = UtilizationPoller(Idle(), alpha=1.0)
    poller.sample()
    return poller
