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

from typing import Any, Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from llm_otel.config import ConfigError, Settings
from llm_otel.instrumentation._hooks import AppliedHook, configuration_refused, apply_hooks, library_missing, remove_hooks
from llm_otel.instrumentation.triton.adapter import TritonAdapter
from llm_otel.instrumentation.triton.hooks import HOOKS
from llm_otel.instrumentation.triton.package import _instruments
from llm_otel.telemetry import Telemetry

__all__ = ["TritonClientInstrumentor", "HOOKS"]


class TritonClientInstrumentor(BaseInstrumentor):
    """Instruments tritonclient. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    Without providers it uses the global ones, creating them from the ``OTEL_*`` environment when
    the application has set none. Hook targets missing from the installed tritonclient are
    skipped with one warning each; ``uninstrument()`` restores every patched attribute.
    """

    adapter: TritonAdapter | None = None
    _applied: list[AppliedHook] = []

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        try:
            self._instrument_engine(**kwargs)
        except ConfigError as exc:
            configuration_refused("Triton client", exc)

    def _instrument_engine(self, **kwargs: Any) -> None:
        from llm_otel._setup import ensure_providers

        if library_missing("tritonclient", "Triton client"):
            return
        settings = kwargs.get("settings") or Settings.from_env()
        tracer_provider = kwargs.get("tracer_provider")
        meter_provider = kwargs.get("meter_provider")
        sampling = kwargs.get("sampling")  # the adaptive sampler's parts, from instrument()
        if tracer_provider is None and meter_provider is None:
            sampling = ensure_providers(settings) or sampling
        telemetry = Telemetry(tracer_provider, meter_provider, settings, scope=__name__, sampling=sampling)
        self.adapter = TritonAdapter(telemetry)
        self._applied = apply_hooks(HOOKS, self.adapter, "tritonclient")

    def _uninstrument(self, **kwargs: Any) -> None:
        remove_hooks(self._applied)
        self._applied = []
        self.adapter = None
