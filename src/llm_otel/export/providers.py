"""The exporters this process's providers use, from the standard ``OTEL_*`` environment, and the
id generator.

The providers themselves are built by :mod:`llm_otel.process.providers` (the one recipe, for
:func:`llm_otel.instrument` when the application has not set providers itself, and for vLLM's
engine processes); this module only turns settings into export objects:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT`` set: batch
  export over OTLP, protocol from ``OTEL_EXPORTER_OTLP_{TRACES_,METRICS_,}PROTOCOL`` (``grpc``,
  the Python SDK's default, or ``http/protobuf``). The exporters read the rest of their
  ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression, insecure) themselves.
* ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` = ``none`` turns a signal off (e.g.
  metrics when the backend, like Jaeger, takes traces only);
* ``OTEL_METRICS_EXPORTER=prometheus``: a Prometheus pull endpoint per process
  (``OTEL_EXPORTER_PROMETHEUS_HOST``/``_PORT``, see :mod:`llm_otel.export.prometheus`; the port
  of each process is :mod:`llm_otel.process.ports`'s);
* with an OTLP span exporter and ``LLM_OTEL_EXPORT_PROCESS`` on (default): spans are exported by
  a separate exporter process (:mod:`llm_otel.export.offload`; the tracer provider is an
  :class:`~llm_otel.export.offload.OffloadTracerProvider`), and the per-request GenAI metrics
  are recorded there too (one record per finished request); gauges and drop counters stay in this
  process;
* otherwise: readable console output - each finished trace as an indented tree on stderr
  (``LLM_OTEL_CONSOLE=tree``, default; ``json`` for one JSON span per line; ``off``), and a
  metrics summary at exit.

Ids come from :class:`SystemRandomIdGenerator`: vLLM seeds Python's global ``random`` in its
processes (seed 0 by default), which would make the SDK's default generator repeat the same
trace and span ids in every run and every process.
"""

from __future__ import annotations

import logging
import os
import random
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from opentelemetry.sdk.trace.id_generator import IdGenerator

from llm_otel.config import exporter_setting, otlp_endpoint, otlp_max_request_bytes, otlp_protocol, signal_endpoint

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

    from llm_otel.export.exporters import ProcessMetricExporter, ProcessSpanExporter

logger = logging.getLogger("llm_otel")


class SystemRandomIdGenerator(IdGenerator):
    """Trace and span ids from a private generator seeded from the OS entropy pool (``os.urandom``)
    and re-seeded in every forked child: immune to ``random.seed`` (vLLM seeds the global generator
    with the same value in every process, which makes the SDK's default generator repeat ids
    across processes), and as cheap as that default (no system call per id)."""

    def __init__(self) -> None:
        self._rng = random.Random(os.urandom(32))
        _ID_GENERATORS.add(self)

    def reseed(self) -> None:
        self._rng.seed(os.urandom(32))

    def generate_span_id(self) -> int:
        value = self._rng.getrandbits(64)
        while not value:
            value = self._rng.getrandbits(64)
        return value

    def is_trace_id_random(self) -> bool:
        """True: every bit of a trace id is random, so roots carry the W3C random flag (0x02) and
        consistent samplers may read the threshold's randomness from the id (OTEP 235)."""
        return True

    def generate_trace_id(self) -> int:
        value = self._rng.getrandbits(128)
        while not value:
            value = self._rng.getrandbits(128)
        return value


_ID_GENERATORS: weakref.WeakSet[SystemRandomIdGenerator] = weakref.WeakSet()


def _reseed_id_generators() -> None:
    for generator in list(_ID_GENERATORS):
        generator.reseed()


if hasattr(os, "register_at_fork"):  # a forked child must not repeat its parent's ids
    os.register_at_fork(after_in_child=_reseed_id_generators)


def exporter_choice(env: Mapping[str, str], signal: str) -> str:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``otlp`` (default), ``console``,
    ``none``, or for metrics ``prometheus``. Raises ConfigError naming the variable and the
    accepted values for anything else (see :func:`llm_otel.config.exporter_setting`)."""
    return exporter_setting(env, signal)


def span_exporter_from_env(env: Mapping[str, str] | None = None) -> ProcessSpanExporter | None:
    """The OTLP span exporter ``env`` (default ``os.environ``) asks for, or None without an endpoint.

    The endpoint is taken from ``env``; headers, timeout, compression and TLS settings from the
    process environment, as the exporters read them. The exporter is wrapped in
    :class:`~llm_otel.export.exporters.ProcessSpanExporter`: rebuilt in a forked child, requests
    under ``LLM_OTEL_OTLP_MAX_REQUEST_BYTES``, lost spans counted in ``llm_otel.spans.dropped`` once
    ``bind(meter_provider)`` was called, and logged once per outage."""
    env = os.environ if env is None else env
    if exporter_choice(env, "TRACES") != "otlp" or not otlp_endpoint(env, "TRACES"):
        return None
    proto = otlp_protocol(env, "TRACES")
    otlp_span_exporter: Callable[..., SpanExporter]  # the gRPC or the HTTP class
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        otlp_span_exporter = GrpcSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        otlp_span_exporter = HttpSpanExporter
    from llm_otel.export.exporters import ProcessSpanExporter

    endpoint = signal_endpoint(env, "TRACES", proto)
    cap = otlp_max_request_bytes(env)
    return ProcessSpanExporter(lambda: otlp_span_exporter(endpoint=endpoint), cap, endpoint)


def metric_exporter_from_env(env: Mapping[str, str] | None = None) -> ProcessMetricExporter | None:
    """The OTLP metric exporter ``env`` asks for, or None without an endpoint (as above)."""
    env = os.environ if env is None else env
    if exporter_choice(env, "METRICS") != "otlp" or not otlp_endpoint(env, "METRICS"):
        return None
    proto = otlp_protocol(env, "METRICS")
    otlp_metric_exporter: Callable[..., MetricExporter]  # the gRPC or the HTTP class
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter

        otlp_metric_exporter = GrpcMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        otlp_metric_exporter = HttpMetricExporter
    from llm_otel.export.exporters import ProcessMetricExporter

    endpoint = signal_endpoint(env, "METRICS", proto)
    return ProcessMetricExporter(lambda: otlp_metric_exporter(endpoint=endpoint), endpoint)
