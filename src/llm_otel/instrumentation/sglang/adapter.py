"""Reads SGLang's own objects in each of its processes and calls the telemetry core: one
sub-adapter per SGLang process kind.

* HTTP process (:mod:`.tokenizer`, ``TokenizerManager``): one request span per request id, built by
  the core from a :class:`~llm_otel.telemetry.RequestRecord`, GenAI metrics for every request.
* scheduler (:mod:`.scheduler`, ``Scheduler``): ``llm.engine.step`` per batch, linked to the sampled
  requests in it (the core's step API).

The carrier between them is :meth:`SGLangAdapter.carrier_getstate`. The adapter calls no tracer or
meter; every wrapper calls SGLang exactly as it was called and returns its result untouched; our own
failures are counted in ``llm_otel.instrumentation.errors`` and never reach SGLang.
"""

from __future__ import annotations

from llm_otel.instrumentation.sglang.scheduler import SchedulerAdapter
from llm_otel.instrumentation.sglang.tokenizer import CARRIER_ATTR, TokenizerAdapter
from llm_otel.telemetry import Telemetry

__all__ = ["SGLangAdapter"]


class SGLangAdapter:
    """Wrapper factories for the hooks in :mod:`.hooks` (``tokenizer.*``, ``scheduler.*``,
    ``carrier_getstate``)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.tokenizer = TokenizerAdapter(telemetry)
        self.scheduler = SchedulerAdapter(telemetry)

    def carrier_getstate(self, hook: str):
        """``APIServerReqTimeStats.__getstate__``: the state SGLang pickles to the scheduler gets the
        request span's carrier (``{"traceparent": ..., "tracestate": ...}``) under ``CARRIER_ATTR``;
        SGLang's ``__setstate__`` (``self.__dict__.update(state)``) makes it an attribute there."""

        def wrapper(wrapped, instance, args, kwargs):
            state = wrapped(*args, **kwargs)
            try:
                carrier = vars(instance).get(CARRIER_ATTR)
                if carrier is not None and isinstance(state, dict):
                    state = {**state, CARRIER_ATTR: carrier}
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return state

        return wrapper
