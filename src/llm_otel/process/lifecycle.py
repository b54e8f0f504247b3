"""Per-process telemetry lifecycle: one final flush of traces and metrics on every orderly exit,
within a deadline, in whichever way the process started (``spawn``, ``fork``) or ends.

Each process that builds providers (the application or vLLM frontend, a vLLM engine core or
worker, a forked application child) has one :class:`ProcessLifecycle`. It

* runs callbacks that complete pending telemetry first (the worker's buffered logit statistics,
  device records still in the step ring, requests that will never finish because the process is
  going away),
* then shuts the providers down - the batch span processor exports what it holds, the metric
  readers collect and export a last time - in a daemon thread it waits for at most the deadline
  (``LLM_OTEL_FLUSH_DEADLINE_S``, default 2 s, measured from the moment the process learned it is
  shutting down). An unreachable collector therefore costs at most the deadline, once per process,
  and one warning says what was not delivered (spans still queued or in flight, failed exports).

Exit paths covered: interpreter exit (``atexit``: an application or the API server after SIGTERM,
an offline ``LLM`` collected at exit) and the end of a ``multiprocessing`` child's ``run()``
(``multiprocessing.util.Finalize``: vLLM's engine-core and worker processes under both ``spawn``
and ``fork`` - a forked child leaves through ``os._exit``, which skips ``atexit``). What SIGKILL
takes is lost; nothing else.

:func:`begin_shutdown` starts the deadline and a background flush early, when a process first
learns that it is going away (vLLM's engine core and workers when their shutdown starts), so the
processes of one server flush concurrently rather than one after the other, and each marks when it
is done (:func:`wait_flushed`: the vLLM frontend waits for that, not for the slower teardown).

Fork: components that own threads register themselves (:func:`restart_in_fork_child`: pollers,
the signals thread) or :func:`on_fork_child` callbacks, so that an application that forks after
``instrument()`` (gunicorn ``--preload``, Celery prefork) has them running in each child (the
registry is :mod:`llm_otel.process.forks`, a leaf the GPU and signals parts import); exporters
rebuild their channels themselves (:mod:`llm_otel.export.exporters`); ids are reseeded
(:mod:`llm_otel.export.providers`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

from llm_otel.errors import guard, process_errors
from llm_otel.export.exporters import DEFAULT_DEADLINE_S
from llm_otel.process.forks import on_fork_child, report_failures_with, restart_in_fork_child

__all__ = [
    "ProcessLifecycle",
    "lifecycle",
    "begin_shutdown",
    "create_flush_dir",
    "mark_started",
    "wait_flushed",
    "on_fork_child",
    "restart_in_fork_child",
    "DEFAULT_DEADLINE_S",
    "FLUSH_DIR_ENV",
]

logger = logging.getLogger("llm_otel")


_lock = threading.Lock()
_current: ProcessLifecycle | None = None


class ProcessLifecycle:
    """The providers llm-otel built in this process and their bounded final flush.

    Args:
        role: what this process is (``frontend``, ``engine_core``, ``worker``, ``application``),
            for the log line.
        deadline_s: seconds the final flush may take in total (traces and metrics together).
    """

    def __init__(self, role: str, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        self.role = role
        self.deadline_s = float(deadline_s)
        # SDK providers, llm-otel's offload providers and exporters: used duck-typed (getattr)
        self.tracer_providers: list[Any] = []
        self.meter_providers: list[Any] = []
        self.exporters: list[Any] = []
        self._before: list[tuple[Callable[[], None], bool]] = []
        self._reset()
        atexit.register(self.flush)
        self._register_finalizer()
        multiprocessing.util.register_after_fork(self, ProcessLifecycle._after_multiprocessing_fork)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._deadline_at: float | None = None
        self._early: threading.Thread | None = None
        self._early_done = False
        self._early_incomplete = False
        self._reported = False
        self._failed_before: dict[int, int] = {}
        self._done = False
        self.flush_seconds: float | None = None
        self.complete: bool | None = None

    def _register_finalizer(self) -> None:
        # runs at the end of a multiprocessing child's run() (spawn and fork); in the main process
        # atexit (registered after multiprocessing's own hook, so it runs first) has done the work
        multiprocessing.util.Finalize(None, self.flush, exitpriority=10)

    @staticmethod
    def _after_multiprocessing_fork(self: ProcessLifecycle) -> None:
        # multiprocessing clears its finalizer registry in a forked child: register again
        self._register_finalizer()

    # --- what to flush ------------------------------------------------------------------------
    def add(self, tracer_provider: Any = None, meter_provider: Any = None, exporters: Iterable[Any] = ()) -> None:
        """Flush these providers at exit (and count these exporters' failures for the log line)."""
        self._check_pid()
        if multiprocessing.parent_process() is not None:
            mark_started()  # the parent that stops this child waits for its flush (vLLM frontends)
        if tracer_provider is not None:
            self.tracer_providers.append(tracer_provider)
        if meter_provider is not None:
            self.meter_providers.append(meter_provider)
        self.exporters.extend(e for e in exporters if e is not None)

    def before_flush(self, callback: Callable[[], None], early: bool = False) -> None:
        """Run ``callback()`` before the providers are flushed (it completes pending telemetry;
        its exceptions are logged, never raised). ``early``: already when the shutdown begins
        (:meth:`begin` - for work that is over by then, like an engine process's model steps);
        otherwise only in the final :meth:`flush`."""
        self._before.append((callback, early))

    def forget(self) -> None:
        """Drop every provider, exporter and callback (a forked vLLM engine process replacing the
        frontend's inherited setup by the one of its own role)."""
        self.tracer_providers, self.meter_providers, self.exporters, self._before = [], [], [], []
        self._reset()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # inherited through fork: this process's flush is its own
            self._reset()

    # --- shutdown -----------------------------------------------------------------------------
    def begin(self) -> None:
        """The process is going away: start the deadline now and export what is already finished
        in the background (the final :meth:`flush` waits for whatever remains)."""
        self._check_pid()
        with _lock:
            if self._deadline_at is not None or self._done:
                return
            self._deadline_at = time.monotonic() + self.deadline_s
            self._snapshot_failures()
            self._early = _start_thread(self._early_flush, "llm-otel-early-flush")

    def _run_callbacks(self, early: bool) -> None:
        """The early callbacks (``early``), or those not run yet (the final flush)."""
        for callback, is_early in self._before:
            if (early and not is_early) or (not early and is_early and self._early_done):
                continue
            with guard("process.lifecycle.before_flush", message="completing pending telemetry at exit failed"):
                callback()  # never raises out of an exit path

    def _early_flush(self) -> None:
        self._run_callbacks(early=True)
        self._early_done = True
        pusher = _start_thread(self._force_flush, "llm-otel-early-export")
        if pusher is not None:
            # set by begin() before it started this thread
            pusher.join(max(0.0, cast(float, self._deadline_at) - time.monotonic()))
            # still pushing, or a provider's flush gave up at the deadline (the exporter process's
            # does, rather than hang): the process may be killed any moment now, say it while we can
            if pusher.is_alive() or self._early_incomplete:
                self._report(done=False)
        _mark("flushed")  # delivered or given up: the parent need not wait any longer

    def _force_flush(self) -> None:
        ms = max(1, int(self.deadline_s * 1000))
        for provider in self.tracer_providers + self.meter_providers:
            with guard("process.lifecycle.early_flush", message="early flush failed"):
                if provider.force_flush(ms) is False and getattr(provider, "buffer", None) is not None:
                    self._early_incomplete = True

    def _report(self, done: bool) -> None:
        """One warning per process when telemetry was not delivered."""
        with _lock:
            if self._reported:
                return
            self._reported = True
        message = "llm-otel: final flush of the {} process (pid {}) {}; not delivered: {}".format(
            self.role,
            os.getpid(),
            f"gave up after {self.deadline_s:g} s (LLM_OTEL_FLUSH_DEADLINE_S)"
            if not done
            else "finished with export errors",
            self._undelivered(),
        )
        if logger.hasHandlers():
            logger.warning(message)
        else:
            # Python's last-resort handler writes to the *current* sys.stderr, which servers replace
            # (vLLM prefixes its processes' output) and may have torn down by interpreter exit
            stderr = sys.__stderr__
            if stderr is None:  # no stderr at all (pythonw, closed): nowhere to say it
                return
            try:
                stderr.write(message + "\n")
                stderr.flush()
            except (AttributeError, OSError, ValueError):
                pass

    def flush(self) -> bool:
        """Run the callbacks, then shut the providers down within what is left of the deadline.
        Once per process; returns True when everything was handed over in time."""
        self._check_pid()
        with _lock:
            if self._done:
                return bool(self.complete)
            self._done = True
            if self._deadline_at is None:
                self._deadline_at = time.monotonic() + self.deadline_s
                self._snapshot_failures()
        start = time.monotonic()
        logger.debug("llm-otel: final flush of the %s process (pid %d) starts", self.role, os.getpid())
        early = self._early
        if early is not None:  # its callbacks must not run twice nor concurrently with ours
            early.join(max(0.0, self._deadline_at - time.monotonic()))
            if not early.is_alive() and not self._reported:
                # the early flush delivered in time; what ended since (vLLM's teardown can outlast
                # the deadline) gets a deadline of its own: the exit waits for it, not for teardown
                self._deadline_at = time.monotonic() + self.deadline_s
        self._run_callbacks(early=False)
        worker = _start_thread(self._shutdown_providers, "llm-otel-final-flush")
        if worker is None:  # no new threads (interpreter shutdown): bounded calls inline
            self._shutdown_providers()
            done = True
        else:
            worker.join(max(0.0, self._deadline_at - time.monotonic()))
            done = not worker.is_alive()
        self.flush_seconds = time.monotonic() - start
        self.complete = done and not self._failures() and not self._reported
        logger.debug(
            "llm-otel: final flush of the %s process done=%s complete=%s in %.3f s",
            self.role,
            done,
            self.complete,
            time.monotonic() - start,
        )
        _mark("flushed")
        if not self.complete:
            self._report(done)
        return self.complete

    def _remaining_ms(self) -> int:
        # only called from the final flush, after flush() set the deadline
        return max(1, int((cast(float, self._deadline_at) - time.monotonic()) * 1000))

    def _shutdown_providers(self) -> None:
        # traces first: each span processor exports what it holds (bounded by its own timeout)
        for provider in self.tracer_providers:
            processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
            with guard("process.lifecycle.shutdown", message="tracer provider shutdown failed"):
                if processors is None:
                    if getattr(provider, "buffer", None) is not None:  # spans in an exporter process
                        provider.shutdown(timeout_millis=self._remaining_ms())
                    else:
                        provider.shutdown()
                    continue
                for processor in processors:
                    inner = getattr(processor, "_batch_processor", None)
                    if inner is not None:
                        inner.shutdown(timeout_millis=self._remaining_ms())
                    else:
                        processor.shutdown()
                provider._active_span_processor._span_processors = ()  # noqa: SLF001 - done; no 2nd export
        for provider in self.meter_providers:
            with guard("process.lifecycle.shutdown", message="meter provider shutdown failed"):
                provider.shutdown(timeout_millis=self._remaining_ms())

    def _snapshot_failures(self) -> None:
        # only what fails from now on is this flush's loss; earlier outages were counted and
        # logged when they happened (llm_otel.spans.dropped)
        self._failed_before = {id(e): getattr(e, "failed", 0) for e in self.exporters}

    def _failures(self) -> int:
        return sum(
            self._failed(e) + getattr(e, "in_flight", 0) for e in self.exporters if not getattr(e, "disowned", False)
        )

    def _failed(self, exporter: object) -> int:
        return max(0, getattr(exporter, "failed", 0) - self._failed_before.get(id(exporter), 0))

    def _undelivered(self) -> str:
        queued = 0
        for provider in self.tracer_providers:
            for processor in getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ()) or ():
                queued += len(getattr(getattr(processor, "_batch_processor", None), "_queue", ()) or ())
        parts = []
        spans = [e for e in self.exporters if hasattr(e, "max_request_bytes")]
        metrics = [e for e in self.exporters if not hasattr(e, "max_request_bytes")]
        lost_spans = queued + sum(self._failed(e) + e.in_flight for e in spans)
        lost_metric_exports = sum(self._failed(e) + e.in_flight for e in metrics)
        parts.append(f"{lost_spans} span(s)")
        if lost_metric_exports or (self.meter_providers and not self.complete):
            parts.append("the metric points since the last export")
        errors = {e.last_error for e in self.exporters if getattr(e, "last_error", None)}
        endpoints = {e.endpoint for e in self.exporters if getattr(e, "endpoint", "")}
        where = f" to {', '.join(sorted(endpoints))}" if endpoints else ""
        why = f" ({'; '.join(sorted(errors))[:300]})" if errors else ""
        return ", ".join(parts) + where + why


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread | None:
    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown" (Python >= 3.12)
        return None
    return thread


