"""The one recipe for this process's tracer and meter providers.

Every caller that needs llm-otel's own providers builds them here: ``llm_otel.instrument()`` (the
face) and the engine instrumentors' first use (:class:`llm_otel.instrumentation._hooks.ImportHooked`
through :func:`telemetry_on_first_use`, which also builds the core's ``Telemetry`` on them; vLLM's
frontend activation) through :func:`ensure_providers`, which installs them as the global
providers where the application has none; vLLM's engine-core and worker processes through
:func:`engine_process_providers` (called by the vLLM plugin, at a spawned child's bootstrap or at
activation); LightLLM's processes get theirs from :func:`ensure_providers` at the first hooked
import and are re-labelled later (:func:`llm_otel.process.identity.relabel`).

What goes into them:

* the resource: this process's identity (:func:`llm_otel.process.identity.current_process_identity`:
  role, pid, host, instance id, and the indices an engine adapter reads) + ``OTEL_SERVICE_NAME`` /
  ``OTEL_RESOURCE_ATTRIBUTES``;
* ids from :class:`llm_otel.export.providers.SystemRandomIdGenerator`;
* the sampler: llm-otel's adaptive sampler when configured (:func:`_adaptive_sampler`), in the
  process where requests start;
* the export objects (:mod:`llm_otel.export`): OTLP span/metric exporters from the ``OTEL_*``
  variables (:mod:`llm_otel.export.providers`), the exporter process
  (:class:`llm_otel.export.offload.OffloadTracerProvider`: spans leave as compact records), the
  Prometheus reader on this process's port (:mod:`llm_otel.process.ports`), or the console tree;
* registration with this process's lifecycle (:mod:`llm_otel.process.lifecycle`: the bounded
  final flush) and with identity tracking (re-labels, fork).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, TextIO, cast

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import Sampler

from llm_otel.config import Settings, traces_sampler, validate_exporter_env
from llm_otel.errors import process_errors
from llm_otel.export.providers import (
    SystemRandomIdGenerator,
    exporter_choice,
    metric_exporter_from_env,
    span_exporter_from_env,
)
from llm_otel.process.identity import annotated, current_process_identity, track
from llm_otel.process.lifecycle import ProcessLifecycle, lifecycle
from llm_otel.process.ports import prometheus_reader_from_env
from llm_otel.sampling import Sampling, adaptive_sampler, trace_budget, traces_sampler_factory

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Observation

    from llm_otel.export.exporters import ProcessMetricExporter, ProcessSpanExporter
    from llm_otel.export.offload import MetricAccount, OffloadBuffer, OffloadTracerProvider
    from llm_otel.gpu.nvml import UtilizationReader
    from llm_otel.telemetry import Telemetry

logger = logging.getLogger("llm_otel")
_lock = threading.Lock()
# the sampler parts of the global tracer provider installed here (None: none installed here, or
# it samples without llm-otel's adaptive sampler)
_installed_sampling: Sampling | None = None


class _WithSampling(Protocol):
    """llm-otel's adaptive sampler (what :func:`llm_otel.sampling.adaptive_sampler` returns):
    it carries the parts it was built with."""

    sampling: Sampling


class _OwnedPoller(Protocol):
    """The adaptive sampler's default poller (:class:`llm_otel.gpu.nvml.UtilizationPoller`): its
    thread ends with the tracer provider ``owner`` refers to."""

    owner: weakref.ref[Any] | None

    def stop(self) -> None: ...


class _MetricsWith(Protocol):
    """An :class:`~llm_otel.export.offload.OffloadTracerProvider`'s ``metrics_with`` as documented
    there (the meter provider built with it, or None); its own annotation infers ``None`` only."""

    metrics_with: MeterProvider | None


def ensure_providers(settings: Settings) -> Sampling | None:
    """Install tracer/meter providers built from the environment where the application has none.

    Returns the parts of llm-otel's adaptive sampler (:class:`llm_otel.sampling.Sampling`) that
    the global tracer provider installed here - now or by an earlier call - samples with, for the
    ``Telemetry`` the caller builds; None when the global tracer provider is the application's (or
    samples otherwise). Providers set by the application (or by ``opentelemetry-instrument`` with
    a distro) are left alone. Providers created here are flushed by this process's lifecycle
    (:mod:`llm_otel.process.lifecycle`) within ``LLM_OTEL_FLUSH_DEADLINE_S`` at exit, not by the
    SDK's unbounded exit handler.
    """
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


def telemetry_on_first_use(kwargs: dict[str, Any], scope: str) -> Telemetry:
    """The :class:`llm_otel.telemetry.Telemetry` of an instrumentor whose library this process has
    just imported (called from its post-import hook, not from ``instrument()``).

    ``kwargs`` are ``instrument()``'s: ``settings`` (already validated there), ``tracer_provider``/
    ``meter_provider`` (the application's: used as given) and ``sampling`` (the adaptive sampler's
    parts from ``llm_otel.instrument()``). Without providers the global ones are used, installed
    from the ``OTEL_*`` environment now when the process has none
    (:func:`ensure_providers`). Building them here and not at ``instrument()``
    matters under ``opentelemetry-instrument``, which runs every installed instrumentor in every
    process: a process that never imports the library (a vLLM engine-core or worker process, a
    tool the application starts) gets no global providers and no exporter process from it.
    Raises :class:`llm_otel.config.ConfigError` for an invalid exporter setting."""
    from llm_otel.export.offload import request_outlets
    from llm_otel.telemetry import Telemetry

    tracer_provider, meter_provider = kwargs.get("tracer_provider"), kwargs.get("meter_provider")
    sampling = kwargs.get("sampling")
    if tracer_provider is None and meter_provider is None:
        sampling = ensure_providers(kwargs["settings"]) or sampling
    return Telemetry(
        tracer_provider,
        meter_provider,
        kwargs["settings"],
        scope=scope,
        sampling=sampling,
        outlets=request_outlets(tracer_provider, meter_provider),
    )


def global_where_none(tracer_provider: trace.TracerProvider) -> bool:
    """Make ``tracer_provider`` the global tracer provider when this process has none yet (an
    application's or a distro's is kept); True when it did. Used in vLLM's engine processes, whose
    own providers are built for llm-otel's spans, so that vLLM's own start-up spans there use them."""
    with _lock:
        if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return False
        trace.set_tracer_provider(tracer_provider)
        return True


def exporters_of(
    provider: object,
) -> list[ProcessSpanExporter | ProcessMetricExporter | OffloadBuffer | MetricAccount]:
    """The llm-otel exporter wrappers behind ``provider``'s span processors or metric readers
    (for the final flush's accounting)."""
    from llm_otel.export.exporters import ProcessMetricExporter, ProcessSpanExporter
    from llm_otel.export.offload import MetricAccount, OffloadBuffer

    found: list[object] = []
    buffer = getattr(provider, "buffer", None)  # OffloadTracerProvider: spans in an exporter process
    if buffer is not None:
        found.extend((buffer, buffer.metric_account))
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ()) or ()
    for processor in processors:
        inner = getattr(processor, "_batch_processor", None)
        found.append(getattr(inner, "_exporter", None) or getattr(processor, "span_exporter", None))
    readers = getattr(getattr(provider, "_sdk_config", None), "metric_readers", ()) or ()
    found.extend(getattr(reader, "_exporter", None) for reader in readers)
    return [
        e for e in found if isinstance(e, (ProcessSpanExporter, ProcessMetricExporter, OffloadBuffer, MetricAccount))
    ]


