"""The serving process's side of the pipe: :class:`OffloadBuffer` - the bounded record buffer
(spans, request trees, metric records), the writer thread that sends them in frames
(:mod:`~llm_otel.export.offload.frames`), the exporter process it starts and restarts, the status
reader counting what that process reports, flush and shutdown - and :class:`RemoteInstrument`, the
stand-in for an SDK instrument whose observations it records there.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import IO, cast

from opentelemetry import trace as trace_api

from llm_otel.config import Settings
from llm_otel.errors import guard, process_errors
from llm_otel.export.drops import DropCounter
from llm_otel.export.offload.frames import (
    REQUEST_POINTS,
    clean_record,
    encode,
    metric_points,
    metric_weight,
    read_frame,
    span_count,
)
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")


def _stdin(proc: subprocess.Popen) -> IO[bytes]:
    """The exporter process's stdin: never None, every exporter process is started with
    ``stdin=subprocess.PIPE`` (:meth:`OffloadBuffer._process`)."""
    return cast("IO[bytes]", proc.stdin)


# LLM_OTEL_EXPORT_PROCESS_BUFFER's default; LLM_OTEL_FLUSH_DEADLINE_S's default: a shutdown
# without a timeout, and the exporter process when it cannot read the setting
DEFAULT_BUFFER: int = Settings().export_process_buffer
DEFAULT_DEADLINE_S: float = Settings().flush_deadline_s
_BATCH = 512  # records per frame
_INTERVAL_S = 0.2  # the writer sends at least this often when something is buffered
_RESPAWN_S = 5.0  # at most one exporter-process start per this many seconds
# after its final flush was answered, the exporter process gets at most this long (within the flush
# deadline) to close its exporters and exit before it is killed: 0.5 s was too short on a loaded
# 2-core machine, where its gRPC channel's close alone took longer (what it held was delivered
# either way)
_EXIT_WAIT_S = 2.0
# this process's pid, refreshed in a forked child: compared on every push (os.getpid() is a system
# call, and the hot path asks for it a dozen times per request)
_PID = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))
BACKLOG = "export_process_backlog"
DOWN = "export_process_down"
ENCODING = "export_process_encoding"  # the span's own data (not an attribute value) pickle cannot encode
# the package directory llm_otel is imported from (the exporter process imports the same one)
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class OffloadBuffer:
    """The bounded buffer, writer thread and exporter process of one serving process.

    Counts for the lifecycle's exit line (the attributes of a span exporter it reads): ``failed``
    (spans lost), ``in_flight`` (spans buffered or sent and not yet reported exported),
    ``last_error``, ``endpoint``, ``max_request_bytes`` (marks it as a span exporter)."""

    def __init__(
        self, resource_attributes: dict, schema_url: str, endpoint: str, capacity: int, env: Mapping[str, str] | None
    ) -> None:
        self.endpoint = endpoint
        self.capacity = max(1, int(capacity))
        self.respawn_s = _RESPAWN_S
        self.max_request_bytes = 0
        self._init = ("init", resource_attributes, schema_url, self.capacity)
        self._instruments_init: tuple | None = None  # set by declare_instruments()
        self._exemplar_ids: tuple = (None, None)  # RemoteInstrument's last (context, exemplar ids)
        self._no_trace = None  # the core's context of observations without an exemplar (declare_instruments)
        self.metric_capacity = 4 * self.capacity
        self.metric_points_dropped = 0
        self._metric_drops = None  # counter llm_otel.metric_points.dropped, once bound
        self.metric_account = MetricAccount(endpoint)
        # the exporter process reads its OTLP settings from the environment llm-otel's providers
        # were configured from, and imports the same llm_otel as this process
        self._env = {**os.environ, **(env or {})}
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in (_IMPORT_ROOT, self._env.get("PYTHONPATH", "")) if p)
        self._env["LLM_OTEL_EXPORT_PROCESS"] = "false"  # the exporter process exports itself
        _no_auto_instrumentation(self._env)
        self.attributes_dropped = 0  # span/metric attribute values pickle could not encode
        self.spans_unencodable = 0  # spans lost whole for that reason
        self.drops = DropCounter(endpoint)
        self._created_pid = os.getpid()
        self._disowned_pid: int | None = None
        from llm_otel.export.exporters import register

        register(self)  # disown_inherited() covers this buffer too
        self._start_state()

    def _start_state(self) -> None:
        self._pid = os.getpid()
        self._queue: deque = deque()
        self._mqueue: deque = deque()  # metric records (RemoteInstrument, push_request)
        # observations put into / taken out of _mqueue (a request record weighs what it may record):
        # the metric buffer is bounded in observations, whatever their records' sizes. One writer
        # each - the serving thread puts, the writer thread takes (under _lock) - and an int
        # attribute's += runs without a thread switch in CPython, so neither count loses an update
        self._mput = 0
        self._mtaken = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the pipe: one writer at a time (thread, flush)
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._instruments_to: subprocess.Popen | None = None  # the process told about the instruments
        self._reader: threading.Thread | None = None
        self._last_start = -float("inf")
        self._sent = 0  # records written to the current process
        self._acked = 0  # of which it reported exported or failed
        # metric points written to the current process / of which it reported exported to the
        # collector (its "metrics_exported" mark): the rest die with it, counted
        self._msent = 0
        self._mexported = 0
        self._death_logged = False  # one "ended" line per outage, until a process exports again
        self._replies: dict[int, tuple] = {}
        self._reply_cv = threading.Condition()
        self._token = 0
        self._closed = False
        # _ResourceMark objects put in _queue / taken out: one writer each (set_resource under
        # _start_lock, the drain under _lock), so neither count loses an update
        self._marks_put = 0
        self._marks_taken = 0
        self.failed = 0
        self.last_error: str | None = None
        self.drops.reset()

    def bind(self, meter_provider) -> None:
        """Count lost spans in ``llm_otel.spans.dropped`` and lost metric observations in
        ``llm_otel.metric_points.dropped`` of ``meter_provider``."""
        self.drops.bind(meter_provider)
        with guard(
            "export.offload.metric_drops",
            message="cannot create the metric drop counter; lost metric observations are not counted",
        ):
            self._metric_drops = meter_provider.get_meter("llm_otel").create_counter(
                M.LLM_OTEL_METRIC_POINTS_DROPPED,
                unit=M.LLM_OTEL_METRIC_POINTS_DROPPED_UNIT,
                description="GenAI metric observations this process could not hand to its exporter process.",
            )

    def push_metric(self, record: tuple, weight: int = 1) -> None:
        """One metric observation ``(instrument attribute, value, attributes, (trace_id, span_id,
        flags) or None)`` for the exporter process's instruments, or one finished request's GenAI
        observations ``("request", Instruments.observations(...), weight, ids)`` (:meth:`push_request`;
        ``weight``: the observations it may record at most); O(1), never blocks. While
        ``metric_capacity`` observations wait, a new record is lost and every point it held counted;
        once half of that waits, the writer thread is woken to send them."""
        if self._pid != _PID[0]:
            if self.disowned:
                return
            self._start_state()
        if self._closed:
            return
        waiting = self._mput - self._mtaken + weight
        if waiting > self.metric_capacity:
            self._lose_metrics(metric_points((record,)), BACKLOG)
            return
        self._mqueue.append(record)
        self._mput += weight
        if self._thread is None:
            self._start_thread()
        elif waiting > self.metric_capacity >> 1 and not self._wake.is_set():
            # half full: the writer sends now rather than at its next interval (as push does at _BATCH)
            self._wake.set()

    def push_request(self, observations: tuple, span_context) -> None:
        """The metrics outlet's (:attr:`Instruments.sink <llm_otel.telemetry.metrics.Instruments.sink>`): one finished
        request's GenAI observations (:meth:`~llm_otel.telemetry.metrics.Instruments.observations`)
        as one record; ``span_context`` is the request span's (None when it is not recording): its
        ids go along when it is sampled, as the SDK's ``trace_based`` exemplar filter keeps only
        sampled spans, and the exporter process's exemplars point at it. O(1), never blocks."""
        ids = None
        if span_context is not None and span_context.trace_flags.sampled and span_context.is_valid:
            ids = (span_context.trace_id, span_context.span_id, int(span_context.trace_flags))
        weight = REQUEST_POINTS + len(observations[5])  # at most: the fixed ones and one per ITL gap
        self.push_metric(("request", observations, weight, ids), weight)

    # --- the telemetry core's metrics outlet (llm_otel.telemetry.outlets.MetricsOutlet) -------------
    def declare_instruments(self, scope: tuple, itl_every: int, no_trace=None) -> None:
        """The exporter process creates the per-request instruments on a meter of ``scope`` (name,
        version, schema_url), with ``itl_every``: sent before the first metric record to each
        exporter process. ``no_trace``: the core's context of observations without an exemplar
        (:data:`llm_otel.telemetry.metrics.NO_TRACE`), which :class:`RemoteInstrument` need not look into."""
        self._instruments_init = ("instruments", *scope, itl_every)
        self._no_trace = no_trace

    def instrument(self, name: str) -> RemoteInstrument:
        """The stand-in for the core's instrument ``name`` (an attribute of
        :class:`~llm_otel.telemetry.metrics.Instruments`, or ``kv_size`` / ``slo_checks`` of
        :class:`~llm_otel.signals.Signals`): its observations are recorded by the exporter process."""
        return RemoteInstrument(self, name)

    def _lose_metrics(self, n: int, error_type: str) -> None:
        if n <= 0:
            return
        first = not self.metric_points_dropped
        self.metric_points_dropped += n
        self.metric_account.failed += 1
        counter = self._metric_drops
        if counter is not None:
            counter.add(n, {A.ERROR_TYPE: error_type})
        if first:
            logger.warning(
                "llm-otel: %d metric observation(s) could not be handed to the exporter process (%s); "
                "further losses are counted in llm_otel.metric_points.dropped",
                n,
                error_type,
            )

    def set_resource(self, attributes: dict, schema_url: str) -> None:
        """The serving process's resource changed (re-labelled): an exporter process started from
        now on gets it in its ``init`` frame; a running one gets a ``resource`` frame in order with
        the spans (those ended before keep the old resource). O(1), never blocks."""
        self._init = ("init", attributes, schema_url, self.capacity)
        if self._pid != os.getpid() or self._thread is None or self._closed:
            return  # a forked child's or a not yet started exporter process starts with the new init
        with self._start_lock:
            self._marks_put += 1  # before the mark is in the queue: the drain never batches it as a span
            self._queue.append(_ResourceMark(("resource", attributes, schema_url)))
        self._wake.set()

    @property
    def disowned(self) -> bool:
        return self._disowned_pid == os.getpid()

    @property
    def in_flight(self) -> int:
        queued = [r for r in list(self._queue) if type(r) is tuple]  # list(): one step, under the GIL
        return span_count(queued) + max(0, self._sent - self._acked)

    # --- caller side: O(1), never blocks --------------------------------------------------------
    def push(self, record: tuple, spans: int = 1) -> None:
        """One span record (:meth:`~llm_otel.export.offload.recorder.OffloadSpan.end`), or a tree
        record (:meth:`~llm_otel.export.offload.recorder.OffloadTracer.ship_children`:
        ``(None, spans, ...)``) from which the exporter process builds ``spans`` spans: one record
        either way, and a full buffer loses (and counts) all its spans."""
        if self._pid != _PID[0]:
            if self.disowned:
                return
            self._start_state()  # a forked child: its own buffer, thread and exporter process
        if self._closed:
            return
        queue = self._queue
        if len(queue) >= self.capacity:
            self._lose(spans, BACKLOG, "the exporter process falls behind")
            return
        queue.append(record)
        if self._thread is None:
            self._start_thread()
        elif len(queue) >= _BATCH:
            self._wake.set()

    def _start_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llm-otel-offload", daemon=True)
                self._thread.start()

    def _lose(self, n: int, error_type: str, why: str) -> None:
        if n <= 0:
            return
        self.failed += n
        self.last_error = why
        self.drops.failed(n, error_type, why)

    # --- writer thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread, which starts the exporter process at once
        (:func:`~llm_otel.export.offload.recorder.prewarm`;
        otherwise the first span or metric observation starts it)."""
        if self._pid == _PID[0] and self._thread is None and not self._closed:
            self._start_thread()

    def _run(self) -> None:
        with self._lock:
            if self._proc is None:
                self._process()
        while not self._closed:
            self._wake.wait(_INTERVAL_S)
            self._wake.clear()
            with guard("export.offload.writer"):  # the thread must survive anything
                self._drain()

    def _drain(self) -> bool:
        """Send everything buffered; True when it was all written."""
        with self._lock:
            return self._drain_locked()

    def _drain_locked(self) -> bool:
        mqueue = self._mqueue
        if mqueue and self._instruments_init is not None and self._instruments_to is not self._proc:
            # the instruments were declared after this exporter process started
            if self._send(self._instruments_init, 0):
                self._instruments_to = self._proc
        while mqueue:
            batch = [mqueue.popleft() for _ in range(min(4 * _BATCH, len(mqueue)))]
            self._mtaken += metric_weight(batch)
            points = metric_points(batch)
            if not self._send(("metrics", batch), 0):
                self._lose_metrics(points, DOWN)
                break
            self._msent += points
        queue = self._queue
        while queue:
            if self._marks_put != self._marks_taken:  # a re-label is queued: spans before it, it, spans after
                if type(queue[0]) is _ResourceMark:
                    self._marks_taken += 1
                    self._send(queue.popleft().frame, 0)  # not sent: a new process gets it in _init
                    continue
                batch = []
                while queue and len(batch) < _BATCH and type(queue[0]) is not _ResourceMark:
                    batch.append(queue.popleft())
            else:
                batch = [queue.popleft() for _ in range(min(_BATCH, len(queue)))]
            if not self._send(("spans", batch), span_count(batch)):
                return False
        return True

    def _send(self, frame: tuple, n: int) -> bool:
        """Write one frame (under ``_lock``); counts ``n`` spans lost when it cannot."""
        proc = self._process()
        if proc is None:
            self._lose(n, DOWN, self.last_error or "the exporter process is not running")
            return False
        try:
            try:
                data = encode(frame)
            except Exception:  # noqa: BLE001 - silent: a value pickle cannot take: lose that value, not the frame
                frame = self._encodable(frame)
                n = span_count(frame[1]) if frame[0] == "spans" else n
                data = encode(frame)
            stdin = _stdin(proc)
            stdin.write(data)
            stdin.flush()
        except (OSError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._process_died(why)
            self._lose(n, DOWN, self.last_error or why)
            return False
        except Exception as exc:  # noqa: BLE001 - an attribute value pickle cannot take
            self._lose(n, DOWN, f"cannot encode spans: {type(exc).__name__}: {exc}")
            return False
        self._sent += n
        return True

    def _encodable(self, frame: tuple) -> tuple:
        """``frame`` (``spans`` or ``metrics``) without what pickle cannot encode: each record that
        fails is cleaned as the SDK cleans attributes
        (:func:`~llm_otel.export.offload.frames.clean_attributes`: the invalid
        values are dropped and counted); a span that still fails is dropped and counted. One log
        line the first time."""
        kind, records = frame[0], frame[1]
        if kind not in ("spans", "metrics"):
            return frame
        out, dropped, lost = [], 0, 0
        for record in records:
            try:
                pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
                out.append(record)
                continue
            except Exception:  # noqa: BLE001 - silent: the record is cleaned below
                pass
            if kind == "spans" and record[0] is None:  # a tree record: plain values, cannot be cleaned
                lost += record[1]
                continue
            record, n = clean_record(kind, record)
            dropped += n
            try:
                pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
                out.append(record)
            except Exception:  # noqa: BLE001 - silent: e.g. an unpicklable span name or status description
                lost += 1 if kind == "spans" else metric_points((record,))
        first = not (self.attributes_dropped or self.spans_unencodable)
        self.attributes_dropped += dropped
        if kind == "spans" and lost:
            self.spans_unencodable += lost
            self._lose(lost, ENCODING, "span data pickle cannot encode")
        elif lost:
            self._lose_metrics(lost, ENCODING)
        if first and (dropped or lost):
            logger.warning(
                "llm-otel: %d attribute value(s) of types OpenTelemetry does not accept were dropped "
                "(and %d %s that could not be encoded at all); further ones are counted quietly",
                dropped,
                lost,
                "span(s)" if kind == "spans" else "metric observation(s)",
            )
        return (kind, out)

    def _process(self) -> subprocess.Popen | None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            self._process_died(f"exporter process exited with {proc.returncode}")
        now = time.monotonic()
        if now - self._last_start < self.respawn_s:
            return None
        self._last_start = now
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llm_otel.export.offload"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self._env,
                close_fds=True,
            )
            for frame in (self._init, self._instruments_init):
                if frame is not None:
                    _stdin(proc).write(encode(frame))
        except Exception as exc:  # noqa: BLE001
            self.last_error = f"cannot start the exporter process: {type(exc).__name__}: {exc}"
            process_errors().report(
                "export.offload.start",
                exc,
                "cannot start the exporter process; its spans are dropped and counted (llm_otel.spans.dropped)",
            )
            return None
        self._proc, self._sent, self._acked, self._msent, self._mexported = proc, 0, 0, 0, 0
        self._instruments_to = proc if self._instruments_init is not None else None
        self._reader = threading.Thread(target=self._read, args=(proc,), name="llm-otel-offload-status", daemon=True)
        self._reader.start()
        return proc

    def _process_died(self, why: str) -> None:
        """Spans the dead process had not reported are lost (counted once)."""
        if self._proc is None:
            return
        lost = max(0, self._sent - self._acked)
        mlost = max(0, self._msent - self._mexported)  # recorded there, not yet exported: gone with it
        self._proc, self._sent, self._acked, self._msent, self._mexported = None, 0, 0, 0, 0
        self.last_error = why
        self._lose_metrics(mlost, DOWN)
        if lost:
            self._lose(lost, DOWN, why)  # logged once per outage by the drop counter
        elif not self._death_logged:  # a process that keeps dying is one outage in the log, not a line a restart
            self._death_logged = True
            logger.warning(
                "llm-otel: the span exporter process ended (%s); a new one starts for the next spans "
                "(further restarts are not logged until one exports)",
                why,
            )

    def _read(self, proc: subprocess.Popen) -> None:
        """Status frames from the exporter process: spans exported / failed, flush answers."""
        stream = proc.stdout
        try:
            while True:
                frame = read_frame(stream)
                if frame is None:
                    return
                kind = frame[0]
                if kind == "metrics_failed":
                    self.metric_account.failed += frame[1]
                    self.metric_account.last_error = frame[2]
                elif kind == "metrics_exported" and proc is self._proc:
                    self._mexported = max(self._mexported, frame[1])
                elif kind == "status" and proc is self._proc:
                    _, exported, failed, error, error_type = frame
                    self._acked += exported + failed
                    if failed:
                        self.last_error = error
                        self.failed += failed
                        self.drops.failed(failed, error_type, error)
                    elif exported:
                        self._death_logged = False
                        self.drops.succeeded()
                elif kind == "flushed":
                    with self._reply_cv:
                        self._replies[frame[1]] = frame
                        self._reply_cv.notify_all()
        except (OSError, ValueError):
            pass  # the pipe closed under the read: the exporter process ended or was ended (a restart
            # or the final flush); its spans are accounted for by _process_died / the flush
        except Exception as exc:  # noqa: BLE001
            process_errors().report(
                "export.offload.status_reader",
                exc,
                "the exporter process's status reader "
                "stopped; its export outcomes are not counted until it is restarted",
            )
        finally:
            with self._reply_cv:
                self._reply_cv.notify_all()

    # --- flush / shutdown --------------------------------------------------------------------------
    def flush(self, timeout_s: float, final: bool) -> bool:
        """Send what is buffered and wait (at most ``timeout_s``) until the exporter process has
        exported it; ``final``: it then exits. True when everything was delivered in time."""
        if self._pid != os.getpid() or self.disowned:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        if final:
            self._closed = True
            self._wake.set()
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            # the writer thread is blocked in a write: the exporter process stopped reading (an
            # export to a collector that never answers); at the final flush it ends now, with the
            # deadline, instead of outliving this process by one export timeout per queued frame
            if final:
                self._end_process(self._proc, deadline, close_stdin=False)
            return False
        try:
            self._drain_locked()
            if self._proc is None or self._proc.poll() is not None:
                return not self._queue and self._sent == self._acked
            self._token += 1
            token = self._token
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            self._send(("flush", token, remaining_ms, final), 0)
            proc = self._proc
        finally:
            self._lock.release()
        ok = False
        with self._reply_cv:
            while time.monotonic() < deadline - (0.1 if final else 0.0):
                reply = self._replies.pop(token, None)
                if reply is not None:
                    ok = bool(reply[2])
                    break
                if proc is None or proc.poll() is not None:
                    break
                self._reply_cv.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        if final:
            self._end_process(proc, deadline, close_stdin=True)
        return ok and self.in_flight == 0

    @staticmethod
    def _end_process(proc: subprocess.Popen | None, deadline: float, close_stdin: bool) -> None:
        """End the exporter process with its serving process's deadline: what it still holds then
        is reported lost (``in_flight``) like the in-process batch processor's queue.
        ``close_stdin`` False when the writer thread may be blocked writing to it (closing would
        wait for that write)."""
        if proc is None:
            return
        try:
            if close_stdin:
                try:
                    _stdin(proc).close()
                except OSError:
                    pass
                proc.wait(max(0.0, min(_EXIT_WAIT_S, deadline - time.monotonic() - 0.05)))
            else:
                proc.kill()
        except subprocess.TimeoutExpired:
            proc.kill()
        except Exception:  # noqa: BLE001 - silent: already gone
            pass


class _ResourceMark:
    """A re-label in the span queue: its ``resource`` frame is sent between the spans around it."""

    __slots__ = ("frame",)

    def __init__(self, frame: tuple) -> None:
        self.frame = frame


class MetricAccount:
    """The exporter process's metric exports, for the lifecycle's exit line (a metric exporter's
    ``failed`` / ``in_flight`` / ``last_error`` / ``endpoint``): failed exports it reported and
    observations this process could not hand to it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.failed = 0
        self.in_flight = 0
        self.last_error: str | None = None


