"""Restarting llm-otel's threads in a forked child: the one module of :mod:`llm_otel.process` that
lower parts may import.

A component that owns a thread (the NVML utilisation poller in :mod:`llm_otel.gpu.nvml`, the
serving signals' tick thread in :mod:`llm_otel.signals.service`) registers itself here when it
starts it, so that an application that forks after ``instrument()`` (gunicorn ``--preload``,
Celery prefork, vLLM under ``fork``) has it running in each child too. Those parts sit below
``process/`` in the layering (docs/architecture.md): this module is the documented exception, a
leaf that imports nothing of llm_otel, so that they can reach it without importing the process
runtime. :mod:`llm_otel.process.lifecycle` re-exports its functions and, once imported, reports a
failing restart to llm-otel's error counter (:func:`report_failures_with`); until then a failure is
one warning line.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger("llm_otel")

_fork_callbacks: list[Callable[[], None]] = []


class _Restartable(Protocol):
    def _restart_after_fork(self) -> None: ...


_restartable: weakref.WeakSet[_Restartable] = weakref.WeakSet()


def _log_failure(site: str, exc: BaseException, message: str) -> None:
    logger.warning("llm-otel: %s (%s: %s)", message, type(exc).__name__, exc)


_report: list[Callable[[str, BaseException, str], None]] = [_log_failure]


def report_failures_with(report: Callable[[str, BaseException, str], None]) -> None:
    """``report(site, exception, message)`` for a restart or callback that raised in a forked child
    (:mod:`llm_otel.process.lifecycle` hands llm-otel's error counter in)."""
    _report[0] = report


def _fail(site: str, exc: BaseException, message: str) -> None:
    _report[0](site, exc, message)  # counted once process.lifecycle is imported, else one warning


def on_fork_child(callback: Callable[[], None]) -> None:
    """Call ``callback()`` in every child forked from this process (``os.fork``, ``multiprocessing``
    with ``fork``), after the id generators are reseeded: restart threads, re-open resources.
    Exceptions are logged, never raised into the application."""
    _fork_callbacks.append(callback)


def restart_in_fork_child(component: _Restartable) -> None:
    """Call ``component._restart_after_fork()`` in every child forked from this process, for as
    long as ``component`` lives (held weakly): a poller or tick thread started here runs in the
    child too."""
    _restartable.add(component)


def _after_fork_in_child() -> None:
    for component in list(_restartable):
        try:
            component._restart_after_fork()
        except Exception as exc:  # noqa: BLE001 - never into the application's fork
            _fail("process.lifecycle.after_fork", exc, f"restarting {type(component).__name__} after fork failed")
    for callback in list(_fork_callbacks):
        try:
            callback()
        except Exception as exc:  # noqa: BLE001
            _fail("process.lifecycle.after_fork", exc, "re-initialising after fork failed")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