def build_providers(
    settings: Settings,
    env: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
    shutdown_on_exit: bool = True,
) -> tuple[TracerProvider | OffloadTracerProvider, MeterProvider]:
    """Tracer and meter providers for this process (:func:`build_providers_and_sampling` without
    the sampler's parts)."""
    tracer_provider, meter_provider, _ = build_providers_and_sampling(settings, env, stream, shutdown_on_exit)
    return tracer_provider, meter_provider


def build_providers_and_sampling(
    settings: Settings,
    env: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
    shutdown_on_exit: bool = True,
) -> tuple[TracerProvider | OffloadTracerProvider, MeterProvider, Sampling | None]:
    """Tracer and meter providers for this process, configured from ``settings`` and the exporter
    variables of ``env`` (``os.environ``), and the parts of llm-otel's adaptive sampler the tracer
    provider uses (:class:`llm_otel.sampling.Sampling`: root sampler, poller, engine occupancy,
    drift listener), None when it samples otherwise; ``instrument()`` hands them to ``Telemetry``.

    ``shutdown_on_exit=False``: the SDK registers no unbounded exit handler; the caller hands the
    providers to :mod:`llm_otel.process.lifecycle` (as :func:`ensure_providers` does).

    Raises ConfigError, before creating anything, for an unknown ``OTEL_{TRACES,METRICS}_EXPORTER``
    or an unsupported ``OTEL_EXPORTER_OTLP*_PROTOCOL`` (with or without an endpoint).
    """
    from llm_otel.export.console import ConsoleMetricsSummary, ConsoleTreeExporter, JsonLinesExporter

    env = os.environ if env is None else env
    validate_exporter_env(env)
    resource = Resource.create(current_process_identity())  # + OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    sampler = _adaptive_sampler(settings, env)
    # the adaptive sampler (llm_otel.sampling.adaptive_sampler's) carries the parts it was built with
    sampling = cast(_WithSampling, sampler).sampling if sampler is not None else None
    poller = sampling.poller if sampling is not None else None
    span_exporter = span_exporter_from_env(env)
    # what counts this process's lost spans: the span exporter, or the exporter process's buffer
    counted: ProcessSpanExporter | OffloadBuffer | None = span_exporter
    offload = span_exporter is not None and settings.export_process
    sdk_tracer_provider = TracerProvider(
        resource=resource,
        id_generator=SystemRandomIdGenerator(),
        sampler=sampler,
        shutdown_on_exit=shutdown_on_exit and not offload,
    )
    tracer_provider: TracerProvider | OffloadTracerProvider = sdk_tracer_provider
    offload_provider: OffloadTracerProvider | None = None
    if offload and span_exporter is not None:
        # spans leave this process as compact records; the SDK provider above is only the
        # source of its sampler (the env default when None) and id generator
        from llm_otel.export.offload import OffloadTracerProvider

        span_exporter.shutdown()  # its twin is built in the exporter process
        tracer_provider = offload_provider = OffloadTracerProvider(
            resource,
            sdk_tracer_provider.sampler,
            sdk_tracer_provider.id_generator,
            span_exporter.endpoint,
            settings.export_process_buffer,
            env,
        )
        counted = offload_provider.buffer
    if poller is not None:
        # the poller's thread ends with the provider that reads it. A weakref callback, not
        # weakref.finalize: the first finalize() registers weakref's atexit hook, and one registered
        # before multiprocessing's would run after it - multiprocessing would then join vLLM's
        # engine-core process before vLLM's own finalizers shut it down, and the process would hang
        owned = cast(_OwnedPoller, poller)  # the sampler's default poller (a UtilizationPoller)
        stop = owned.stop

        def _stop_poller(_ref: weakref.ref[Any]) -> None:
            stop()

        owned.owner = weakref.ref(tracer_provider, _stop_poller)
    readers: list[MetricReader] = []
    stream = stream or sys.stderr
    if counted is not None:
        if span_exporter is not None and not offload:  # (offloaded: the exporter process exports)
            sdk_tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    elif exporter_choice(env, "TRACES") == "none":
        pass
    elif settings.console in ("auto", "tree"):
        sdk_tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleTreeExporter(stream)))
    elif settings.console == "json":
        sdk_tracer_provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(stream)))
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
    if metric_exporter is not None and offload_provider is not None and offload_provider.buffer is not None:
        # the GenAI request metrics may be recorded by the exporter process too (over OTLP, same
        # resource): whoever builds Telemetry passes llm_otel.export.offload.request_outlets; Prometheus and
        # console metrics are read in this process and stay here; so do all other metrics
        cast(_MetricsWith, offload_provider).metrics_with = meter_provider
    if counted is not None:
        counted.bind(meter_provider)  # its lost spans count in llm_otel.spans.dropped
    # re-labelled when this process learns its role later (identity.relabel: a LightLLM child) or is
    # forked (its own pid and instance id)
    track(tracer_provider, meter_provider)
    if sampling is not None and sampling.gpu_poller is not None:
        register_utilization_gauge(meter_provider, sampling.gpu_poller)
    return tracer_provider, meter_provider, sampling


