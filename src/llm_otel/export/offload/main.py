"""The exporter process (``python -m llm_otel.export.offload``): reads frames on stdin, exports
spans through the same stack as the in-process path and replays the per-request metrics, answers
with status frames on stdout (:mod:`~llm_otel.export.offload.frames`); see :func:`main`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque

from llm_otel.export.offload.frames import read_frame, span_count, write_frame
from llm_otel.export.offload.replay import ChildMetrics, expand_trees, readable_spans
from llm_otel.export.offload.writer import DEFAULT_DEADLINE_S

# spans sent in one export call: span frames waiting together are exported together (the batch
# span processor's OTEL_BSP_MAX_EXPORT_BATCH_SIZE default), so a collector that answers in
# milliseconds keeps up with any serving process
_EXPORT_BATCH = 512
_QUEUE_FULL = (
    "the exporter process's export queue is full ({waiting} span(s) wait for the collector; "
    "LLM_OTEL_EXPORT_PROCESS_BUFFER)"
)
# error.type of spans the exporter process could not queue: the exporter process fell behind, which
# is not a failed export (export_failed is reserved for batches the collector did not take)
BACKLOG = "export_process_backlog"


class _SpanExports:
    """The exporter process's export thread and its queue of ``spans`` frames, so that the reading
    loop never waits on the collector (``metrics``, ``resource`` and ``flush`` frames are read while
    an export retries). The queue is bounded in spans (``limit``: the serving process's
    ``LLM_OTEL_EXPORT_PROCESS_BUFFER``, so a burst that piled up while this process started fits),
    not in frames. Frames waiting together under one resource are exported in one call of at most
    :data:`_EXPORT_BATCH` spans. Every span put is reported exactly once in a ``status`` frame
    (``("status", exported, failed, last error, error.type)``): when its export ended, or at once
    when the queue is full (``export_process_backlog``). ``write``: serialized stdout writes."""

    def __init__(self, exporter, limits, write, limit: int) -> None:
        self._exporter = exporter
        self._limits = limits
        self._write = write
        self._limit = max(1, int(limit))
        self._jobs: deque = deque()  # (records, resource, spans)
        self._waiting = 0  # spans in _jobs
        self._busy = False
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="llm-otel-offload-export", daemon=True).start()

    def put(self, records: list, resource) -> None:
        """Queue one ``spans`` frame's records, exported under ``resource`` (the one current when
        the frame was read: ``resource`` frames go in order with the spans). When the frame does not
        fit the queue's span bound it is reported lost at once as ``export_process_backlog``
        (counted by the serving process): the frames queued first keep their order, and, as with the
        serving process's full buffer, what is lost is what came last."""
        n = span_count(records)
        with self._cv:
            if self._waiting + n <= self._limit or not self._jobs:
                self._jobs.append((records, resource, n))
                self._waiting += n
                self._cv.notify_all()
                return
            waiting = self._waiting
        why = _QUEUE_FULL.format(waiting=waiting)
        error = self._exporter.last_error
        self._write(("status", 0, n, f"{why}; last export error: {error}" if error else why, BACKLOG))

    def wait(self, deadline: float) -> bool:
        """Wait until every frame put so far was exported and reported, or ``deadline``
        (``time.monotonic()``); True when it was."""
        with self._cv:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _take(self) -> tuple[list, object, int]:
        """The next export: the first waiting frame and those after it under the same resource, up
        to :data:`_EXPORT_BATCH` spans (a frame is never split). Called under ``_cv``."""
        records, resource, n = self._jobs.popleft()
        records = list(records)
        while self._jobs and self._jobs[0][1] is resource and n + self._jobs[0][2] <= _EXPORT_BATCH:
            more, _, m = self._jobs.popleft()
            records.extend(more)
            n += m
        self._waiting -= n
        return records, resource, n

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        exporter = self._exporter
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                records, resource, n = self._take()
                self._busy = True
            try:
                records, lost = expand_trees(records)
                spans = readable_spans(records, resource, self._limits)
                before = exporter.failed
                try:
                    result = exporter.export(spans)
                except Exception as exc:  # noqa: BLE001 - silent: counted as failed, the thread goes on
                    exporter.last_error = f"{type(exc).__name__}: {exc}"
                    result = SpanExportResult.FAILURE
                failed = (
                    len(spans)
                    if result is not SpanExportResult.SUCCESS and exporter.failed == before
                    else exporter.failed - before
                )
                if lost:
                    exporter.last_error = "cannot build a request's spans in the exporter process"
                status = ("status", len(spans) - failed, failed + lost, exporter.last_error, "export_failed")
            except Exception as exc:  # noqa: BLE001 - silent: a frame that cannot be rebuilt is failed, reported
                exporter.last_error = f"cannot rebuild spans in the exporter process: {type(exc).__name__}: {exc}"
                status = ("status", 0, n, exporter.last_error, "export_failed")
            try:
                self._write(status)
            except (OSError, ValueError):
                pass  # the serving process went away; the reading loop ends on its own
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def main() -> int:
    """The exporter process: frames on stdin (``init``, then ``spans``, ``metrics``, ``resource``,
    ``instruments`` and ``flush``), status frames on stdout.

    The reading loop (main thread) never waits on the collector: it applies ``metrics``,
    ``resource`` and ``instruments`` frames at once and hands each ``spans`` frame (at most
    ``writer._BATCH`` spans) to :class:`_SpanExports`, whose thread exports it through
    :class:`~llm_otel.export.exporters.ProcessSpanExporter` (request size cap) and writes its
    ``status`` frame. While exports wait on a collector that is down or slow, at most
    ``LLM_OTEL_EXPORT_PROCESS_BUFFER`` spans wait here; a frame beyond that is reported lost at once
    (``export_process_backlog``) (so the serving process's
    acknowledgements, ``llm_otel.spans.dropped`` and ``in_flight`` stay exact) and GenAI request
    metrics keep being recorded, as the in-process meter provider keeps them through an outage.
    A ``flush`` frame is answered once every ``spans`` frame before it was reported (ok False when
    its ``timeout_ms`` ran out first) and the metrics were pushed. Stdout writes are serialized.
    Exits when stdin closes (queued frames get the flush deadline, ``LLM_OTEL_FLUSH_DEADLINE_S``)
    or after a final ``flush``; :func:`_exit_with_parent` bounds it when the serving process dies."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits

    from llm_otel.export.providers import metric_exporter_from_env, span_exporter_from_env

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the status pipe
    # the serving process logs drops once per outage and counts them in its own metrics
    logging.getLogger("llm_otel").setLevel(logging.ERROR)
    frame = read_frame(stdin)
    if frame is None or frame[0] != "init":
        return 2
    grace = _exit_with_parent(os.getppid())
    resource = Resource(frame[1], frame[2] or None)
    exporter = span_exporter_from_env(os.environ)
    if exporter is None:
        return 2
    write_lock = threading.Lock()

    def write(frame: tuple) -> None:  # the export thread writes status frames, this one the others
        with write_lock:
            write_frame(stdout, frame)

    exports = _SpanExports(exporter, SpanLimits(), write, frame[3])  # the serving process's buffer size
    # a Resource of its own: a re-label changes the meter provider's in place, and span frames
    # still queued for export keep the resource they were read with
    metrics = ChildMetrics(Resource(frame[1], frame[2] or None), write, lambda: metric_exporter_from_env(os.environ))
    try:
        while True:
            frame = read_frame(stdin)
            if frame is None:
                exports.wait(time.monotonic() + grace)  # stdin closed: what is queued gets the flush deadline
                break
            if frame[0] == "metrics":
                metrics.record(frame[1])
            elif frame[0] == "resource":  # the serving process was re-labelled
                resource = Resource(frame[1], frame[2] or None)
                metrics.set_resource(Resource(frame[1], frame[2] or None))
            elif frame[0] == "instruments":
                metrics.start(*frame[1:])
            elif frame[0] == "spans":
                exports.put(frame[1], resource)
            elif frame[0] == "flush":
                _, token, timeout_ms, final = frame
                deadline = time.monotonic() + max(1, timeout_ms) / 1000
                spans_done = exports.wait(deadline)  # every span frame before it reported
                failed = metrics.flush(max(1, int((deadline - time.monotonic()) * 1000)), final)
                if failed:
                    write(("metrics_failed", failed, metrics.last_error()))
                write(("flushed", token, spans_done and not failed))
                if final:
                    break
    except OSError:  # the serving process went away
        pass
    finally:
        try:
            exporter.shutdown()
            metrics.flush(2000, final=True)
        except Exception:  # noqa: BLE001 - silent: exit cleanup of the exporter process
            pass
    return 0


def _exit_with_parent(parent: int) -> float:
    """End this exporter process one flush deadline (``LLM_OTEL_FLUSH_DEADLINE_S``) after its
    serving process is gone; returns that deadline in seconds. Normally stdin's end stops it, but
    frames still queued are exported first, and with a collector that never answers each export
    waits its full timeout: without this an exporter process could outlive a killed server by one
    timeout per queued frame."""
    from llm_otel.config import Settings

    try:
        grace = Settings.from_env().flush_deadline_s
    except Exception:  # noqa: BLE001 - silent: the serving process reported the bad setting
        grace = DEFAULT_DEADLINE_S

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        time.sleep(grace)  # what is left in the pipe gets this long, as the serving process's flush did
        os._exit(0)

    threading.Thread(target=watch, name="llm-otel-offload-parent", daemon=True).start()
    return grace
