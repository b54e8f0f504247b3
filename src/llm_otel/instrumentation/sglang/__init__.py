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

Nothing of SGLang is imported here: the hooks are post-import hooks (hooks.py), applied in a process
that imports the module they target once that process constructs a ``TokenizerManager`` or a
``Scheduler`` (``hooks.SERVING``; the detokenizer, which imports both, stays untouched). A target that is missing gets one warning naming it; the
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

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of type checking (a '# type: ignore' header)

from llm_otel.config import Settings
from llm_otel.errors import process_errors
from llm_otel.instrumentation._hooks import (
    AppliedHook,
    Hook,
    ImportHooked,
    apply_hooks,
    remove_hooks,
    telemetry_on_first_use,
)
from llm_otel.instrumentation.sglang.adapter import SGLangAdapter
from llm_otel.instrumentation.sglang.hooks import GATE_MODULES, HOOKS, MODULES, RELEASES, SERVING
from llm_otel.instrumentation.sglang.package import _instruments

__all__ = ["SGLangInstrumentor", "HOOKS"]
logger = logging.getLogger("llm_otel")


class SGLangInstrumentor(ImportHooked, BaseInstrumentor):
    """Instruments SGLang. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    Without providers it uses the global ones, creating them from the ``OTEL_*`` environment when
    the process has none - when the process first constructs a ``TokenizerManager`` or a
    ``Scheduler`` (``hooks.SERVING``), so a process that only imports SGLang (its detokenizer) gets no
    providers, exporter process or hooks from it. ``adapter`` is None until then.
    """

    ENGINE = "SGLang"
    SITE = "instrumentation.sglang.import_hook"
    adapter: SGLangAdapter | None = None
    _applied: list[AppliedHook] = []
    _imported: dict[str, Any] = {}  # hooked modules imported before this process served (name -> module)
    _lock = threading.RLock()

    def instrumentation_dependencies(self) -> Collection[str]:
        """``sglang >= 0.5.22`` (package.py): the releases the contract goldens hold."""
        return _instruments

    def _instrument_engine(self, **kwargs: Any) -> None:
        if importlib.util.find_spec("sglang") is None:
            logger.debug("llm-otel: sglang is not importable here; its hooks wait for an import of it")
        settings = kwargs.get("settings") or Settings.from_env()
        self._applied, self._imported = [], {}
        self._wait_for([*MODULES, *GATE_MODULES], {**kwargs, "settings": settings})

    def _on_import(self, module) -> None:
        """Post-import hook. Until this process serves (:meth:`_serve`), only note the module and, for
        a module of ``hooks.SERVING``, wrap its class's ``__init__`` with the gate; afterwards, hook
        it at once (``ImportHooked._on_import``). Never raises."""
        name = getattr(module, "__name__", str(module))
        try:
            with self._lock:
                if self._pending is None or self.adapter is not None:
                    super()._on_import(module)
                    return
                if name in self._imported:
                    return
                self._imported[name] = module
                for module_name, target in SERVING:
                    if module_name != name:
                        continue
                    *path, attribute = target.split(".")
                    owner: Any = module
                    for part in path:
                        owner = getattr(owner, part)
                    gate = Hook(name, target, "gate", RELEASES, "this process serves")
                    original = vars(owner)[attribute]
                    wrapt.wrap_function_wrapper(owner, attribute, self._gate(owner if path else None))
                    self._applied.append(AppliedHook(gate, owner, attribute, original))
        except Exception as exc:  # noqa: BLE001
            process_errors().report(self.SITE, exc, f"could not instrument {name}; it runs uninstrumented")

    def _serve(self) -> bool:
        """This process constructs a ``TokenizerManager`` or ``Scheduler``: build the telemetry and
        hook every module imported so far. True when the adapter exists."""
        with self._lock:
            if self.adapter is None and self._pending is not None:
                for module in list(self._imported.values()):
                    super()._on_import(module)  # the first builds the adapter (and providers)
                self._imported = {}
            return self.adapter is not None

    def _gate(self, owner: type | None):
        """The wrapper of a ``SERVING`` call (``owner.__init__``, or a function when ``owner`` is
        None): the first call makes this process serve; a constructor then runs through the hooks
        just applied (they wrap this gate; ``Scheduler.__init__`` has its own)."""

        def gate(wrapped, instance, args, kwargs):
            serving = False
            if self.adapter is None and self._pending is not None:
                try:
                    serving = self._serve()
                except Exception as exc:  # noqa: BLE001
                    process_errors().report(self.SITE, exc, "could not instrument SGLang here")
            if serving and owner is not None:
                return owner.__init__(instance, *args, **kwargs)
            return wrapped(*args, **kwargs)

        return gate

    def _first_use(self) -> SGLangAdapter:
        pending = cast(dict[str, Any], self._pending)  # _on_import calls this only while it is set
        return SGLangAdapter(telemetry_on_first_use(pending, __name__))

    def _hook_module(self, module) -> None:
        hooks = [h for h in HOOKS if h.module == module.__name__]
        self._applied.extend(apply_hooks(hooks, self.adapter, self.ENGINE))

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            remove_hooks(self._applied)
            self._applied, self._imported = [], {}
            self._stop()
