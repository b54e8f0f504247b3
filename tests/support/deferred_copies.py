"""Device copies that complete late, on CPU: stands in for the CUDA event the worker records after
its non-blocking copy of a step's logit statistics (llm_otel.telemetry.logit_capture.StepLogits.stage),
so tests can drive deferred collection - and compare it with collection at once - without a GPU."""

from __future__ import annotations

import types

from llm_otel.telemetry.logit_capture import StepLogits


class LateEvent:
    """``torch.cuda.Event`` as the worker uses it: ``query()`` is False for its first ``lag``
    queries (the copy is still running while later steps run), then True; ``synchronize()``
    completes it (what the worker calls only for a step beyond its pending bound, or at the final flush)."""

    def __init__(self, lag: int) -> None:
        self.left = lag
        self.synchronized = False

    def query(self) -> bool:
        if self.left <= 0:
            return True
        self.left -= 1
        return False

    def synchronize(self) -> None:
        self.synchronized = True
        self.left = 0


def late_copies(monkeypatch, lag: int) -> list[LateEvent]:
    """Make every staged step complete only after ``lag`` polls; returns the events, in step order."""
    events: list[LateEvent] = []
    real = StepLogits.stage

    def stage(self, *args, **kwargs):
        staged = real(self, *args, **kwargs)
        if lag > 0:
            staged.event = LateEvent(lag)
            events.append(staged.event)
        return staged

    monkeypatch.setattr(StepLogits, "stage", stage)
    return events


def step_clock(monkeypatch):
    """The worker's wall clock as a step counter: ``clock.step = n`` makes staged rows read ``n``
    (so each ``llm.logit.step`` event's timestamp names the step it was reduced in)."""
    import time

    from llm_otel.instrumentation.vllm import logit_rows

    clock = types.SimpleNamespace(step=0)
    monkeypatch.setattr(logit_rows, "time", types.SimpleNamespace(time_ns=lambda: clock.step, monotonic=time.monotonic))
    return clock