def lifecycle(role: str | None = None, deadline_s: float | None = None) -> ProcessLifecycle:
    """This process's lifecycle, created on first use (``role`` and ``deadline_s`` then apply;
    ``deadline_s`` defaults to ``LLM_OTEL_FLUSH_DEADLINE_S``)."""
    global _current
    with _lock:
        if _current is None:
            if deadline_s is None:
                from llm_otel.config import Settings

                try:
                    deadline_s = Settings.from_env().flush_deadline_s
                except Exception:  # noqa: BLE001 - silent: reported where settings are validated
                    deadline_s = DEFAULT_DEADLINE_S
            _current = ProcessLifecycle(role or "application", deadline_s)
        elif role is not None:
            _current.role = role
        if deadline_s is not None:
            _current.deadline_s = float(deadline_s)
        return _current


def begin_shutdown() -> None:
    """Start this process's flush deadline and an early background flush (no-op without providers
    built by llm-otel). Never raises."""
    with guard("process.lifecycle.begin", message="beginning this process's shutdown flush failed"):
        if _current is not None:
            _current.begin()


# --- telling the process that stops us that we are flushed ------------------------------------
# A vLLM frontend stops its engine processes with SIGTERM and kills them `timeout` seconds later
# (0 under the OpenAI server). It waits for them up to the flush deadline, but tearing down an
# engine process (torch, the worker's distributed state) takes longer than flushing it: each
# engine process marks a file when its telemetry is handed over, and the frontend stops waiting
# once every engine process below it did, or exited.
FLUSH_DIR_ENV = "LLM_OTEL_FLUSH_DIR"
_owned_dir: str | None = None
_owner_pid: int | None = None


