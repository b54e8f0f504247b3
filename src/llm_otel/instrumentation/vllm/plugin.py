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
(:mod:`llm_otel.process.ports`). The providers come from the process runtime's one recipe
(:func:`llm_otel.process.providers.engine_process_providers`); this module tells it what vLLM
knows: which process this is (:mod:`llm_otel.instrumentation.vllm.process`), when a spawned or
forked child starts (:mod:`llm_otel.process.bootstrap`), what to complete before the final flush.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from llm_otel.config import ConfigError
from llm_otel.errors import process_errors
from llm_otel.instrumentation.vllm.engine_processes import enabled, process_role, unnamed_spawned_child
from llm_otel.instrumentation.vllm.process import vllm_api_server_index
from llm_otel.process.bootstrap import at_forked_bootstrap

logger = logging.getLogger("llm_otel")


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
            from llm_otel.process.ports import defer_frontend_endpoints

            defer_frontend_endpoints()  # vLLM's launcher may only start API servers: bind when serving
        inst = VLLMInstrumentor()
        if inst.is_instrumented_by_opentelemetry and inst.adapter is None and inst._pending is not None:
            # opentelemetry-instrument deferred this spawned child's instrumentor before it was named
            # (engine core, worker, or an API server of vllm serve --api-server-count N, which
            # instrument() would skip as already instrumented: no request spans at all)
            inst._activate(**inst._pending)
            if frontend:  # its providers were built before multiprocessing named it
                from llm_otel.process.identity import relabel

                name = multiprocessing.current_process().name
                relabel("frontend", process_name=name, api_server_index=vllm_api_server_index(name))
        elif frontend:
            _instrument_frontend(inst)  # no-op if the application already did
            inst.apply_missing_hooks()  # vLLM imported by two threads at once as `import vllm` activated us
        elif not inst.is_instrumented_by_opentelemetry:
            inst.instrument()
        if frontend and inst.adapter is not None:
            # API server i serves /healthz on base - i (llm_otel.process.ports), read when it starts
            inst.adapter.telemetry.signals.health_port_for = _health_port
    except ConfigError as exc:  # one ERROR line per process tree (the frontend usually said it first)
        from llm_otel.instrumentation._hooks import configuration_refused

        configuration_refused("vLLM", exc)
    except Exception as exc:  # noqa: BLE001
        process_errors().report(
            "instrumentation.vllm.plugin", exc, "could not instrument this vLLM process; it runs uninstrumented"
        )


def _health_port(base: int) -> int:
    """The ``/healthz`` port of this vLLM frontend: ``base - i`` for API server *i*."""
    from llm_otel.process.ports import frontend_port

    return frontend_port(base, vllm_api_server_index() or 0)


def _instrument_frontend(inst) -> None:
    """What ``llm_otel.instrument(engines=["vllm"])`` does in a vLLM frontend (the plugin does not
    import the public face): settings validated from the environment (ConfigError raised), global
    providers from the environment where the process has none, then the instrumentor - unless it
    is instrumented already (the application called ``instrument()``: its providers stay the only
    ones)."""
    from llm_otel.config import Settings
    from llm_otel.process.providers import ensure_providers

    settings = Settings.from_env()
    if inst.is_instrumented_by_opentelemetry:
        return
    sampling = None if unnamed_spawned_child() else ensure_providers(settings)
    inst.instrument(tracer_provider=None, meter_provider=None, settings=settings, sampling=sampling)


# --- fork ---------------------------------------------------------------------------------------
def _after_multiprocessing_fork() -> None:
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
        from llm_otel.export import exporters
        from llm_otel.process import lifecycle

        exporters.disown_inherited()  # the parent exports its own spans and points
        lifecycle.lifecycle(role).forget()
        inst.abandon_inherited()
        inst.instrument()
        logger.debug("llm-otel: forked vLLM %s process (pid %d) set up for its role", role, os.getpid())
    except Exception as exc:  # noqa: BLE001
        process_errors().report(
            "instrumentation.vllm.plugin.fork", exc, "could not set up this forked vLLM process; it runs uninstrumented"
        )


at_forked_bootstrap(_after_multiprocessing_fork)
