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
