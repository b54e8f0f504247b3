"""What the vLLM instrumentor and its plugin both need to know about vLLM's engine processes:
whether llm-otel is enabled in this process tree (``LLM_OTEL_ENABLED``), which vLLM process this
is, and the engine-core / worker providers (built by the process runtime's one recipe,
:func:`llm_otel.process.providers.engine_process_providers`), also at a spawned child's bootstrap.

Below both :mod:`llm_otel.instrumentation.vllm` (the instrumentor) and
:mod:`llm_otel.instrumentation.vllm.plugin` (the ``vllm.general_plugins`` entry point, which
builds the instrumentor), so neither imports the other back.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable

from llm_otel.config import ConfigError
from llm_otel.instrumentation.vllm.process import engine_process_role, vllm_stack_role
from llm_otel.process.bootstrap import at_spawned_bootstrap, cancel_at_spawned_bootstrap

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
    return vllm_stack_role() or "frontend"  # a Ray actor: vLLM's object loading us says


def unnamed_spawned_child() -> bool:
    """True in a multiprocessing child started with ``spawn`` before multiprocessing has named it
    (e.g. while ``sitecustomize`` runs): its vLLM role is not known yet."""
    return "--multiprocessing-fork" in sys.argv and multiprocessing.current_process().name == "MainProcess"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def engine_process_providers(role: str):
    """Tracer and meter providers for an engine-core or worker process
    (:func:`llm_otel.process.providers.engine_process_providers`: from the ``OTEL_*`` environment,
    resource attribute ``llm.process.role``, the global tracer provider when the process has none -
    vLLM's own start-up spans use it - flushed by this process's lifecycle on every orderly exit,
    the end of the multiprocessing child under ``spawn`` or ``fork``, within
    ``LLM_OTEL_FLUSH_DEADLINE_S``), after the worker's pending logit statistics and step device
    timings are completed. Built once per process and role."""
    from llm_otel.process.providers import engine_process_providers as build

    made = _engine_providers.get((os.getpid(), role))
    if made is not None:  # built at this spawned child's bootstrap (providers_at_bootstrap)
        return made
    # in a spawned child this runs at its bootstrap (providers_at_bootstrap), before the outermost
    # of vLLM's start-up spans start
    tracer_provider, meter_provider, life = build(role)
    life.before_flush(complete_pending, early=True)  # the model steps are over once shutdown began
    logger.debug("llm-otel: instrumenting vLLM %s process (pid %d)", role, os.getpid())
    _engine_providers[(os.getpid(), role)] = (tracer_provider, meter_provider)
    return tracer_provider, meter_provider


_engine_providers: dict[tuple[int, str], tuple] = {}  # (pid, role) -> this process's engine providers


def providers_at_bootstrap() -> None:
    """In a child multiprocessing spawned (``opentelemetry-instrument`` runs before it is named):
    build the engine-core or worker providers when multiprocessing runs the child
    (:func:`~llm_otel.process.bootstrap.at_spawned_bootstrap`), so that vLLM's outermost
    start-up spans ("EngineCoreProc init", "Worker init"), which start before vLLM loads its
    plugins, are recorded and exported in process with the engine's role. The plugin's activation
    later uses the same providers. Only with llm-otel enabled and for vLLM's engine processes'
    names; once however often this is called; never raises. An invalid exporter setting is left
    to the plugin's activation to report (one line per process tree)."""
    at_spawned_bootstrap(_providers_for)


def remove_bootstrap_patch() -> None:
    """Undo :func:`providers_at_bootstrap` if the child has not bootstrapped yet (``uninstrument()``)."""
    cancel_at_spawned_bootstrap(_providers_for)


def _providers_for(process) -> None:
    role = engine_process_role(process.name)
    if role is not None and enabled():
        try:
            engine_process_providers(role)
        except ConfigError:
            pass  # the plugin's activation meets it again and says so, once per process tree


def complete_pending() -> None:
    """Before the final flush of an engine process: what the instrumentor registered
    (:data:`BEFORE_FINAL_FLUSH`: the worker's buffered logit statistics become spans, device
    records still in flight complete their step spans)."""
    for complete in list(BEFORE_FINAL_FLUSH):
        complete()


# filled by the instrumentor (llm_otel.instrumentation.vllm) when it is imported: this module is
# below it and cannot import it
BEFORE_FINAL_FLUSH: list[Callable[[], None]] = []
