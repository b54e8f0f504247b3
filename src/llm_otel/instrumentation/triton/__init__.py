"""OpenTelemetry instrumentation for the NVIDIA Triton Inference Server Python client (tritonclient 2.x).

Usage
-----
.. code-block:: python

    import llm_otel
    import tritonclient.grpc as grpcclient

    llm_otel.instrument()                       # or: instrument(engines=["triton"])
    client = grpcclient.InferenceServerClient("localhost:8001")
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    ...
    client.infer("my_llm", [text], request_id="r1")

or with explicit providers::

    from llm_otel.instrumentation.triton import TritonClientInstrumentor
    TritonClientInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

or without code changes: ``opentelemetry-instrument python app.py`` (entry point ``triton``).

Every inference call of ``tritonclient.http``, ``tritonclient.http.aio``, ``tritonclient.grpc``
and ``tritonclient.grpc.aio`` becomes a CLIENT span ``{text_completion|infer} {model}``; its
context goes to Triton as ``traceparent``/``tracestate`` in a copy of the call's headers, so a
Triton started with ``--trace-config mode=opentelemetry`` puts its ``InferRequest`` span under it.
gRPC streams get an ``llm.triton.stream`` span (the stream's metadata, hence the parent of
Triton's spans) and one CLIENT span per request with client-side response timing in
``llm.token_stream``. GenAI client metrics are recorded for every call. See docs/triton.md.

Configuration
-------------
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (false: error messages from the server
are not put on spans), ``LLM_OTEL_TOKEN_EVENTS`` (4: ``llm.stream.response`` events per
request) - see :class:`llm_otel.config.Settings`.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any, cast

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of type checking (a '# type: ignore' header)

from llm_otel.config import Settings
from llm_otel.instrumentation._hooks import (
    AppliedHook,
    ImportHooked,
    apply_hooks,
    library_missing,
    remove_hooks,
    telemetry_on_first_use,
)
from llm_otel.instrumentation.triton.adapter import TritonAdapter
from llm_otel.instrumentation.triton.hooks import HOOKS
from llm_otel.instrumentation.triton.package import _instruments

__all__ = ["TritonClientInstrumentor", "HOOKS"]
MODULES = sorted({h.module for h in HOOKS})


class TritonClientInstrumentor(ImportHooked, BaseInstrumentor):
    """Instruments tritonclient. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    The hooks are post-import hooks: each tritonclient module is wrapped when this process imports
    it (at once if it already has). Without providers the global ones are used, created from the
    ``OTEL_*`` environment at the first import of a hooked module when the application has set
    none - so a process that never imports tritonclient (``opentelemetry-instrument`` instruments
    every process, vLLM's engine processes included) gets no providers from it. ``adapter`` is None
    until then. Hook targets missing from the installed tritonclient are skipped with one warning
    each; ``uninstrument()`` restores every patched attribute.
    """

    ENGINE = "Triton client"
    SITE = "instrumentation.triton.import_hook"
    adapter: TritonAdapter | None = None
    _applied: list[AppliedHook] = []
    _lock = threading.RLock()  # a hooked import inside a hook (re-entry) must not deadlock

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument_engine(self, **kwargs: Any) -> None:
        if library_missing("tritonclient", self.ENGINE):
            return
        self._applied = []
        self._wait_for(MODULES, {**kwargs, "settings": kwargs.get("settings") or Settings.from_env()})

    def _first_use(self) -> TritonAdapter:
        pending = cast(dict[str, Any], self._pending)  # _on_import calls this only while it is set
        return TritonAdapter(telemetry_on_first_use(pending, __name__))

    def _hook_module(self, module) -> None:
        hooks = [h for h in HOOKS if h.module == module.__name__]
        self._applied.extend(apply_hooks(hooks, self.adapter, "tritonclient"))

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            remove_hooks(self._applied)
            self._applied = []
            self._stop()
