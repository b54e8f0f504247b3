"""Tracer and meter providers built from the standard ``OTEL_*`` environment.

Used by :func:`llm_otel.instrument` when the application has not set providers itself:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT`` set: batch
  export over OTLP, protocol from ``OTEL_EXPORTER_OTLP_{TRACES_,METRICS_,}PROTOCOL`` (``grpc``,
  the Python SDK's default, or ``http/protobuf``). The exporters read the rest of their
  ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, compression, insecure) themselves.
* ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` = ``none`` turns a signal off (e.g.
  metrics when the backend, like Jaeger, takes traces only);
* ``OTEL_METRICS_EXPORTER=prometheus``: a Prometheus pull endpoint per process
  (``OTEL_EXPORTER_PROMETHEUS_HOST``/``_PORT``, see :mod:`llm_otel.export.prometheus`);
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
import sys
import weakref
from typing import Mapping

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator

from llm_otel.config import (
    Settings,
    exporter_setting,
    otlp_endpoint,
    otlp_max_request_bytes,
    otlp_protocol,
    signal_endpoint,
    traces_sampler,
    validate_exporter_env,
)
from llm_otel.export.identity import current_process_identity, track
from llm_otel.sampling import Sampling, adaptive_sampler, trace_budget, traces_sampler_factory

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

    def generate_trace_id(self) -> int:
        value = self._rng.getrandbits(128)
        while not value:
            value = self._rng.getrandbits(128)
        return value


_ID_GENERATORS: "weakref.WeakSet[SystemRandomIdGenerator]" = weakref.WeakSet()


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


def prometheus_reader_from_env(env: Mapping[str, str] | None = None, role: str = "frontend"):
    """The Prometheus metric reader (endpoint started) when ``OTEL_METRICS_EXPORTER=prometheus``,
    else None; None with one warning when opentelemetry-exporter-prometheus is not installed.
    Raises ConfigError for a bad ``OTEL_EXPORTER_PROMETHEUS_PORT``."""
    env = os.environ if env is None else env
    if exporter_choice(env, "METRICS") != "prometheus":
        return None
    try:
        from llm_otel.export.prometheus import prometheus_reader
    except ImportError as exc:
        logger.warning("llm-otel: OTEL_METRICS_EXPORTER=prometheus needs opentelemetry-exporter-prometheus "
                       "(pip install 'llm-otel[prometheus]'): %s; metrics are not exported", exc)
        return None
    return prometheus_reader(env, role)


def span_exporter_from_env(env: Mapping[str, str] | None = None):
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
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from llm_otel.export.exporters import ProcessSpanExporter

    endpoint = signal_endpoint(env, "TRACES", proto)
    cap = otlp_max_request_bytes(env)
    return ProcessSpanExporter(lambda: OTLPSpanExporter(endpoint=endpoint), cap, endpoint)


def metric_exporter_from_env(env: Mapping[str, str] | None = None):
    """The OTLP metric exporter ``env`` asks for, or None without an endpoint (as above)."""
    env = os.environ if env is None else env
    if exporter_choice(env, "METRICS") != "otlp" or not otlp_endpoint(env, "METRICS"):
        return None
    proto = otlp_protocol(env, "METRICS")
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from llm_otel.export.exporters import ProcessMetricExporter

    endpoint = signal_endpoint(env, "METRICS", proto)
    return ProcessMetricExporter(lambda: OTLPMetricExporter(endpoint=endpoint), endpoint)


def build_providers(settings: Settings, env: Mapping[str, str] | None = None,
                    stream=None, shutdown_on_exit: bool = True) -> tuple[TracerProvider, MeterProvider]:
    """Tracer and meter providers for this process (:func:`build_providers_and_sampling` without
    the sampler's parts)."""
    tracer_provider, meter_provider, _ = build_providers_and_sampling(settings, env, stream, shutdown_on_exit)
    return tracer_provider, meter_provider


def build_providers_and_sampling(settings: Settings, env: Mapping[str, str] | None = None, stream=None,
                                 shutdown_on_exit: bool = True) -> tuple[TracerProvider, MeterProvider, Sampling | None]:
    """Tracer and meter providers for this process, configured from ``settings`` and the exporter
    variables of ``env`` (``os.environ``), and the parts of llm-otel's adaptive sampler the tracer
    provider uses (:class:`llm_otel.sampling.Sampling`: root sampler, poller, engine occupancy,
    drift listener), None when it samples otherwise; ``instrument()`` hands them to ``Telemetry``.

    ``shutdown_on_exit=False``: the SDK registers no unbounded exit handler; the caller hands the
    providers to :mod:`llm_otel.export.lifecycle` (as :func:`llm_otel._setup.ensure_providers` does).

    Raises ConfigError, before creating anything, for an unknown ``OTEL_{TRACES,METRICS}_EXPORTER``
    or an unsupported ``OTEL_EXPORTER_OTLP*_PROTOCOL`` (with or without an endpoint).
    """
    from llm_otel.export.console import ConsoleMetricsSummary, ConsoleTreeExporter, JsonLinesExporter

    env = os.environ if env is None else env
    validate_exporter_env(env)
    resource = Resource.create(current_process_identity())  # + OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    sampler = _adaptive_sampler(settings, env)
    sampling = sampler.sampling if sampler is not None else None
    poller = sampling.poller if sampling is not None else None
    span_exporter = span_exporter_from_env(env)
    offload = span_exporter is not None and settings.export_process
    tracer_provider = TracerProvider(resource=resource, id_generator=SystemRandomIdGenerator(), sampler=sampler,
                                     shutdown_on_exit=shutdown_on_exit and not offload)
    if offload:
        # spans leave this process as compact records; the SDK provider above is only the
        # source of its sampler (the env default when None) and id generator
        from llm_otel.export.offload.recorder import OffloadTracerProvider

        span_exporter.shutdown()  # its twin is built in the exporter process
        tracer_provider = OffloadTracerProvider(resource, tracer_provider.sampler, tracer_provider.id_generator,
                                                span_exporter.endpoint, settings.export_process_buffer, env)
        span_exporter = tracer_provider.buffer
    if poller is not None:
        # the poller's thread ends with the provider that reads it. A weakref callback, not
        # weakref.finalize: the first finalize() registers weakref's atexit hook, and one registered
        # before multiprocessing's would run after it - multiprocessing would then join vLLM's
        # engine-core process before vLLM's own finalizers shut it down, and the process would hang
        poller.owner = weakref.ref(tracer_provider, lambda _ref, stop=poller.stop: stop())
    readers: list[MetricReader] = []
    stream = stream or sys.stderr
    if span_exporter is not None:
        if not offload:  # (offloaded: the exporter process exports)
            tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    elif exporter_choice(env, "TRACES") == "none":
        pass
    elif settings.console in ("auto", "tree"):
        tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleTreeExporter(stream)))
    elif settings.console == "json":
        tracer_provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(stream)))
    metric_exporter = metric_exporter_from_env(env)
    if metric_exporter is not None:
        readers.append(PeriodicExportingMetricReader(metric_exporter))
    elif exporter_choice(env, "METRICS") == "prometheus":
        reader = prometheus_reader_from_env(env, "frontend")
        if reader is not None:
            readers.append(reader)
    elif exporter_choice(env, "METRICS") != "none" and settings.console in ("auto", "tree"):
        readers.append(ConsoleMetricsSummary(stream))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=shutdown_on_exit)
    if metric_exporter is not None and getattr(tracer_provider, "buffer", None) is not None:
        # the GenAI request metrics may be recorded by the exporter process too (over OTLP, same
        # resource): llm_otel.export.offload.request_outlets hands them to Telemetry; Prometheus and
        # console metrics are read in this process and stay here; so do all other metrics
        tracer_provider.metrics_with = meter_provider
    if span_exporter is not None:
        span_exporter.bind(meter_provider)  # its lost spans count in llm_otel.spans.dropped
    # re-labelled when this process learns its role later (identity.relabel: a LightLLM child) or is
    # forked (its own pid and instance id)
    track(tracer_provider, meter_provider)
    if sampling is not None and sampling.gpu_poller is not None:
        register_utilization_gauge(meter_provider, sampling.gpu_poller)
    return tracer_provider, meter_provider, sampling