class RemoteInstrument:
    """Stands in for one SDK instrument in the serving process (:meth:`OffloadBuffer.instrument`):
    ``record``/``add(value, attributes, context)`` become one tuple in the buffer; the exporter
    process records it into the same instrument, with the request span's ids as context (so the
    exemplar points at it)."""

    __slots__ = ("_buffer", "_name")

    def __init__(self, buffer: OffloadBuffer, name: str) -> None:
        self._buffer = buffer
        self._name = name

    def record(self, amount, attributes=None, context=None) -> None:
        ids = None
        buffer = self._buffer
        if context is not None and context is not buffer._no_trace:  # noqa: SLF001 - no exemplar: nothing to look up
            last = buffer._exemplar_ids  # noqa: SLF001 - (context, ids) of the previous observation
            if last[0] is context:  # a finishing request records several instruments with one context
                ids = last[1]
            else:
                sc = trace_api.get_current_span(context).get_span_context()
                if sc.is_valid and sc.trace_flags.sampled:  # only sampled spans become exemplars
                    ids = (sc.trace_id, sc.span_id, int(sc.trace_flags))
                buffer._exemplar_ids = (context, ids)  # noqa: SLF001 - one tuple: read whole by any thread
        buffer.push_metric((self._name, amount, attributes, ids))

    add = record


def _no_auto_instrumentation(env: dict) -> None:
    """The exporter process must not instrument itself: drop opentelemetry-instrument's
    ``sitecustomize`` directory (``opentelemetry/instrumentation/auto_instrumentation``) from the
    ``PYTHONPATH`` it inherits (otherwise it would build providers, pollers and perhaps its own
    exporter process) and disable the SDK's automatic configuration there."""
    suffix = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not os.path.normpath(p).endswith(suffix)]
    env["PYTHONPATH"] = os.pathsep.join(kept)
    env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "*"  # were it imported anyway