def create_flush_dir() -> str | None:
    """In a process that will start engine processes (the vLLM frontend): a private directory in
    ``LLM_OTEL_FLUSH_DIR`` that they inherit; removed at this process's exit."""
    global _owned_dir, _owner_pid
    current = os.environ.get(FLUSH_DIR_ENV)
    # only a directory an ancestor llm-otel process made (private, ours to write): anything else in
    # the variable - a user's directory, one that is read-only, a stale one - would let the marks
    # of other processes or failed writes stop the wait early
    if (
        current
        and os.path.basename(current).startswith("llm-otel-flush-")
        and os.path.isdir(current)
        and os.access(current, os.W_OK | os.X_OK)
    ):
        return current
    import shutil
    import tempfile

    try:
        _owned_dir = tempfile.mkdtemp(prefix="llm-otel-flush-")
    except OSError as exc:
        logger.debug("llm-otel: no flush directory (%s); the frontend waits for engine exits", exc)
        return None
    os.environ[FLUSH_DIR_ENV] = _owned_dir
    owner = _owner_pid = os.getpid()
    made = _owned_dir

    def _remove_flush_dir() -> None:
        if os.getpid() == owner:
            shutil.rmtree(made, ignore_errors=True)

    atexit.register(_remove_flush_dir)
    return _owned_dir


