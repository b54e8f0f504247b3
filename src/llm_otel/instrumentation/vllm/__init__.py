"""OpenTelemetry instrumentation for vLLM's V1 engine (offline ``LLM`` and ``LLMEngine``).

Usage
-----
.. code-block:: python

    import llm_otel
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":                 # vLLM spawns its engine processes
        llm_otel.instrument()                  # before building the engine (after it, the engine
                                               # core's queue events and engine-process spans are missing)
        llm = LLM(model="/path/to/model")
        llm.generate(["Hello"], SamplingParams(max_tokens=16))

or with explicit providers::

    from llm_otel.instrumentation.vllm import VLLMInstrumentor
    VLLMInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

or without code changes: ``opentelemetry-instrument python app.py`` (entry point ``vllm``).

Each request (each choice when ``n>1``) becomes ``{text_completion|chat} {model}`` (kind INTERNAL)
with children ``llm.prompt``, ``llm.token_stream`` and, for sampled requests with log-probs,
``llm.logit_dist``;
GenAI server metrics are recorded for every request. See docs/semconv.md.

Configuration
-------------
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (false), ``LLM_OTEL_TOKEN_EVENTS`` (4),
``LLM_OTEL_MAX_STALL_EVENTS`` (16), ``LLM_OTEL_STALL_FACTOR`` (4.0), ``LLM_OTEL_LOGPROBS_TOP_K`` (5),
``LLM_OTEL_LOGIT_DIST_RATIO`` (0.05), ``LLM_OTEL_LOGIT_EVENTS`` (8), ``LLM_OTEL_VLLM_ENGINE_EVENTS`` (true) - see :class:`llm_otel.config.Settings`.
``OTEL_METRICS_EXPORTER=prometheus`` with ``OTEL_EXPORTER_PROMETHEUS_PORT`` (9464): the frontend
serves per-request metrics on that port, the engine core engine-state and GPU metrics on port + 1
(docs/operations.md).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection
from typing import Any

import wrapt
from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of type checking (a '# type: ignore' header)

from llm_otel.config import ConfigError, Settings
from llm_otel.errors import guard, process_errors
from llm_otel.instrumentation._hooks import (
    AppliedHook,
    _resolve,
    apply_hooks,
    configuration_refused,
    flush_after_later_exit_handlers,
    library_missing,
    remove_hooks,
    switched_off,
)
from llm_otel.instrumentation.vllm.adapter import VLLMAdapter
from llm_otel.instrumentation.vllm.engine_processes import BEFORE_FINAL_FLUSH
from llm_otel.instrumentation.vllm.hooks import HOOKS
from llm_otel.instrumentation.vllm.package import _instruments, _instruments_any
from llm_otel.instrumentation.vllm.ray_handoff import hand_off_environment, restore_environment
from llm_otel.telemetry import Telemetry

__all__ = ["VLLMInstrumentor", "HOOKS"]
logger = logging.getLogger("llm_otel")


class VLLMInstrumentor(BaseInstrumentor):
    """Instruments vLLM. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    Without providers it uses the global ones, creating them from the ``OTEL_*`` environment when
    the application has set none (so ``opentelemetry-instrument`` works without a distro).
    Hook targets missing from the installed vLLM are skipped with one warning each. In a process
    that has not imported vLLM yet, the hooks, providers and signals come at its ``import vllm``
    (``adapter`` is None until then): a process that never imports it pays nothing.
    """

    adapter: VLLMAdapter | None = None
    role: str | None = None
    _applied: list[AppliedHook] = []
    _pending: dict | None = None  # a spawned child's arguments until the plugin knows its role
    _awaiting: dict | None = None  # the arguments until this process imports vllm
    _set_enable_env = False  # LLM_OTEL_ENABLED was set by this instrumentor

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self):
        return get_dependency_conflicts(_instruments, _instruments_any)

    def _instrument(self, **kwargs: Any) -> None:
        from llm_otel.instrumentation.vllm import engine_processes

        if switched_off() or library_missing("vllm", "vLLM"):
            return  # LLM_OTEL_ENABLED=false: off here as in the engine processes (their plugin is off)
        if (
            kwargs.get("tracer_provider") is None
            and kwargs.get("meter_provider") is None
            and engine_processes.unnamed_spawned_child()
        ):
            # `opentelemetry-instrument` runs in vLLM's spawned engine processes before they know
            # which one they are; the vllm.general_plugins entry point activates this later, the
            # engine processes' providers come when multiprocessing bootstraps the child
            self._pending = kwargs
            engine_processes.providers_at_bootstrap()
            return
        if "vllm" not in sys.modules:
            # a process that has not imported vLLM may never do (under opentelemetry-instrument:
            # multiprocessing's resource tracker, a script the server starts, any helper): the hooks,
            # providers and signals come when it imports vllm - the hooks' own imports of vLLM's
            # modules (torch with them) cost such a process about 300 MB and seconds of CPU
            try:
                self._awaiting = {**kwargs, "settings": kwargs.get("settings") or Settings.from_env()}
            except ConfigError as exc:  # said now, at start-up, not at the import
                configuration_refused("vLLM", exc)
                return
            self._enable_children()
            if kwargs.get("tracer_provider") is None and kwargs.get("meter_provider") is None:
                flush_after_later_exit_handlers()
            wrapt.register_post_import_hook(self._on_vllm_import, "vllm")
            return
        try:
            self._activate(**kwargs)
        except ConfigError as exc:
            configuration_refused("vLLM", exc)

    def _enable_children(self) -> None:
        """Set ``LLM_OTEL_ENABLED=1`` here when nobody did: the vLLM processes started from this one
        (engine core and workers, API servers of ``vllm serve``, a vLLM child of an application
        that does not import vLLM itself) inherit it and instrument themselves through the
        ``vllm.general_plugins`` entry point. ``uninstrument()`` removes it again."""
        from llm_otel.instrumentation.vllm import engine_processes

        if engine_processes.ENABLE_ENV not in os.environ:
            os.environ[engine_processes.ENABLE_ENV] = "1"
            self._set_enable_env = True

    def _on_vllm_import(self, _module) -> None:
        """Post-import hook on ``vllm``: activate what ``instrument()`` deferred; never raises."""
        kwargs, self._awaiting = self._awaiting, None
        if kwargs is None:  # uninstrumented (or abandoned after a fork) since, or already done
            return
        try:
            self._activate(**kwargs)
        except ConfigError as exc:
            if self._set_enable_env:  # nothing runs here: the vLLM processes started from here stay silent
                from llm_otel.instrumentation.vllm import engine_processes

                os.environ.pop(engine_processes.ENABLE_ENV, None)
                self._set_enable_env = False
            configuration_refused("vLLM", exc)
        except Exception as exc:  # noqa: BLE001 - inside the application's `import vllm`
            process_errors().report(
                "instrumentation.vllm.import_hook",
                exc,
                "could not instrument vLLM in this process; it runs uninstrumented",
            )

    def _activate(self, **kwargs: Any) -> None:
        from llm_otel.export.offload import request_outlets
        from llm_otel.instrumentation.vllm import engine_processes
        from llm_otel.process.providers import ensure_providers

        self._pending = None
        settings = kwargs.get("settings") or Settings.from_env()
        tracer_provider = kwargs.get("tracer_provider")
        meter_provider = kwargs.get("meter_provider")
        sampling = kwargs.get("sampling")  # the adaptive sampler's parts, from instrument()
        role = self.role = engine_processes.process_role()
        if tracer_provider is None and meter_provider is None:
            if role == "frontend":
                sampling = ensure_providers(settings) or sampling
            else:
                tracer_provider, meter_provider = engine_processes.engine_process_providers(role)
                sampling = None  # engine processes sample as their parent decided (SDK default)
        telemetry = Telemetry(
            tracer_provider,
            meter_provider,
            settings,
            scope=__name__,
            sampling=sampling,
            outlets=request_outlets(tracer_provider, meter_provider),
        )
        if role == "frontend":  # where requests start: the head-sampling probability applies here
            from opentelemetry import trace

            from llm_otel.process.ports import when_serving

            def observe_sampling() -> bool:  # once this process serves (vllm serve's launcher never does)
                with guard("sampling.probability", telemetry.errors):
                    telemetry.instruments.observe_sampling(tracer_provider or trace.get_tracer_provider())
                return True

            when_serving(observe_sampling)
        self.adapter = VLLMAdapter(telemetry)
        if role == "frontend":
            from llm_otel.export.offload import prewarm

            # where requests arrive: the exporter process starts when this process starts building
            # an engine client, overlapping vLLM's start-up (a process that only has vLLM installed,
            # such as multiprocessing's resource tracker under opentelemetry-instrument, never does)
            provider = tracer_provider or trace.get_tracer_provider()
            self.adapter.before_first_engine = lambda: prewarm(provider)
        if role == "frontend":
            from llm_otel.process.lifecycle import create_flush_dir, lifecycle

            lifecycle(role).before_flush(self._fail_in_flight_at_exit)  # never finished by vLLM
            create_flush_dir()  # the engine processes started from here say when they flushed
        if role == "engine_core":  # engine-state and GPU instruments now, not on the first step
            with guard("core.engine_metrics", telemetry.errors):
                self.adapter.core.engine_metrics()
        self._applied = apply_hooks(HOOKS, self.adapter, "vLLM")
        self._enable_children()
        # engine cores and workers started as Ray actors get the configuration through vLLM's copy
        self._ray_env_previous = hand_off_environment()

    def apply_missing_hooks(self) -> int:
        """Apply the hooks that did not resolve when this process was instrumented but resolve now;
        returns how many. When ``import vllm`` activated the instrumentation while another thread
        was still importing vLLM's modules, Python hands the hooks' nested imports a partially
        initialised module and those targets are reported missing: vLLM's plugin loader calls this
        (:func:`.plugin.register`) before vLLM builds the objects we hook. Targets still missing
        stay skipped (their warning was given); never raises."""
        if self.adapter is None:
            return 0
        with guard("instrumentation.vllm.late_hooks", self.adapter.telemetry.errors):
            done = {a.hook for a in self._applied}
            ready = []
            for hook in HOOKS:
                if hook in done:
                    continue
                try:
                    _resolve(hook)
                except (ImportError, AttributeError):
                    continue  # another layout's target, or one the engine moved
                ready.append(hook)
            late = apply_hooks(ready, self.adapter, "vLLM") if ready else []
            self._applied.extend(late)
            if late:
                logger.info(
                    "llm-otel: %d vLLM hook(s) applied late (vLLM was still being imported by another "
                    "thread when the instrumentation started); every target is wrapped now",
                    len(late),
                )
            return len(late)
        return 0

    def _fail_in_flight_at_exit(self) -> None:
        if self.adapter is not None:
            self.adapter.fail_in_flight_at_exit()

    def abandon_inherited(self) -> None:
        """In a process forked from an instrumented one (vLLM's engine processes under ``fork``):
        restore the patched attributes and let go of the parent's adapter without touching what
        only the parent can stop (its threads do not exist here; its /healthz and Prometheus
        sockets are closed in this process only). The instrumentor is then uninstrumented here."""
        remove_hooks(self._applied)
        self._applied = []
        if self.adapter is not None:
            self.adapter.telemetry.abandon_inherited()
        self.adapter = None
        self._pending = self._awaiting = None
        self._is_instrumented_by_opentelemetry = False

    def _uninstrument(self, **kwargs: Any) -> None:
        from llm_otel.instrumentation.vllm import engine_processes

        remove_hooks(self._applied)
        self._applied = []
        engine_processes.remove_bootstrap_patch()  # a spawned child not yet bootstrapped builds no providers
        if self.adapter is not None:
            self.adapter.retired = True  # the HTTP edge stays on an app built before; it records nothing
            self.adapter.telemetry.signals.stop()  # its thread and /healthz end with the hooks
        self.adapter = None
        self._pending = self._awaiting = None
        restore_environment(getattr(self, "_ray_env_previous", None))
        self._ray_env_previous = None
        if self._set_enable_env:
            os.environ.pop(engine_processes.ENABLE_ENV, None)
            self._set_enable_env = False


def _complete_pending() -> None:
    """Before the final flush of an engine process: the worker's buffered logit statistics become
    spans, device records still in flight complete their step spans."""
    adapter = VLLMInstrumentor().adapter
    if adapter is None:
        return
    adapter.worker.flush(0.0)
    steps = adapter.telemetry.steps_if_started
    if steps is not None:
        steps.close()


BEFORE_FINAL_FLUSH.append(_complete_pending)
