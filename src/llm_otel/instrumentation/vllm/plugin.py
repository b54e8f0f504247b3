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

import logging
import multiprocessing
import multiprocessing.util
import os
import sys

from llm_otel.config import ConfigError
from llm_otel.errors import process_errors

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


def keep_warnings() -> None:
    """Give the ``llm_otel`` logger level WARNING when nobody set one. vLLM 0.32's OpenAI server
    builds its app through ``sagemaker_standards_bootstrap``, whose import of
    ``model_hosting_container_standards`` sets the *root* logger to ``LOG_LEVEL`` (default ERROR),
    after this plugin ran; a logger without a level of its own inherits that, and llm-otel's
    one-line warnings (an export outage, a dead exporter process, bad input) would be discarded in
    every API server. A level the application set on ``llm_otel`` is kept. (Root handlers that
    package raised to ERROR still filter; without root handlers the warnings reach stderr.)"""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def register() -> None:
    """Instrument this vLLM process if llm-otel is enabled; never raises into vLLM."""
    if not enabled():
        return
    keep_warnings()
    try:
        from llm_otel.instrumentation.vllm import VLLMInstrumentor

        frontend = process_role() == "frontend"
        if frontend:
            from llm_otel.export.ports import defer_frontend_endpoints

            defer_frontend_endpoints()  # vLLM's launcher may only start API servers: bind when serving
        inst = VLLMInstrumentor()
        if inst.is_instrumented_by_opentelemetry and inst.adapter is None and inst._pending is not None:
            # opentelemetry-instrument deferred this spawned child's instrumentor before it was named
            # (engine core, worker, or an API server of vllm serve --api-server-count N, which
            # instrument() would skip as already instrumented: no request spans at all)
            inst._activate(**inst._pending)
            if frontend:  # its providers were built before multiprocessing named it
                from llm_otel.export.identity import relabel, vllm_api_server_index

                name = multiprocessing.current_process().name
                relabel("frontend", process_name=name, api_server_index=vllm_api_server_index(name))
        elif frontend:
            import llm_otel

            llm_otel.instrument(engines=["vllm"])  # no-op if the application already did
            inst.apply_missing_hooks()  # vLLM imported by two threads at once as `import vllm` activated us
        elif not inst.is_instrumented_by_opentelemetry:
            inst.instrument()
    except ConfigError as exc:  # one ERROR line per process tree (the frontend usually said it first)
        from llm_otel.instrumentation._hooks import configuration_refused

        configuration_refused("vLLM", exc)
    except Exception as exc:  # noqa: BLE001
        process_errors().report("instrumentation.vllm.plugin", exc,
                                "could not instrument this vLLM process; it runs uninstrumented")


def engine_process_providers(role: str):
    """Tracer and meter providers for an engine-core or worker process, from the ``OTEL_*``
    environment, with resource attribute ``llm.process.role``; the tracer provider becomes the
    global one when the process has none (vLLM's own start-up spans use it). They are flushed by
    this process's lifecycle (:mod:`llm_otel.export.lifecycle`) on every orderly exit - the end of
    the multiprocessing child, under ``spawn`` or ``fork`` - within ``LLM_OTEL_FLUSH_DEADLINE_S``,
    after the worker's pending logit statistics and step device timings are completed."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from llm_otel.export.lifecycle import lifecycle
    from llm_otel.export.providers import (
        SystemRandomIdGenerator,
        metric_exporter_from_env,
        prometheus_reader_from_env,
        span_exporter_from_env,
    )
    from llm_otel.export.identity import vllm_process_identity

    made = _engine_providers.get((os.getpid(), role))
    if made is not None:  # built at this spawned child's bootstrap (providers_at_bootstrap)
        return made
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
            process_errors().report("instrumentation.vllm.plugin.prometheus", exc,
                                    f"no Prometheus endpoint in this {role} process")
            prometheus = None
        if prometheus is not None:
            readers.append(prometheus)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    if exporter is not None:
        exporter.bind(meter_provider)  # its lost spans count in llm_otel.spans.dropped
    life = lifecycle(role)
    life.add(tracer_provider, meter_provider, exporters=(exporter, metric_exporter))
    from llm_otel._setup import global_where_none

    # vLLM's own start-up spans (vllm/tracing: "EngineCoreProc init", "Executor init", "Load model",
    # ...) use the global provider: exported in process, with this role. In a spawned child this
    # runs at its bootstrap (providers_at_bootstrap), before the outermost of them start
    global_where_none(tracer_provider)
    life.before_flush(_complete_pending, early=True)  # the model steps are over once shutdown began
    logger.debug("llm-otel: instrumenting vLLM %s process (pid %d)", role, os.getpid())
    _engine_providers[(os.getpid(), role)] = (tracer_provider, meter_provider)
    return tracer_provider, meter_provider


_engine_providers: dict[tuple[int, str], tuple] = {}  # (pid, role) -> this process's engine providers


def providers_at_bootstrap() -> None:
    """In a child multiprocessing spawned (``opentelemetry-instrument`` runs before it is named):
    build the engine-core or worker providers when multiprocessing runs the child
    (:func:`~llm_otel.instrumentation._hooks.at_spawned_bootstrap`), so that vLLM's outermost
    start-up spans ("EngineCoreProc init", "Worker init"), which start before vLLM loads its
    plugins, are recorded and exported in process with the engine's role. The plugin's activation
    later uses the same providers. Only with llm-otel enabled and for vLLM's engine processes'
    names; once however often this is called; never raises. An invalid exporter setting is left
    to the plugin's activation to report (one line per process tree)."""
    from llm_otel.instrumentation._hooks import at_spawned_bootstrap

    at_spawned_bootstrap(_providers_for)


