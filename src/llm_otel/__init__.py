"""llm-otel: OpenTelemetry traces and metrics for LLM serving engines.

``instrument()`` / ``uninstrument()`` are the whole public face; see the README.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from llm_otel.version import __version__

__all__ = ["instrument", "uninstrument", "__version__"]

logger = logging.getLogger("llm_otel")

# engine name -> (module that must be importable, instrumentor import path)
_ENGINES = {
    "vllm": ("vllm", "llm_otel.instrumentation.vllm:VLLMInstrumentor"),
    "lightllm": ("lightllm", "llm_otel.instrumentation.lightllm:LightLLMInstrumentor"),
    "sglang": ("sglang", "llm_otel.instrumentation.sglang:SGLangInstrumentor"),
    "triton": ("tritonclient", "llm_otel.instrumentation.triton:TritonClientInstrumentor"),
}


def _instrumentor(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)()


def instrument(
    tracer_provider: Any = None,
    meter_provider: Any = None,
    *,
    engines: list[str] | None = None,
    prometheus_port: int | None = None,
) -> list[str]:
    """Instrument every supported serving engine that is installed; returns the engines instrumented.

    Args:
        tracer_provider / meter_provider: OpenTelemetry SDK providers to use. When both are None,
            the global providers are used, and created from the ``OTEL_*`` environment if the
            application has none (``OTEL_EXPORTER_OTLP_ENDPOINT`` set: OTLP export; otherwise
            readable console output).
        engines: restrict to these engine names (``["vllm"]``, or one name ``"vllm"``); default all
            installed ones.
        prometheus_port: an int in [1, 65534]: serve metrics for Prometheus instead of pushing them: sets
            ``OTEL_METRICS_EXPORTER=prometheus`` and ``OTEL_EXPORTER_PROMETHEUS_PORT`` in
            ``os.environ`` (so vLLM's engine-core process, which serves on port + 1, follows), only
            after the whole configuration validated: on ConfigError the environment is untouched.
            Applies when llm-otel creates the providers (both provider arguments None).

    ``LLM_OTEL_ENABLED=false`` (``0``/``no``/``off``) in the environment: nothing is instrumented
    (returns ``[]``), as in every other process of the engine.

    Idempotent: a second call while instrumented is a no-op for engines already instrumented (and
    builds no providers when every engine it names is: the application's own stay the only ones).

    Raises:
        llm_otel.config.ConfigError: an ``OTEL_*``/``LLM_OTEL_*`` variable (or ``prometheus_port``)
            holds an invalid value; the exporter variables (``OTEL_{TRACES,METRICS}_EXPORTER``,
            ``OTEL_EXPORTER_OTLP*_PROTOCOL``) are checked when llm-otel creates the providers.
        ValueError: ``engines`` names an engine llm-otel does not know.
    """
    from llm_otel.config import ConfigError, Settings, validate_exporter_env
    from llm_otel.process.providers import ensure_providers

    if isinstance(engines, str):
        engines = [engines]
    unknown = set(engines or ()) - set(_ENGINES)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; known: {sorted(_ENGINES)}")
    from llm_otel.instrumentation._hooks import switched_off

    if switched_off():  # off in every process, this one included (the engine processes follow the variable)
        logger.info("llm-otel: LLM_OTEL_ENABLED=%s; instrument() instruments nothing", os.environ["LLM_OTEL_ENABLED"])
        return []
    if prometheus_port is None:
        settings = Settings.from_env()
    else:  # validate everything against the environment it would make, then change os.environ
        if isinstance(prometheus_port, bool) or not isinstance(prometheus_port, int) or not 0 < prometheus_port < 65535:
            raise ConfigError(
                f"prometheus_port={prometheus_port!r}: expected an int port number in [1, 65534] "
                "(the engine-core process serves on port + 1)"
            )
        changes = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": str(prometheus_port)}
        env = {**os.environ, **changes}
        settings = Settings.from_env(env)
        validate_exporter_env(env)
        os.environ.update(changes)
    chosen = []
    for name, (module, path) in _ENGINES.items():
        if engines is not None and name not in engines:
            continue
        if importlib.util.find_spec(module) is None:
            continue
        chosen.append((name, _instrumentor(path)))
    # the adaptive sampler's parts of the providers built here, handed to each engine's Telemetry
    # explicitly (None with the application's providers: Telemetry then uses the sampler of the
    # provider passed, when it is llm-otel's). Not when every engine asked for is instrumented
    # already: a second call (vLLM's plugin in a frontend the application instrumented with its own
    # providers) must not install global ones and an exporter process beside the application's
    sampling = None
    if (
        tracer_provider is None
        and meter_provider is None
        and not _in_vllm_engine_process()
        and (not chosen or any(not inst.is_instrumented_by_opentelemetry for _, inst in chosen))
    ):
        sampling = ensure_providers(settings)
    done = []
    for name, inst in chosen:
        if not inst.is_instrumented_by_opentelemetry:
            inst.instrument(
                tracer_provider=tracer_provider, meter_provider=meter_provider, settings=settings, sampling=sampling
            )
        elif tracer_provider is not None or meter_provider is not None:
            logger.warning(
                "llm-otel: %s is already instrumented; the providers passed now are ignored "
                "(call uninstrument() first to change them)",
                name,
            )
        if inst.is_instrumented_by_opentelemetry:
            done.append(name)
    return done


def _in_vllm_engine_process() -> bool:
    """True inside a vLLM engine-core/worker process (an application script that calls
    instrument() at module level runs again there under spawn): providers come from the engine
    process setup, not the frontend's console defaults."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from llm_otel.instrumentation.vllm import plugin

    return plugin.unnamed_spawned_child() or plugin.process_role() != "frontend"


def uninstrument() -> None:
    """Remove every hook llm-otel installed, restoring each patched attribute exactly."""
    for module, path in _ENGINES.values():
        if importlib.util.find_spec(module) is None:
            continue
        inst = _instrumentor(path)
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()
