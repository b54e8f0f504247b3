"""Load signals the sampler follows: engine occupancy where NVML sees no GPU, and the default poller."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from llm_otel.errors import process_errors

if TYPE_CHECKING:
    from llm_otel.gpu.nvml import UtilizationPoller

__all__ = ["EngineOccupancy", "utilization_is_gpu", "default_poller"]

logger = logging.getLogger("llm_otel")


class EngineOccupancy:
    """A ``SignalSource`` for hosts without NVML: how full the serving engines' batches are.

    Each engine adapter attaches a callable returning ``(requests, capacity)``: requests the engine
    holds now (running and waiting; for vLLM the frontend's live request records) and the most it
    runs at once (vLLM ``scheduler_config.max_num_seqs``), or None once that engine is gone (the
    callable is then dropped). :meth:`read` returns the highest ``requests / capacity`` over the
    attached engines, capped at 1 (a queue behind a full batch reads 1.0), and 0.0 with none
    attached (nothing is being served). A full batch is when tracing competes with the model for
    the host, so the sampler lowers the probability, exactly as for a busy GPU.
    """

    period_s = 0.25  # reading it is a few len() calls: poll it more often than NVML
    thread_name = "llm-otel-occupancy-poller"

    def __init__(self, on_attach: Callable[[], object] | None = None) -> None:
        self._sources: list[Callable[[], tuple[int, int] | None]] = []
        self._lock = threading.Lock()
        self.on_attach = on_attach  # an idempotent poller.start: no thread until an engine attaches

    def attach(self, source: Callable[[], tuple[int, int] | None]) -> None:
        """Add one engine's ``source() -> (requests, capacity) | None``, then run ``on_attach``
        (errors logged, never raised)."""
        with self._lock:
            self._sources.append(source)
        if self.on_attach is not None:
            try:
                self.on_attach()
            except Exception as exc:  # noqa: BLE001 - called from an engine's constructor hook
                process_errors().report("sampling.occupancy.start", exc, "engine occupancy poller did not start")

    @property
    def engines(self) -> int:
        """Sources attached and not yet dropped."""
        return len(self._sources)

    def read(self) -> float:
        """Occupancy in [0, 1] (see the class). A source that raises is dropped (logged once)."""
        best = 0.0
        dead = []
        for source in list(self._sources):
            try:
                got = source()
                if got is None:
                    dead.append(source)
                    continue
                requests, capacity = got
                if capacity > 0:
                    best = max(best, min(1.0, requests / capacity))
            except Exception as exc:  # noqa: BLE001 - one broken engine must not stop the signal
                process_errors().report("sampling.occupancy.source", exc, "engine occupancy source failed; dropped")
                dead.append(source)
        if dead:
            with self._lock:
                self._sources = [s for s in self._sources if s not in dead]
        return best


def utilization_is_gpu(poller: object) -> bool:
    """True unless ``poller`` reads :class:`EngineOccupancy` (which is not a GPU's utilisation and
    must not feed ``hw.gpu.utilization`` or the health score)."""
    return poller is not None and not isinstance(getattr(poller, "source", None), EngineOccupancy)


def default_poller() -> UtilizationPoller:
    """The adaptive sampler's poller: GPU utilisation from NVML when NVML sees a GPU (started), or
    else :class:`EngineOccupancy`, whose thread starts when the first engine attaches (a process
    that serves no engine, e.g. a Triton client, runs no poller). Stop it with ``poller.stop()``."""
    from llm_otel.gpu.nvml import UtilizationPoller

    poller = UtilizationPoller.from_nvml()
    if poller.source is not None:
        return poller.start()
    occupancy = EngineOccupancy()
    poller = UtilizationPoller(occupancy, period_s=EngineOccupancy.period_s)
    occupancy.on_attach = poller.start  # starts once; later calls return at once
    logger.info("llm-otel: the adaptive sampler follows engine occupancy (no GPU utilisation)")
    return poller