def remove_bootstrap_patch() -> None:
    """Undo :func:`providers_at_bootstrap` if the child has not bootstrapped yet (``uninstrument()``)."""
    from llm_otel.instrumentation._hooks import cancel_at_spawned_bootstrap

    cancel_at_spawned_bootstrap(_providers_for)


def _providers_for(process) -> None:
    from llm_otel.export.identity import _ENGINE_CORE_RE, _WORKER_RE

    name = process.name
    role = "engine_core" if _ENGINE_CORE_RE.match(name) else "worker" if _WORKER_RE.match(name) else None
    if role is not None and enabled():
        try:
            engine_process_providers(role)
        except ConfigError:
            pass  # the plugin's activation meets it again and says so, once per process tree


def _complete_pending() -> None:
    """Before the final flush of an engine process: the worker's buffered logit statistics become
    spans, device records still in flight complete their step spans."""
    from llm_otel.instrumentation.vllm import VLLMInstrumentor

    adapter = VLLMInstrumentor().adapter
    if adapter is None:
        return
    adapter.worker.flush(0.0)
    steps = adapter.telemetry.steps_if_started
    if steps is not None:
        steps.close()


# --- fork ---------------------------------------------------------------------------------------
class _ForkHook:
    """Anchor for multiprocessing's after-fork registry (it holds objects weakly)."""


_FORK_HOOK = _ForkHook()


def _after_multiprocessing_fork(_anchor: object) -> None:
    """In a process vLLM started with ``fork`` (engine core, worker): the frontend's (or engine
    core's) instrumentation came along - its hooks, its providers, its exporters' channels - and
    vLLM's plugin loader will not run again here (its once-per-process flag came along too). Give
    this process the setup of its own role. Runs in multiprocessing's bootstrap, after the child
    is named and before vLLM's code runs; never raises."""
    try:
        if not enabled():
            return
        role = process_role()
        from llm_otel.instrumentation.vllm import VLLMInstrumentor

        inst = VLLMInstrumentor()
        if not inst.is_instrumented_by_opentelemetry or getattr(inst, "role", None) == role:
            return
        from llm_otel.export import exporters, lifecycle

        exporters.disown_inherited()  # the parent exports its own spans and points
        lifecycle.lifecycle(role).forget()
        inst.abandon_inherited()
        inst.instrument()
        logger.debug("llm-otel: forked vLLM %s process (pid %d) set up for its role", role, os.getpid())
    except Exception as exc:  # noqa: BLE001
        process_errors().report("instrumentation.vllm.plugin.fork", exc,
                                "could not set up this forked vLLM process; it runs uninstrumented")


multiprocessing.util.register_after_fork(_FORK_HOOK, _after_multiprocessing_fork)
