"""Failures inside llm-otel's own hooks: counted, logged once per hook, never raised into the engine."""

from __future__ import annotations

import logging
import threading

from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")


class HookErrors:
    """Counts exceptions caught in hooks into ``llm_otel.instrumentation.errors`` ({error}).

    ``report(hook, exc)`` is safe to call from any thread; the first failure of each hook is
    logged with its traceback, later ones only counted (``counts`` keeps totals for tests/doctor).
    ``bad_input(hook, problem)`` is for input a caller got wrong (not a bug of ours): the same
    count (``error.type=invalid_input``), and the first one per hook logged as one line without a
    traceback.
    """

    def __init__(self, meter=None) -> None:
        self._counter = None
        if meter is not None:
            self._counter = meter.create_counter(
                M.LLM_OTEL_INSTRUMENTATION_ERRORS, unit=M.LLM_OTEL_INSTRUMENTATION_ERRORS_UNIT,
                description="Exceptions raised inside llm-otel hooks, caught and kept away from the engine.")
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def report(self, hook: str, exc: BaseException) -> None:
        try:
            with self._lock:
                self.counts[hook] = self.counts.get(hook, 0) + 1
                first = hook not in self._logged
                self._logged.add(hook)
            if first:
                logger.warning("llm-otel: hook %s failed; the engine is unaffected and further "
                               "failures of this hook are only counted", hook, exc_info=exc)
            if self._counter is not None:
                self._counter.add(1, {A.LLM_INSTRUMENTATION_HOOK: hook,
                                      A.ERROR_TYPE: type(exc).__qualname__})
        except Exception:  # noqa: BLE001 - telemetry about telemetry must not raise either
            pass

    def bad_input(self, hook: str, problem: str) -> None:
        """Count a call of ``hook`` rejected for bad input; log ``problem`` once per hook, one line."""
        try:
            with self._lock:
                self.counts[hook] = self.counts.get(hook, 0) + 1
                key = f"{hook} (bad input)"
                first = key not in self._logged
                self._logged.add(key)
            if first:
                logger.warning("llm-otel: %s ignored a call with bad input (%s); the engine is unaffected and "
                               "further bad input here is only counted", hook, problem)
            if self._counter is not None:
                self._counter.add(1, {A.LLM_INSTRUMENTATION_HOOK: hook, A.ERROR_TYPE: "invalid_input"})
        except Exception:  # noqa: BLE001
            pass
