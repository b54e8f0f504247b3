"""Failures inside llm-otel's own code: counted, logged once per site, never raised into the engine.

A leaf module (it imports only the generated names) so that every layer can use it: the core
(``llm_otel.telemetry.errors`` is its name there), adapters, and the layers below the core.

One style for every failure llm-otel catches (issue 21): the site's count in the self-metric
``llm_otel.instrumentation.errors`` ({error}, attributes ``llm.instrumentation.hook`` = the site,
``error.type``) and one log line the first time that site fails. Hooks report to their
``Telemetry.errors``; code that has no ``Telemetry`` at hand (exporters, the exporter-process
buffer, the process lifecycle, GPU helpers) reports to :func:`process_errors`, the
:class:`HookErrors` of the newest ``Telemetry`` in this process (failures from before the first
one are counted into it when it is created).

    with guard("export.exporters.split", message="could not split a span batch; it is sent whole") as g:
        chunks = split(spans)
    if g.failed:
        chunks = [spans]
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Meter

logger = logging.getLogger("llm_otel")

_default_lock = threading.Lock()


class HookErrors:
    """Counts exceptions caught in hooks into ``llm_otel.instrumentation.errors`` ({error}).

    ``report(hook, exc)`` is safe to call from any thread; the first failure of each hook is
    logged with its traceback, later ones only counted (``counts`` keeps totals for tests/doctor).
    ``report(hook, exc, message)`` logs one line with ``message`` (what failed and what that
    costs) and the exception instead, for failures of the environment rather than bugs (a port in
    use, a driver call failing) or where the traceback would say nothing more.
    ``bad_input(hook, problem)`` is for input a caller got wrong (not a bug of ours): the same
    count (``error.type=invalid_input``), and the first one per hook logged as one line without a
    traceback.

    One built with a meter becomes this process's :func:`process_errors`.
    """

    def __init__(self, meter: Meter | None = None) -> None:
        self._counter: Counter | None = None
        if meter is not None:
            self._counter = meter.create_counter(
                M.LLM_OTEL_INSTRUMENTATION_ERRORS,
                unit=M.LLM_OTEL_INSTRUMENTATION_ERRORS_UNIT,
                description="Exceptions raised inside llm-otel (its hooks, exporters, lifecycle, GPU helpers), "
                "caught and kept away from the engine.",
            )
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._unexported: dict[tuple[str, str], int] = {}  # (hook, error.type) counted without a meter
        if self._counter is not None:
            _adopt(self, self._counter)

    def report(self, hook: str, exc: BaseException, message: str | None = None) -> None:
        """Count one failure of ``hook`` (the site: ``telemetry.spans``, ``export.offload.writer``);
        the first one per site is logged: with its traceback, or as one line ``message`` (what
        failed and what it costs: "could not split a span batch; it is sent whole") + the exception."""
        try:
            with self._lock:
                self.counts[hook] = self.counts.get(hook, 0) + 1
                first = hook not in self._logged
                self._logged.add(hook)
            if first and message is None:
                logger.warning(
                    "llm-otel: hook %s failed; the engine is unaffected and further "
                    "failures of this hook are only counted",
                    hook,
                    exc_info=exc,
                )
            elif first:
                logger.warning(
                    "llm-otel: %s (%s: %s); further failures of %s are only counted",
                    message,
                    type(exc).__name__,
                    exc,
                    hook,
                )
            self._count(hook, type(exc).__qualname__)
        except Exception:  # noqa: BLE001 - silent: telemetry about telemetry must not raise either
            pass

    def bad_input(self, hook: str, problem: str) -> None:
        """Count a call of ``hook`` rejected for bad input; log ``problem`` once per hook, one line."""
        try:
            with self._lock:
                self.counts[hook] = self.counts.get(hook, 0) + 1
                key = f"{hook} (bad input)"
                first = key not in self._logged
                self._logged.add(key)
            if first:
                logger.warning(
                    "llm-otel: %s ignored a call with bad input (%s); the engine is unaffected and "
                    "further bad input here is only counted",
                    hook,
                    problem,
                )
            self._count(hook, "invalid_input")
        except Exception:  # noqa: BLE001 - silent: the error counter itself; nothing left to report to
            pass

    def _count(self, hook: str, error_type: str) -> None:
        if self._counter is not None:
            self._counter.add(1, {A.LLM_INSTRUMENTATION_HOOK: hook, A.ERROR_TYPE: error_type})
        else:  # kept for the first HookErrors with a meter (process_errors before any Telemetry)
            with self._lock:
                key = (hook, error_type)
                self._unexported[key] = self._unexported.get(key, 0) + 1


_fallback = HookErrors()  # until a Telemetry exists in this process: logged, counted later
_default: HookErrors | None = None


def _adopt(errors: HookErrors, counter: Counter) -> None:
    """Make ``errors`` (metered: ``counter`` is its counter) this process's default; what the
    fallback counted so far goes into its counter once, and the sites the fallback already logged
    are not logged again."""
    global _default
    with _default_lock:
        with _fallback._lock:
            pending, _fallback._unexported = _fallback._unexported, {}
            logged = set(_fallback._logged)
        _default = errors
    with errors._lock:
        errors._logged |= logged
    for (hook, error_type), n in pending.items():
        try:
            counter.add(n, {A.LLM_INSTRUMENTATION_HOOK: hook, A.ERROR_TYPE: error_type})
        except Exception:  # noqa: BLE001 - silent: the error counter itself; nothing left to report to
            pass


def process_errors() -> HookErrors:
    """The :class:`HookErrors` for code without a ``Telemetry`` at hand: the newest metered one
    in this process, else a fallback that logs now and is counted into the first metered one."""
    return _default or _fallback


class guard:  # noqa: N801 - used like a function: ``with guard("site"):``
    """Context manager for a block whose failure must not escape: an ``Exception`` inside is
    reported to ``errors`` (:func:`process_errors` when None) as a failure of ``site`` - counted,
    logged once per site (``message``: see :meth:`HookErrors.report`) - and swallowed;
    ``failed`` tells the code after the block. ``BaseException`` (KeyboardInterrupt, SystemExit)
    passes through. Costs an object and three calls, 0.3-0.7 us more than an inline ``try`` (timeit
    of a wrapper around a no-op, loaded 2-core machine): used per request and at set-up, while the
    per-step and per-token wrappers keep an inline ``try``/``except`` that reports the same way."""

    __slots__ = ("site", "errors", "message", "failed")

    def __init__(self, site: str, errors: HookErrors | None = None, message: str | None = None) -> None:
        self.site = site
        self.errors = errors
        self.message = message
        self.failed = False

    def __enter__(self) -> guard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if not isinstance(exc, Exception):  # None: no exception; BaseException passes through
            return False
        self.failed = True
        (self.errors or process_errors()).report(self.site, exc, self.message)
        return True


def _reset_for_tests() -> None:
    """Forget which sites were logged and what the fallback holds for the next metered
    ``HookErrors`` (tests that look for a site's one log line or its count run in any order)."""
    for errors in (_fallback, _default):
        if errors is not None:
            with errors._lock:
                errors._logged.clear()
    with _fallback._lock:
        _fallback._unexported = {}
