"""OpenTelemetry instrumentation for SGLang (sgl-project/sglang) across its processes.

Usage
-----
Zero-code, which reaches every SGLang process (the spawned ``sglang::scheduler`` and
``sglang::detokenizer`` are fresh interpreters that inherit ``opentelemetry-instrument``'s
``sitecustomize``)::

    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 OTEL_SERVICE_NAME=sglang \\
        opentelemetry-instrument python -m sglang.launch_server --model-path ...

In code (this process only; the scheduler runs in a spawned process, so serving needs the command
above for step spans)::

    from llm_otel.instrumentation.sglang import SGLangInstrumentor
    SGLangInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

Nothing of SGLang is imported here: the hooks are post-import hooks (hooks.py), applied in whichever
process imports the module they target. A target that is missing gets one warning naming it; the
rest keeps working. Spans: the request span ``{text_completion|chat} {model}`` (SERVER) with
``llm.prompt`` and ``llm.token_stream`` in the HTTP process, ``llm.engine.step`` in the scheduler -
one trace per request; with ``--enable-trace`` SGLang's own request root and stage spans nest under
the request span (they go through the same global provider: SGLang's ``set_tracer_provider`` finds
ours and keeps it). See docs/sglang.md.

Configuration: ``OTEL_*`` and ``LLM_OTEL_*`` as for the other engines (:class:`llm_otel.config.Settings`).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Collection
from typing import Any, cast

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of type checking (a '# type: ignore' header)

from llm_otel.config import Settings
from llm_otel.instrumentation._hooks import (
    AppliedHook,
    ImportHooked,
    apply_hooks,
    remove_hooks,
    telemetry_on_first_use,
)
from llm_otel.instrumentation.sglang.adapter import SGLangAdapter
from llm_otel.instrumentation.sglang.hooks import HOOKS, MODULES
from llm_otel.instrumentation.sglang.package import _instruments

__all__ = ["SGLangInstrumentor", "HOOKS"]
logger = logging.getLogger("llm_otel")


class SGLangInstrumentor(ImportHooked, BaseInstrumentor):
    """Instruments SGLang. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    Without providers it uses the global ones, creating them from the ``OTEL_*`` environment when
    the process has none - at the first import of an SGLang module it hooks, so a process that never
    imports SGLang gets no providers from it. ``adapter`` is None until then.
    """

    ENGINE = "SGLang"
    SITE = "instrumentation.sglang.import_hook"
    adapter: SGLangAdapter | None = None
    _applied: list[AppliedHook] = []
    _lock = threading.RLock()

    def instrumentation_dependencies(self) -> Collection[str]:
        """``sglang >= 0.5.22`` (package.py): the releases the contract goldens hold."""
        return _instruments

    def _instrument_engine(self, **kwargs: Any) -> None:
        if importlib.util.find_spec("sglang") is None:
            logger.debug("llm-otel: sglang is not importable here; its hooks wait for an import of it")
        settings = kwargs.get("settings") or Settings.from_env()
        self._applied = []
        self._wait_for(MODULES, {**kwargs, "settings": settings})

    def _first_use(self) -> SGLangAdapter:
        pending = cast(dict[str, Any], self._pending)  # _on_import calls this only while it is set
        return SGLangAdapter(telemetry_on_first_use(pending, __name__))

    def _hook_module(self, module) -> None:
        hooks = [h for h in HOOKS if h.module == module.__name__]
        self._applied.extend(apply_hooks(hooks, self.adapter, self.ENGINE))

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            remove_hooks(self._applied)
            self._applied = []
            self._stop()