def mark_started() -> None:
    """This engine process has telemetry to flush before it may be killed."""
    _mark("started")


def _mark(state: str) -> None:
    directory = os.environ.get(FLUSH_DIR_ENV)
    if not directory or (_owned_dir == directory and _owner_pid == os.getpid()):
        return  # the process that waits marks nothing
    try:
        with open(os.path.join(directory, f"{os.getpid()}.{state}"), "w"):
            pass
    except OSError:
        pass


def wait_flushed(pids: list[int], deadline: float, poll_s: float = 0.02) -> bool:
    """Wait until every process among ``pids`` and their descendants that marked itself started
    has marked itself flushed or has exited, or until ``deadline`` (``time.monotonic()``).
    Returns True if they all did. Without a flush directory: until they all exited."""
    directory = os.environ.get(FLUSH_DIR_ENV)
    try:
        import psutil
    except ImportError:  # pragma: no cover - vLLM depends on psutil
        psutil = None
    while True:
        alive = []
        for pid in pids:
            alive.append(pid)
            if psutil is not None:
                try:
                    alive.extend(c.pid for c in psutil.Process(pid).children(recursive=True))
                except psutil.Error:
                    pass
        pending = [pid for pid in alive if _running(pid) and not _flushed(directory, pid)]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _flushed(directory: str | None, pid: int) -> bool:
    if not directory:
        return False
    if not os.path.exists(os.path.join(directory, f"{pid}.started")):
        return True  # nothing of ours to wait for in that process
    return os.path.exists(os.path.join(directory, f"{pid}.flushed"))


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the moment of the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# a restart that fails in a forked child (llm_otel.process.forks) is counted like any other failure
report_failures_with(lambda site, exc, message: process_errors().report(site, exc, message))
