"""``vllm.general_plugins`` entry point: llm-otel inside every vLLM process.

vLLM calls :func:`register` once in each of its processes - the frontend (``LLM``, OpenAI
server), the engine core and each worker - before it builds the objects we hook, so class-level
patches made here take effect everywhere, with ``spawn`` too (each child is a fresh interpreter).

It does nothing unless llm-otel is enabled: ``LLM_OTEL_ENABLED=1``, which ``llm_otel.instrument()``
sets in its process so that the engine processes vLLM spawns from it follow, and which a user sets
for zero-code serving (``LLM_OTEL_ENABLED=1 python -m vllm.entrypoints.openai.api_server ...``).

In the engine-core and worker processes the providers come from the ``OTEL_*`` environment (batch
OTLP export, flushed at exit; resource attribute ``llm.process.role``); without an OTLP endpoint
their spans are dropped - the frontend's console shows the request trees. With
``OTEL_METRICS_EXPORTER=prometheus`` the engine core serves its metrics on its own port
(:mod:`llm_otel.export.prometheus`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys

logger = logging.getLogger("llm_otel")
ENABLE_ENV = "LLM_OTEL_ENABLED"


def process_role() -> str:
    """``engine_core``, ``worker`` or ``frontend``, from the multiprocessing process name vLLM sets
    (``EngineCore``/``EngineCore_DP<i>``, ``VllmWorker-<rank>``)."""
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine_core"
    if "Worker" in name:
        return "worker"
    from llm_otel.export.identity import vllm_stack_role  # a Ray actor: vLLM's object loading us says

    return vllm_stack_role() or "frontend"


def unnamed_spawned_child() -> bool:
    """True in a multiprocessing child started with ``spawn`` before multiprocessing has named it
    (e.g. while ``sitecustomize`` runs): its vLLM role is not known yet."""
    return "--multiprocessing-fork" in sys.argv and multiprocessing.current_process().name == "MainProcess"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Instrument this vLLM process if llm-otel is enabled; never raises into vLLM."""
    if not enabled():
        return
    try:
        if process_role() == "frontend":
            import llm_otel

            llm_otel.instrument(engines=["vllm"])  # no-op if the application already did
            return
        from llm_otel.instrumentation.vllm import VLLMInstrumentor

        inst = VLLMInstrumentor()
        if not inst.is_instrumented_by_opentelemetry:
            inst.instrument()
        elif inst.adapter is None and inst._pending is not None:  # deferred by opentelemetry-instrument
            inst._activate(**inst._pending)
    except Exception as exc:  # noqa: BLE001
        logger.warning("llm-otel: could not instrument this vLLM process (%s); it runs uninstrumented", exc)


def engine_process_providers(role: str):
    """Tracer and meter providers for an engine-core or worker process, from the ``OTEL_*``
    environment, with resource attribute ``llm.process.role``; flushed at exit (with the worker's
    pending logit statistics and step device timings)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from llm_otel.export.providers import (
        SystemRandomIdGenerator,
        metric_exporter_from_env,
        prometheus_reader_from_env,
        span_exporter_from_env,
    )
    from llm_otel.export.identity import vllm_process_identity

    resource = Resource.create(vllm_process_identity(role))  # role, pid, host, ranks, instance id
    tracer_provider = TracerProvider(resource=resource, id_generator=SystemRandomIdGenerator(), shutdown_on_exit=False)
    exporter = span_exporter_from_env()
    if exporter is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    metric_exporter = metric_exporter_from_env()
    readers = [PeriodicExportingMetricReader(metric_exporter)] if metric_exporter is not None else []
    if metric_exporter is None:
        try:
            prometheus = prometheus_reader_from_env(role=role)  # engine core: port + 1 + DP rank
        except Exception as exc:  # noqa: BLE001 - a bad port must not stop the engine process
            logger.warning("llm-otel: no Prometheus endpoint in this %s process (%s)", role, exc)
            prometheus = None
        if prometheus is not None:
            readers.append(prometheus)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)

    def _flush() -> None:
        from llm_otel.instrumentation.vllm import VLLMInstrumentor

        adapter = VLLMInstrumentor().adapter
        try:
            if adapter is not None:
                adapter.worker.flush(0.0)
                steps = adapter.telemetry.steps_if_started
                if steps is not None:  # device records still in flight complete their step spans
                    steps.close()
        finally:
            tracer_provider.shutdown()
            meter_provider.shutdown()

    atexit.register(_flush)
    logger.debug("llm-otel: instrumenting vLLM %s process (pid %d)", role, os.getpid())
    return tracer_provider, meter_provider
