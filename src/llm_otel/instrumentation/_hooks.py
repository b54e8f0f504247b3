"""Applying a table of wrapt hooks, tolerating engines whose layout moved, and undoing it exactly."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import wrapt

from llm_otel.config import ConfigError
from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")


@dataclasses.dataclass(frozen=True)
class Hook:
    """One function llm-otel wraps.

    Attributes:
        module: import path of the module that owns the target (``vllm.v1.engine.llm_engine``).
        target: ``"Class.method"`` or ``"function"`` inside that module.
        factory: name (dotted for sub-adapters, ``"core.engine_step"``) of the adapter method that
            returns the wrapt wrapper ``wrapper(wrapped, instance, args, kwargs)``.
        layout: the engine layouts/versions in which the target lives there.
        purpose: what the hook reads, for the table in the docs.
        group: hooks with the same non-empty group are alternatives (one function in different
            engine layouts): a missing one is only reported when none of its group resolves.
    """

    module: str
    target: str
    factory: str
    layout: str
    purpose: str
    group: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.module}:{self.target}"


@dataclasses.dataclass
class AppliedHook:
    hook: Hook
    owner: Any
    attribute: str
    original: Any  # the owner's own __dict__ entry before wrapping (staticmethod etc. kept)


def _resolve(hook: Hook) -> tuple[Any, str]:
    owner: Any = importlib.import_module(hook.module)
    *path, attribute = hook.target.split(".")
    for part in path:
        owner = getattr(owner, part)
    if attribute not in vars(owner):
        # an inherited attribute would be patched on the wrong class; treat it as missing
        getattr(owner, attribute)
        raise AttributeError(f"{hook.target} is inherited, not defined in {hook.module}")
    return owner, attribute


def library_missing(package: str, what: str) -> bool:
    """True (and one debug line) when the top-level ``package`` cannot be imported here.

    ``opentelemetry-instrument`` loads every installed instrumentor in every process, skipping its
    dependency check; an instrumentor whose library is absent must then do nothing, quietly.
    """
    try:
        if importlib.util.find_spec(package) is not None:
            return False
    except (ImportError, ValueError):
        pass
    logger.debug("llm-otel: %s is not importable in this process; the %s instrumentation does nothing", package, what)
    return True


ENABLED_ENV = "LLM_OTEL_ENABLED"
_OFF_VALUES = ("0", "false", "no", "off")


def switched_off() -> bool:
    """True when ``LLM_OTEL_ENABLED`` holds a false value (``0``, ``false``, ``no``, ``off``, any
    case): llm-otel instruments nothing in this process, whichever way it was started
    (``opentelemetry-instrument``, ``llm_otel.instrument()``, vLLM's plugin loader), so that every
    process of an engine is off together - the processes an engine starts inherit the variable
    (unset: each entry point's default; ``1``: vLLM's plugin on in every vLLM process)."""
    if os.environ.get(ENABLED_ENV, "").strip().lower() not in _OFF_VALUES:
        return False
    logger.debug("llm-otel: %s=%s; nothing is instrumented in this process", ENABLED_ENV, os.environ[ENABLED_ENV])
    return True


def _absent_dependency(hook: Hook, exc: BaseException) -> bool:
    """Whether ``exc`` says a package outside the engine's own tree is not installed (an optional
    extra such as tritonclient's grpc or http part), rather than that the engine moved the target."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not name:
        return False
    top = hook.module.split(".")[0]
    return name == top or name.split(".")[0] != top  # the engine itself, or another package


def apply_hooks(hooks: list[Hook], adapter: Any, engine: str) -> list[AppliedHook]:
    """Wrap every resolvable target; a missing one gets one warning naming it and is skipped, never
    raised. A target whose module cannot be imported because a package outside the engine is not
    installed (an optional part of the library) gets one debug line instead."""
    applied: list[AppliedHook] = []
    missing: list[tuple[Hook, ImportError | AttributeError]] = []
    for hook in hooks:
        try:
            owner, attribute = _resolve(hook)
        except (ImportError, AttributeError) as exc:
            missing.append((hook, exc))
            continue
        try:
            factory: Any = adapter
            for part in hook.factory.split("."):
                factory = getattr(factory, part)
            original = vars(owner)[attribute]
            wrapt.wrap_function_wrapper(owner, attribute, factory(hook.qualname))
        except Exception as exc:  # noqa: BLE001 - a broken hook must not break the application
            process_errors().report(hook.qualname, exc, f"could not wrap {hook.qualname}; this hook is skipped")
            continue
        applied.append(AppliedHook(hook, owner, attribute, original))
    resolved_groups = {a.hook.group for a in applied if a.hook.group}
    absent: set[str | None] = set()
    for hook, error in missing:
        if hook.group and hook.group in resolved_groups:
            continue  # another layout's target for the same function resolved
        if _absent_dependency(hook, error):
            if error.name not in absent:
                absent.add(error.name)
                logger.debug(
                    "llm-otel: %s: %s is not installed; the hooks in modules that need it are skipped",
                    engine,
                    error.name,
                )
            continue
        logger.warning(
            "llm-otel: %s hook target %s not found (%s: %s); this hook is skipped, the others keep working",
            engine,
            hook.qualname,
            type(error).__name__,
            error,
        )
    return applied


def missing_hooks(hooks: list[Hook]) -> list[Hook]:
    """Hooks that would be reported missing by :func:`apply_hooks` (for ``llm-otel doctor``)."""
    resolved, unresolved = set(), []
    for hook in hooks:
        try:
            _resolve(hook)
            resolved.add(hook.group)
        except (ImportError, AttributeError):
            unresolved.append(hook)
    return [h for h in unresolved if not (h.group and h.group in resolved)]


def remove_hooks(applied: list[AppliedHook]) -> None:
    """Put back exactly the attribute each hook replaced (in reverse order)."""
    for item in reversed(applied):
        setattr(item.owner, item.attribute, item.original)
    applied.clear()


_CONFIG_ERROR_LOGGED = [False]
# the invalid setting this process reported, inherited by the processes it starts (vLLM's engine
# processes, multiprocessing's resource tracker: under opentelemetry-instrument each validates
# the same environment at its start); they log it at DEBUG instead of an ERROR line each
REFUSED_ENV = "LLM_OTEL_CONFIG_REFUSED"


def configuration_refused(engine: str, exc: BaseException) -> None:
    """An instrumentor's ``_instrument`` met an invalid ``OTEL_*``/``LLM_OTEL_*`` value
    (:class:`llm_otel.config.ConfigError`): that engine stays uninstrumented, with one ERROR line
    naming the variable per process tree - a process whose parent already reported the same error
    (``LLM_OTEL_CONFIG_REFUSED``, set here for the children) logs it at DEBUG. It must not raise:
    under ``opentelemetry-instrument`` an exception from one instrumentor aborts the whole
    auto-instrumentation (every other library's too) with tracebacks. ``llm_otel.instrument()``
    validates the same settings first and raises ConfigError itself, so the explicit API still
    fails loudly."""
    message = str(exc)
    if not _CONFIG_ERROR_LOGGED[0]:
        _CONFIG_ERROR_LOGGED[0] = True
        if os.environ.get(REFUSED_ENV) == message:
            logger.debug(
                "llm-otel: invalid configuration, %s (reported by a parent process); llm-otel "
                "instruments nothing in this process",
                exc,
            )
            return
        os.environ[REFUSED_ENV] = message
        logger.error(
            "llm-otel: invalid configuration, %s; llm-otel instruments nothing in this process "
            "(other OpenTelemetry instrumentations are unaffected)",
            exc,
        )
    else:
        logger.debug("llm-otel: %s not instrumented: %s", engine, exc)


def telemetry_on_first_use(kwargs: dict[str, Any], scope: str):
    """The :class:`llm_otel.telemetry.Telemetry` of an instrumentor whose library this process has
    just imported, on providers built now where needed: the process runtime's recipe
    (:func:`llm_otel.process.providers.telemetry_on_first_use`). Raises
    :class:`llm_otel.config.ConfigError` for an invalid exporter setting."""
    from llm_otel.process.providers import telemetry_on_first_use as on_first_use

    return on_first_use(kwargs, scope)


def flush_after_later_exit_handlers() -> None:
    """Create this process's lifecycle now (:mod:`llm_otel.process.lifecycle`), at ``instrument()``,
    though the providers it flushes come at the first import of the engine: ``atexit`` runs its
    handlers last-registered first, so the final flush registered now runs after the exit handlers
    the application registers later - spans those make (a Triton call at exit) are still flushed."""
    from llm_otel.process.lifecycle import lifecycle

    lifecycle()


class ImportHooked:
    """Mixin for an instrumentor whose hooks wait for the engine's modules (wrapt post-import
    hooks): ``instrument()`` only records its arguments (:meth:`_wait_for`); each hooked module is
    wrapped when this process imports it - at once if it already has - and the telemetry (with the
    providers, see :func:`telemetry_on_first_use`) is built at the first one.

    The subclass sets ``ENGINE`` (for log lines), ``SITE`` (its ``llm_otel.instrumentation.errors``
    site) and ``_lock``, and defines ``_first_use() -> adapter`` and ``_hook_module(module)``
    (called under ``_lock``, once per module per instrumentation). ``adapter`` is None until the
    first hooked import; :meth:`_stop` ends the instrumentation (wrapt cannot remove post-import
    hooks: they stay registered and do nothing)."""

    ENGINE = ""
    SITE = ""
    adapter: Any = None
    _pending: dict[str, Any] | None = None  # instrument()'s arguments while instrumented
    _hooked: set[str] = set()  # modules hooked in this instrumentation
    _lock: threading.RLock
    _instrument_engine: Callable[..., None]  # defined by the subclass

    def _instrument(self, **kwargs: Any) -> None:
        """``BaseInstrumentor``'s entry: the subclass's ``_instrument_engine(**kwargs)``; an invalid
        setting it meets is one ERROR line and no instrumentation (:func:`configuration_refused`);
        nothing with ``LLM_OTEL_ENABLED=false`` (:func:`switched_off`)."""
        if switched_off():
            return
        try:
            self._instrument_engine(**kwargs)
        except ConfigError as exc:
            configuration_refused(self.ENGINE, exc)

    def _wait_for(self, modules: Iterable[str], kwargs: dict[str, Any]) -> None:
        """Start an instrumentation with ``instrument()``'s ``kwargs`` (``settings`` validated)."""
        with self._lock:
            self._pending, self.adapter, self._hooked = kwargs, None, set()
        if kwargs.get("tracer_provider") is None and kwargs.get("meter_provider") is None:
            flush_after_later_exit_handlers()
        for name in modules:
            wrapt.register_post_import_hook(self._on_import, name)  # runs now if already imported

    def _stop(self) -> None:
        """End the instrumentation (under ``_lock``, after the subclass restored what it patched)."""
        self._pending, self.adapter, self._hooked = None, None, set()

    def _on_import(self, module) -> None:
        """Post-import hook: wrap the targets of ``module``; never raises. An invalid exporter
        setting met when the providers are built leaves the engine uninstrumented in this process
        (one ERROR line, :func:`configuration_refused`); any other failure is counted and logged
        once, and the module runs uninstrumented."""
        name = getattr(module, "__name__", str(module))
        try:
            with self._lock:
                if self._pending is None or name in self._hooked:
                    return
                self._hooked.add(name)
                if self.adapter is None:
                    self.adapter = self._first_use()
                self._hook_module(module)
        except ConfigError as exc:
            self._pending = None
            configuration_refused(self.ENGINE, exc)
        except Exception as exc:  # noqa: BLE001
            process_errors().report(self.SITE, exc, f"could not instrument {name}; it runs uninstrumented")

    def _first_use(self) -> Any:
        raise NotImplementedError

    def _hook_module(self, module) -> None:
        raise NotImplementedError
