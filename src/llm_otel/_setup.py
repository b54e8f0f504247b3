"""Global provider setup shared by ``instrument()`` and the instrumentors."""

from __future__ import annotations

import logging
import threading

from opentelemetry import metrics, trace

from llm_otel.config import Settings
from llm_otel.sampling import Sampling

logger = logging.getLogger("llm_otel")
_lock = threading.Lock()
# the sampler parts of the global tracer provider installed here (None: none installed here, or
# it samples without llm-otel's adaptive sampler)
_installed_sampling: Sampling | None = None


def ensure_providers(settings: Settings) -> Sampling | None:
    """Install tracer/meter providers built from the environment where the application has none.

    Returns the parts of llm-otel's adaptive sampler (:class:`llm_otel.sampling.Sampling`) that
    the global tracer provider installed here - now or by an earlier call - samples with, for the
    ``Telemetry`` the caller builds; None when the global tracer provider is the application's (or
    samples otherwise). Providers set by the application (or by ``opentelemetry-instrument`` with
    a distro) are left alone. Providers created here are flushed by this process's lifecycle
    (:mod:`llm_otel.export.lifecycle`) within ``LLM_OTEL_FLUSH_DEADLINE_S`` at exit, not by the
    SDK's unbounded exit handler.
    """
    from llm_otel.export.lifecycle import lifecycle
    from llm_otel.export.providers import build_providers_and_sampling

    global _installed_sampling
    with _lock:
        need_tracer = isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        need_meter = type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
        if not (need_tracer or need_meter):
            return _installed_sampling
        tracer_provider, meter_provider, sampling = build_providers_and_sampling(settings, shutdown_on_exit=False)
        life = lifecycle(deadline_s=settings.flush_deadline_s)
        if need_tracer:
            trace.set_tracer_provider(tracer_provider)
            life.add(tracer_provider=tracer_provider, exporters=exporters_of(tracer_provider))
            _installed_sampling = sampling
        else:
            tracer_provider.shutdown()
        if need_meter:
            metrics.set_meter_provider(meter_provider)
            life.add(meter_provider=meter_provider, exporters=exporters_of(meter_provider))
        else:
            meter_provider.shutdown()
        return _installed_sampling


def global_where_none(tracer_provider) -> bool:
    """Make ``tracer_provider`` the global tracer provider when this process has none yet (an
    application's or a distro's is kept); True when it did. Used in vLLM's engine processes, whose
    own providers are built for llm-otel's spans, so that vLLM's own start-up spans there use them."""
    with _lock:
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return False
        trace.set_tracer_provider(tracer_provider)
        return True


def exporters_of(provider) -> list:
    """The llm-otel exporter wrappers behind ``provider``'s span processors or metric readers
    (for the final flush's accounting)."""
    from llm_otel.export.exporters import ProcessMetricExporter, ProcessSpanExporter
    from llm_otel.export.offload import MetricAccount, OffloadBuffer

    found = []
    buffer = getattr(provider, "buffer", None)  # OffloadTracerProvider: spans in an exporter process
    if buffer is not None:
        found.extend((buffer, buffer.metric_account))
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ()) or ()
    for processor in processors:
        inner = getattr(processor, "_batch_processor", None)
        found.append(getattr(inner, "_exporter", None) or getattr(processor, "span_exporter", None))
    readers = getattr(getattr(provider, "_sdk_config", None), "metric_readers", ()) or ()
    found.extend(getattr(reader, "_exporter", None) for reader in readers)
    return [e for e in found if isinstance(e, (ProcessSpanExporter, ProcessMetricExporter, OffloadBuffer, MetricAccount))]
