"""Global provider setup shared by ``instrument()`` and the instrumentors."""

from __future__ import annotations

import logging
import threading

from opentelemetry import metrics, trace

from llm_otel.config import Settings

logger = logging.getLogger("llm_otel")
_lock = threading.Lock()


def ensure_providers(settings: Settings) -> bool:
    """Install tracer/meter providers built from the environment where the application has none.

    Returns True when at least one provider was created here. Providers set by the application
    (or by ``opentelemetry-instrument`` with a distro) are left alone.
    """
    from llm_otel.export.providers import build_providers

    with _lock:
        need_tracer = isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        need_meter = type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
        if not (need_tracer or need_meter):
            return False
        tracer_provider, meter_provider = build_providers(settings)
        if need_tracer:
            trace.set_tracer_provider(tracer_provider)
        else:
            tracer_provider.shutdown()
        if need_meter:
            metrics.set_meter_provider(meter_provider)
        else:
            meter_provider.shutdown()
        return True
