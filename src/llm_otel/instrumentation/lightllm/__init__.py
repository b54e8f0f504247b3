"""OpenTelemetry instrumentation for LightLLM (ModelTC/lightllm) across all of its processes.

Usage
-----
Zero-code, which reaches every LightLLM process (the spawned router, model-infer workers and
detokenization, and the gunicorn HTTP workers): ``opentelemetry-instrument`` puts its
``sitecustomize`` on ``PYTHONPATH``, every child inherits it and instruments itself::

    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 OTEL_SERVICE_NAME=lightllm \\
        opentelemetry-instrument python -m lightllm.server.api_server --model_dir /models/llama ...

In code (this process only; LightLLM's children are fresh interpreters, so serving needs the
command above)::

    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor
    LightLLMInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)

Nothing of LightLLM is imported here: the hooks are post-import hooks, applied in whichever process
imports the module they target (see hooks.py for the table and the layouts it knows). A module
whose shape matches no known layout gets one warning naming the targets it lacks; the rest keeps
working. Spans: the request span ``{text_completion|chat} {model}`` (SERVER) with ``llm.prompt``
and ``llm.token_stream`` in the HTTP worker, ``llm.router.request`` and ``llm.engine.step`` in the
router, ``llm.infer.request`` (and ``llm.logit_dist`` for chosen requests) in the worker - one
trace per request; see docs/lightllm.md.

Configuration
-------------
``OTEL_*`` (exporters, service name, sampler), ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``
(false; LightLLM prompts and completions are not captured by this adapter in any case),
``LLM_OTEL_TOKEN_EVENTS`` (4), ``LLM_OTEL_LOGIT_DIST_RATIO`` (0.05: share of sampled requests that get
``llm.logit_dist`` from the worker's logits), ``LLM_OTEL_LOGPROBS_TOP_K`` (5),
``LLM_OTEL_LOGIT_EVENTS`` (8) - see :class:`llm_otel.config.Settings`.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Collection
from typing import Any, cast

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]  # the module opts out of type checking (a '# type: ignore' header)

from llm_otel.config import Settings
from llm_otel.instrumentation._hooks import (
    AppliedHook,
    ImportHooked,
    _resolve,
    apply_hooks,
    remove_hooks,
    telemetry_on_first_use,
)
from llm_otel.instrumentation.lightllm import carrier
from llm_otel.instrumentation.lightllm.adapter import LightLLMAdapter
from llm_otel.instrumentation.lightllm.hooks import HOOKS, MODULES, SETSTATE, detect_layout, expected
from llm_otel.instrumentation.lightllm.package import _instruments

__all__ = ["LightLLMInstrumentor", "HOOKS"]
logger = logging.getLogger("llm_otel")


class LightLLMInstrumentor(ImportHooked, BaseInstrumentor):
    """Instruments LightLLM. ``instrument(tracer_provider=None, meter_provider=None, settings=None)``.

    Without providers it uses the global ones, creating them from the ``OTEL_*`` environment when
    the process has none (so ``opentelemetry-instrument`` works without a distro, in every LightLLM
    process) - at the first import of a LightLLM module it hooks, so a process that never imports
    LightLLM (a vLLM engine process under ``opentelemetry-instrument``) gets no providers from it.
    ``adapter`` is None until then.
    """

    ENGINE = "LightLLM"
    SITE = "instrumentation.lightllm.import_hook"
    adapter: LightLLMAdapter | None = None  # built at the first LightLLM import (see _first_use)
    _applied: list[AppliedHook] = []
    _setstate: tuple | None = None  # (class, previous __dict__ entry or None)
    layouts: dict[str, str | None] = {}
    _lock = threading.RLock()  # a hooked import inside a hook (re-entry) must not deadlock

    def instrumentation_dependencies(self) -> Collection[str]:
        """Empty (see package.py): LightLLM runs from source checkouts, so a distribution requirement
        would make ``instrument()`` skip it silently; the hooks detect the layout from the code."""
        return _instruments

    def _instrument_engine(self, **kwargs: Any) -> None:
        if importlib.util.find_spec("lightllm") is None:
            # the post-import hooks are still registered (a directory added to sys.path later,
            # e.g. the working directory of `python -m lightllm...`, can still provide it)
            logger.debug("llm-otel: lightllm is not importable here; its hooks wait for an import of it")
        settings = kwargs.get("settings") or Settings.from_env()
        self._applied, self._setstate, self.layouts = [], None, {}
        if kwargs.get("tracer_provider") is None and kwargs.get("meter_provider") is None:
            from llm_otel.instrumentation.lightllm import process

            # which LightLLM process this is, for the resource of the providers built at the first
            # LightLLM import: known now (launcher, gunicorn master), in multiprocessing's bootstrap
            # (router, model-infer rank, detokenizer, ...) or after gunicorn forks an HTTP worker
            process.install()
        self._wait_for(MODULES, {**kwargs, "settings": settings})

    def _first_use(self) -> LightLLMAdapter:
        """The adapter, on providers that exist from now on (see ``telemetry_on_first_use``): a
        process that never imports LightLLM - a vLLM engine process under ``opentelemetry-instrument``
        - gets none. Providers built here get the labels :mod:`.process` already found."""
        pending = cast(dict[str, Any], self._pending)  # _on_import calls this only while it is set
        adapter = LightLLMAdapter(telemetry_on_first_use(pending, __name__))
        if pending.get("tracer_provider") is None and pending.get("meter_provider") is None:
            from llm_otel.instrumentation.lightllm import process

            process.relabel_as_found()
        return adapter

    def _hook_module(self, module) -> None:
        name = module.__name__
        layout = detect_layout(name, module)
        self.layouts[name] = layout
        if name == SETSTATE.module:
            self._install_setstate(module)
            return
        hooks = [h for h in HOOKS if h.module == name]
        found, missing = [], []
        for hook in hooks:
            try:
                _resolve(hook)
                found.append(hook)
            except (ImportError, AttributeError):
                missing.append(hook)
        self._applied.extend(apply_hooks(found, self.adapter, "LightLLM"))
        groups = {h.group for h in found if h.group}
        report = [h.target for h in missing if expected(h, layout) and not (h.group and h.group in groups)]
        if report and layout is not None:
            # a known layout that lacks one of its targets: one warning per target, naming it
            for target in report:
                logger.warning(
                    "llm-otel: LightLLM module %s (layout %s) has no %s; that stage is not traced, "
                    "the others keep working",
                    name,
                    layout,
                    target,
                )
        elif report:
            logger.warning(
                "llm-otel: LightLLM module %s has an unknown layout (known: main, v1.0, pr965, 2024): "
                "%s not found; those stages are not traced, the others keep working",
                name,
                ", ".join(report),
            )

    def _install_setstate(self, module) -> None:
        cls = getattr(module, "MultimodalParams", None)
        if cls is None:
            logger.warning(
                "llm-otel: LightLLM module %s has no MultimodalParams; trace context does not "
                "cross processes (HTTP-side spans still work)",
                module.__name__,
            )
            return
        previous = vars(cls).get("__setstate__")
        cls.__setstate__ = carrier.make_setstate(previous)
        self._setstate = (cls, previous)

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            remove_hooks(self._applied)
            self._applied = []
            if self._setstate is not None:
                cls, previous = self._setstate
                if previous is None:
                    del cls.__setstate__
                else:
                    cls.__setstate__ = previous
                self._setstate = None
            self.layouts = {}
            self._stop()