def _adaptive_sampler(settings: Settings, env: Mapping[str, str]):
    """llm-otel's adaptive sampler when configured (``LLM_OTEL_ADAPTIVE_SAMPLING`` ``auto``/``on``,
    and ``OTEL_TRACES_SAMPLER`` unset or ``llm_otel_adaptive``), else None (the SDK's choice). Its
    poller follows NVML GPU utilisation, or engine occupancy where NVML sees no GPU; the trace
    budget is ``settings.traces_per_s`` (``LLM_OTEL_TRACES_PER_S``) either way."""
    name, arg = traces_sampler(env)
    if name == "llm_otel_adaptive":
        return traces_sampler_factory(arg, settings.traces_per_s)
    if name or settings.adaptive_sampling == "off":
        return None
    return adaptive_sampler(budget=trace_budget(settings.traces_per_s))


def register_utilization_gauge(meter_provider, poller) -> None:
    """Observable gauge ``hw.gpu.utilization`` (1) reading the poller's smoothed value."""
    from opentelemetry.metrics import Observation

    from llm_otel.semconv import metrics as M

    def observe(_options):
        value = poller.utilization
        return [] if value is None else [Observation(value)]

    meter_provider.get_meter("llm_otel").create_observable_gauge(
        M.HW_GPU_UTILIZATION, callbacks=[observe], unit=M.HW_GPU_UTILIZATION_UNIT,
        description="Smoothed utilisation of the GPUs this process uses (0-1).")