def _adaptive_sampler(settings: Settings, env: Mapping[str, str]) -> Sampler | None:
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


def register_utilization_gauge(meter_provider: MeterProvider, poller: UtilizationReader) -> None:
    """Observable gauge ``hw.gpu.utilization`` (1) reading the poller's smoothed value."""
    from opentelemetry.metrics import Observation

    from llm_otel.semconv import metrics as M

    def observe(_options: CallbackOptions) -> list[Observation]:
        value = poller.utilization
        return [] if value is None else [Observation(value)]

    meter_provider.get_meter("llm_otel").create_observable_gauge(
        M.HW_GPU_UTILIZATION,
        callbacks=[observe],
        unit=M.HW_GPU_UTILIZATION_UNIT,
        description="Smoothed utilisation of the GPUs this process uses (0-1).",
    )


def engine_process_providers(
    role: str, env: Mapping[str, str] | None = None
) -> tuple[TracerProvider, MeterProvider, ProcessLifecycle]:
    """Tracer and meter providers of an engine process that serves no requests of its own (vLLM's
    engine core and workers: they sample as the frontend decided, the SDK's default): from the
    ``OTEL_*`` exporter variables, resource with ``llm.process.role`` = ``role``, batch OTLP span
    export (without an endpoint their spans are dropped: the frontend shows the request trees),
    metrics over OTLP or on this process's Prometheus port (engine core: port + 1 + DP rank).
    Registered with this process's lifecycle as ``role`` (flushed on every orderly exit, within
    ``LLM_OTEL_FLUSH_DEADLINE_S``); the tracer provider becomes the global one where the process
    has none (the engine's own start-up spans use it). Returns ``(tracer_provider, meter_provider,
    lifecycle)``; the caller adds what completes its pending telemetry
    (:meth:`~llm_otel.process.lifecycle.ProcessLifecycle.before_flush`). Raises ConfigError for an
    invalid exporter setting."""
    resource = Resource.create(current_process_identity(role))  # role, pid, host, ranks, instance id
    tracer_provider = TracerProvider(resource=resource, id_generator=SystemRandomIdGenerator(), shutdown_on_exit=False)
    exporter = span_exporter_from_env(env)
    if exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    metric_exporter = metric_exporter_from_env(env)
    readers: list[MetricReader] = (
        [PeriodicExportingMetricReader(metric_exporter)] if metric_exporter is not None else []
    )
    if metric_exporter is None:
        try:
            prometheus = prometheus_reader_from_env(env, role=role)  # engine core: port + 1 + DP rank
        except Exception as exc:  # noqa: BLE001 - a bad port must not stop the engine process
            process_errors().report(
                "instrumentation.vllm.plugin.prometheus", exc, f"no Prometheus endpoint in this {role} process"
            )
            prometheus = None
        if prometheus is not None:
            readers.append(prometheus)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    if exporter is not None:
        exporter.bind(meter_provider)  # its lost spans count in llm_otel.spans.dropped
    annotated(tracer_provider, meter_provider)  # e.g. the instance's disaggregation role, once known
    life = lifecycle(role)
    life.add(tracer_provider, meter_provider, exporters=(exporter, metric_exporter))
    # the engine's own start-up spans (vLLM's "EngineCoreProc init", "Executor init", "Load model",
    # ...) use the global provider: exported in process, with this role
    global_where_none(tracer_provider)
    return tracer_provider, meter_provider, life
