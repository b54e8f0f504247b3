"""Span export out of the serving process: light recording spans here, SDK spans and OTLP in a
separate exporter process (``LLM_OTEL_EXPORT_PROCESS``, default on for the process that builds
its providers with :func:`llm_otel.process.providers.build_providers` and exports over OTLP).

Why: in a vLLM frontend the OpenTelemetry SDK's span machinery (attribute validation, locks, span
processors) and the batch processor's OTLP protobuf encoding (about 80 us per span, in a thread
that competes with the frontend for the GIL) cost about a millisecond per traced request. The
same idea as SGLang's ``SGLANG_TRACE_ASYNC``: the serving process decides everything that other
processes depend on - trace and span ids (from :class:`~llm_otel.export.providers.SystemRandomIdGenerator`),
the sampling decision and its ``tracestate`` (``ot=th``), parents and links - and keeps a span's
data as plain tuples; each ended span becomes one compact record in a bounded buffer. A daemon
thread pickles batches of records to the exporter process's stdin; the exporter process
(``python -m llm_otel.export.offload``) rebuilds SDK :class:`~opentelemetry.sdk.trace.ReadableSpan`
objects with the same ids, times, resource and scope (attribute and event limits applied there, as
the SDK would have here) and exports them through the same stack as the in-process path
(``BatchSpanProcessor`` + :class:`~llm_otel.export.exporters.ProcessSpanExporter`: request size
cap, OTLP settings from the ``OTEL_EXPORTER_OTLP_*`` environment it inherits).

Guarantees:

* **Request children built there.** ``llm.prompt`` and ``llm.token_stream`` of a finished request
  go as one tree record (:meth:`OffloadTracer.ship_children`): ids and sampling decided here, the
  record's raw arrays; the exporter process runs the same
  :meth:`~llm_otel.telemetry.spans.SpanBuilder.children` on them (:func:`expand_trees`). A tree
  counts as its spans in the drop counters and the exporter process's acknowledgements.
* **Never blocks, bounded memory.** ``span.end()`` appends to a deque; when
  ``LLM_OTEL_EXPORT_PROCESS_BUFFER`` records (default 8192 spans) are waiting, new spans are
  dropped and counted in ``llm_otel.spans.dropped`` (``error.type=export_process_backlog``).
* **Exporter process death**: the spans of a batch that could not be written and those the dead
  process had not reported exported are counted (``error.type=export_process_down``), and so are
  the metric points it had recorded after the last export the collector accepted
  (``llm_otel.metric_points.dropped``; :class:`_ChildMetrics` reports each export's mark), one log line
  per outage (:class:`~llm_otel.export.drops.DropCounter`), and a new exporter process is started
  for the next batch (at most one start per ``_RESPAWN_S`` seconds; in between, spans are dropped
  and counted). Nothing is raised into the caller.
* **Export failures in the exporter process** (collector down) are reported back in its status
  frames and counted here, in this process's ``llm_otel.spans.dropped`` (``export_failed``) - the
  metric stays where the serving process's metrics are. The exporter process exports on a thread
  of its own behind a queue of a few frames (:func:`main`): a collector outage never stops it
  reading the pipe, so GenAI request metrics keep arriving and are aggregated through the outage,
  as in process; span frames the queue cannot take are reported failed at once.
* **Shutdown**: :meth:`OffloadTracerProvider.shutdown` (called by the lifecycle's final flush)
  sends what is buffered, asks the exporter process to flush and exit within the remaining
  deadline, and waits for its answer; spans it had not delivered are reported (``failed``,
  ``in_flight``) in the lifecycle's exit line.
* **Fork**: the buffer, thread and exporter process belong to the process that created them; in
  a forked child, spans go to a new buffer and exporter process of the child's own (the parent's
  pipe is never written), unless the child disowned the inherited exporters
  (:func:`llm_otel.export.exporters.disown_inherited`, vLLM engine processes): then they are
  dropped uncounted, as with the in-process exporters.
* **Start**: the exporter process starts with the first span or metric observation (under
  ``opentelemetry-instrument`` every Python process builds providers, most never make a span);
  :func:`prewarm` starts it at once where llm-otel knows the process serves requests (a vLLM
  frontend when it starts building ``LLMEngine``/``AsyncLLM``, LightLLM's HTTP worker), so that
  its start-up overlaps the server's; a process that merely has vLLM installed starts none. It runs
  without the auto-instrumentation ``sitecustomize`` its environment would otherwise carry.
* **Re-labels** (:func:`llm_otel.process.identity.relabel`, also after fork): a ``resource`` frame
  goes in order with the spans (spans ended before keep the old resource); the exporter process's
  meter provider is re-labelled in place, as the serving process's is; a forked child's own
  exporter process starts with the child's resource.
* **Values pickle cannot encode** (an object another instrumentation set as an attribute): that
  frame is encoded record by record and the values the SDK would reject are dropped and counted
  (``attributes_dropped``, one log line), not the frame; lists are copied when set, as the SDK does.

**Per-request metrics built there too** (:func:`offload_instruments`, when llm-otel built the meter
provider for OTLP): a finished request's GenAI observations go as one record
(:meth:`~llm_otel.telemetry.metrics.Instruments.observations`: values, attribute sets and the
request span's ids), and the exporter process records them with the same
:meth:`~llm_otel.telemetry.metrics.Instruments.apply` into the same instruments, the exemplar
context rebuilt from those ids. Other metrics (gauges, the drop counters, the application's own
meter provider) stay in the serving process.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Mapping, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from llm_otel.errors import guard, process_errors
from llm_otel.export.drops import DropCounter
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")

DEFAULT_BUFFER = 8192
_BATCH = 512            # records per frame
_INTERVAL_S = 0.2       # the writer sends at least this often when something is buffered
_RESPAWN_S = 5.0        # at most one exporter-process start per this many seconds
_HEADER = struct.Struct("!I")
# this process's pid, refreshed in a forked child: compared on every push (os.getpid() is a system
# call, and the hot path asks for it a dozen times per request)
_PID = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))
BACKLOG = "export_process_backlog"
DOWN = "export_process_down"
ENCODING = "export_process_encoding"  # the span's own data (not an attribute value) pickle cannot encode


# --- serving process: light spans -----------------------------------------------------------------
class OffloadSpan(trace_api.Span):
    """A recording span that keeps its data as plain Python values and, on :meth:`end`, hands
    one record to its provider's :class:`OffloadBuffer`. Attribute values are kept as given
    (validated by the SDK in the exporter process); a second ``end`` is ignored."""

    __slots__ = ("_name", "_context", "_parent", "_kind", "_attributes", "_events", "_links", "_status",
                 "_start", "_end", "_scope", "_buffer")

    def __init__(self, name, context, parent, kind, attributes, links, start, scope, buffer) -> None:
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = _copied(attributes) if attributes else {}
        self._events: list = []
        self._links = links
        self._status = (0, None)
        self._start = start
        self._end = None
        self._scope = scope
        self._buffer = buffer

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attributes(self, attributes) -> None:
        if self._end is None and attributes:
            # lists are copied now, as the SDK does (the caller may mutate its list afterwards)
            own = self._attributes
            for key, value in attributes.items():
                own[key] = tuple(value) if type(value) is list else value

    def set_attribute(self, key, value) -> None:
        if self._end is None:
            self._attributes[key] = tuple(value) if type(value) is list else value

    def add_event(self, name, attributes=None, timestamp=None) -> None:
        if self._end is None:
            self._events.append((name, attributes, timestamp if timestamp is not None else time.time_ns()))

    def add_link(self, context, attributes=None) -> None:
        if self._end is None and context is not None and context.is_valid:
            self._links = (*self._links, Link(context, attributes))

    def update_name(self, name) -> None:
        if self._end is None:
            self._name = name

    def set_status(self, status, description=None) -> None:
        if self._end is not None:
            return
        if isinstance(status, Status):
            code, description = status.status_code, status.description
        else:
            code = status
        if self._status[0] == StatusCode.OK.value:  # OK is final, as in the SDK
            return
        self._status = (code.value, description if code is StatusCode.ERROR else None)

    def record_exception(self, exception, attributes=None, timestamp=None, escaped=False) -> None:
        import traceback

        attrs = {"exception.type": type(exception).__qualname__, "exception.message": str(exception),
                 "exception.stacktrace": "".join(traceback.format_exception(exception)),
                 "exception.escaped": str(escaped)}
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time=None) -> None:
        if self._end is not None:
            return
        self._end = end_time if end_time is not None else time.time_ns()
        ctx, parent = self._context, self._parent
        if not ctx.trace_flags.sampled:  # recorded, not sampled (RECORD_ONLY): not exported, as in the SDK
            return
        self._buffer.push((
            self._name, ctx.trace_id, ctx.span_id, int(ctx.trace_flags), tuple(ctx.trace_state.items()),
            None if parent is None else (parent.trace_id, parent.span_id, parent.is_remote, int(parent.trace_flags),
                                         tuple(parent.trace_state.items())),
            # no new container for a span without events or links (most): fewer objects for the
            # garbage collector to traverse while the record waits for the writer
            self._kind.value, self._start, self._end, self._attributes, self._events or (),
            tuple([_link_record(link) for link in self._links]) if self._links else (), self._status, self._scope))

    def __enter__(self):
        return self


# the children SpanBuilder.children creates, in its order (llm.token_stream only after a token)
_CHILDREN = ("llm.prompt", "llm.token_stream")
_PROMPT_ONLY = _CHILDREN[:1]
# the Settings fields SpanBuilder.children reads
_TREE_SETTINGS = ("stall_factor", "token_events", "max_stall_events", "capture_content")


def _decides_children_alike(sampler) -> bool:
    """True for samplers whose decision for a child with a valid parent depends on the parent
    alone: the SDK's ``StaticSampler`` (always_on/off), ``ParentBased`` with its default
    delegates for parents (and its ``TraceIdRatio`` root variant), llm-otel's adaptive sampler
    (parent threshold for children)."""
    from opentelemetry.sdk.trace import sampling

    from llm_otel.sampling.sampler import _AdaptiveSampler

    if type(sampler) in (sampling.StaticSampler, _AdaptiveSampler):
        return True
    if type(sampler) in (sampling.ParentBased, sampling.ParentBasedTraceIdRatio):
        return all(type(getattr(sampler, name, None)) is sampling.StaticSampler for name in (
            "_remote_parent_sampled", "_remote_parent_not_sampled", "_local_parent_sampled",
            "_local_parent_not_sampled"))
    return False


def settings_fields(settings) -> tuple:
    """The :data:`_TREE_SETTINGS` values of ``settings`` (a tree record carries them)."""
    return tuple(getattr(settings, name) for name in _TREE_SETTINGS)


def _copied(attributes) -> dict:
    return {key: tuple(value) if type(value) is list else value for key, value in attributes.items()}


def _link_record(link: Link) -> tuple:
    c = link.context
    return (c.trace_id, c.span_id, c.is_remote, int(c.trace_flags), tuple(c.trace_state.items()),
            dict(link.attributes) if link.attributes else None)


class OffloadTracer(trace_api.Tracer):
    """Starts :class:`OffloadSpan` objects the way the SDK's ``Tracer.start_span`` starts spans
    (same id generator, sampler call, trace flags and ``tracestate``); unsampled spans are
    ``NonRecordingSpan`` with their real context, as in the SDK."""

    def __init__(self, provider: "OffloadTracerProvider", scope: tuple) -> None:
        self._provider = provider
        self._scope = scope
        self._settings: tuple = (None, ())  # (Settings, settings_fields of it) of the last tree shipped

    def start_span(self, name: str, context=None, kind: SpanKind = SpanKind.INTERNAL, attributes=None,
                   links=(), start_time=None, record_exception=True, set_status_on_exception=True):
        provider = self._provider
        links = links or ()
        parent = trace_api.get_current_span(context).get_span_context()
        ids = provider.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
        else:
            trace_id = parent.trace_id
        result = provider.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
        span_context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False,
                                   trace_flags=TraceFlags(flags), trace_state=result.trace_state)
        if not result.decision.is_recording() or provider.buffer is None:
            return trace_api.NonRecordingSpan(span_context)
        return OffloadSpan(name, span_context, parent, kind, result.attributes,
                           tuple(link for link in links if link.context is not None and link.context.is_valid),
                           start_time if start_time is not None else time.time_ns(), self._scope, provider.buffer)

    def ship_children(self, rec, end_ns: int, settings) -> bool:
        """Have the exporter process build ``rec``'s ``llm.prompt`` and ``llm.token_stream``
        (:meth:`llm_otel.telemetry.spans.SpanBuilder.children` runs there on the record's raw
        arrays): their span ids and sampling decisions are made here, now, in the order and with
        the calls :meth:`start_span` would make (the sampler sees the request span as parent; it
        gets no attributes - the ones it adds are kept). Returns False, having done nothing, when
        ``rec.span`` is not a recording span of this process's buffer (the caller builds the
        children itself). ``end_ns``: the request's end, epoch ns, >= arrival."""
        span = rec.span
        if type(span) is not OffloadSpan or span._end is not None or span._buffer is not self._provider.buffer:
            return False
        provider = self._provider
        parent = span._context
        trace_id = parent.trace_id
        context = trace_api.set_span_in_context(span)
        sampler, ids = provider.sampler, provider.id_generator
        children = []
        result = None
        for name in _CHILDREN if rec.step_times else _PROMPT_ONLY:
            if result is None or not provider.children_decide_alike:
                result = sampler.should_sample(context, trace_id, name, SpanKind.INTERNAL, None, ())
                decision = (tuple(result.trace_state.items()) if result.trace_state else (),
                            dict(result.attributes) if result.attributes else None)
            span_id = ids.generate_span_id()
            if result.decision.is_sampled():  # recording but not sampled: not exported, as in start_span
                children.append((name, span_id, *decision))
        if children:
            if settings is not self._settings[0]:
                self._settings = (settings, settings_fields(settings))
            span._buffer.push((
                None, len(children), self._scope,
                (trace_id, parent.span_id, False, int(parent.trace_flags), tuple(parent.trace_state.items())),
                tuple(children), end_ns, self._settings[1], rec.span_fields(settings.capture_content)), len(children))
        return True

    def start_as_current_span(self, name, context=None, kind=SpanKind.INTERNAL, attributes=None, links=(),
                              start_time=None, record_exception=True, set_status_on_exception=True,
                              end_on_exit=True):
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return trace_api.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                  set_status_on_exception=set_status_on_exception)


class OffloadTracerProvider(trace_api.TracerProvider):
    """Tracer provider of the serving process when spans are exported by an exporter process.

    Args:
        resource: the SDK ``Resource`` of this process (sent to the exporter process once).
        sampler: the SDK sampler (``should_sample``; llm-otel's adaptive sampler by default).
        id_generator: trace and span ids (:class:`SystemRandomIdGenerator`).
        endpoint: the OTLP endpoint, for log lines.
        buffer_size: spans that may wait for the exporter process (``LLM_OTEL_EXPORT_PROCESS_BUFFER``).
        env: the environment the exporter process is started with (its OTLP settings).
    """

    def __init__(self, resource, sampler, id_generator, endpoint: str = "", buffer_size: int = DEFAULT_BUFFER,
                 env: Mapping[str, str] | None = None) -> None:
        self.resource = resource
        self.sampler = sampler
        self.id_generator = id_generator
        # the sampler decides a child of a given parent the same whatever its name and attributes
        # (parent-based: the SDK's static and parent-based samplers, llm-otel's): one call serves
        # both children of a request (OffloadTracer.ship_children); any other sampler is asked per child
        self.children_decide_alike = _decides_children_alike(sampler)
        # started lazily, with the first span; prewarm() starts it now where llm-otel knows this
        # is a serving frontend (under opentelemetry-instrument every Python process builds one)
        self.buffer: OffloadBuffer | None = OffloadBuffer(dict(resource.attributes), resource.schema_url or "",
                                                          endpoint, buffer_size, env)

    def resource_changed(self) -> None:
        """This provider's resource was re-labelled (:func:`llm_otel.process.identity.relabel`,
        also after fork): spans ended from now on are exported under it (and the exporter
        process's GenAI metrics). Never raises."""
        buffer = self.buffer
        if buffer is not None:
            buffer.set_resource(dict(self.resource.attributes), self.resource.schema_url or "")

    def get_tracer(self, instrumenting_module_name, instrumenting_library_version=None, schema_url=None,
                   attributes=None):
        return OffloadTracer(self, (instrumenting_module_name or "", instrumenting_library_version or "",
                                    schema_url or "", dict(attributes) if attributes else None))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        buffer = self.buffer
        return True if buffer is None else buffer.flush(timeout_millis / 1000, final=False)

    def shutdown(self, timeout_millis: int | None = None) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            from llm_otel.export.exporters import DEFAULT_DEADLINE_S

            buffer.flush(timeout_millis / 1000 if timeout_millis is not None else DEFAULT_DEADLINE_S, final=True)


class OffloadBuffer:
    """The bounded buffer, writer thread and exporter process of one serving process.

    Counts for the lifecycle's exit line (the attributes of a span exporter it reads): ``failed``
    (spans lost), ``in_flight`` (spans buffered or sent and not yet reported exported),
    ``last_error``, ``endpoint``, ``max_request_bytes`` (marks it as a span exporter)."""

    def __init__(self, resource_attributes: dict, schema_url: str, endpoint: str, capacity: int,
                 env: Mapping[str, str] | None) -> None:
        self.endpoint = endpoint
        self.capacity = max(1, int(capacity))
        self.respawn_s = _RESPAWN_S
        self.max_request_bytes = 0
        self._init = ("init", resource_attributes, schema_url)
        self._instruments_init: tuple | None = None  # set by offload_instruments()
        self._exemplar_ids: tuple = (None, None)  # _RemoteInstrument's last (context, exemplar ids)
        self.metric_capacity = 4 * self.capacity
        self.metric_points_dropped = 0
        self._metric_drops = None     # counter llm_otel.metric_points.dropped, once bound
        self.metric_account = MetricAccount(endpoint)
        # the exporter process reads its OTLP settings from the environment llm-otel's providers
        # were configured from, and imports the same llm_otel as this process
        self._env = {**os.environ, **(env or {})}
        import llm_otel

        root = os.path.dirname(os.path.dirname(os.path.abspath(llm_otel.__file__)))
        self._env["PYTHONPATH"] = os.pathsep.join(p for p in (root, self._env.get("PYTHONPATH", "")) if p)
        self._env["LLM_OTEL_EXPORT_PROCESS"] = "false"  # the exporter process exports itself
        _no_auto_instrumentation(self._env)
        self.attributes_dropped = 0   # span/metric attribute values pickle could not encode
        self.spans_unencodable = 0    # spans lost whole for that reason
        self.drops = DropCounter(endpoint)
        self._created_pid = os.getpid()
        self._disowned_pid: int | None = None
        from llm_otel.export import exporters

        exporters._EXPORTERS.add(self)  # noqa: SLF001 - disown_inherited() covers this buffer too
        self._start_state()

    def _start_state(self) -> None:
        self._pid = os.getpid()
        self._queue: deque = deque()
        self._mqueue: deque = deque()      # metric records (offload_instruments)
        # observations put into / taken out of _mqueue (a request record weighs what it may record):
        # the metric buffer is bounded in observations, whatever their records' sizes. One writer
        # each - the serving thread puts, the writer thread takes (under _lock) - and an int
        # attribute's += runs without a thread switch in CPython, so neither count loses an update
        self._mput = 0
        self._mtaken = 0
        self._wake = threading.Event()
        self._lock = threading.Lock()      # the pipe: one writer at a time (thread, flush)
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._instruments_to: subprocess.Popen | None = None  # the process told about the instruments
        self._reader: threading.Thread | None = None
        self._last_start = -float("inf")
        self._sent = 0                     # records written to the current process
        self._acked = 0                    # of which it reported exported or failed
        # metric points written to the current process / of which it reported exported to the
        # collector (its "metrics_exported" mark): the rest die with it, counted
        self._msent = 0
        self._mexported = 0
        self._death_logged = False         # one "ended" line per outage, until a process exports again
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
        with guard("export.offload.metric_drops",
                   message="cannot create the metric drop counter; lost metric observations are not counted"):
            self._metric_drops = meter_provider.get_meter("llm_otel").create_counter(
                M.LLM_OTEL_METRIC_POINTS_DROPPED, unit=M.LLM_OTEL_METRIC_POINTS_DROPPED_UNIT,
                description="GenAI metric observations this process could not hand to its exporter process.")

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
            self._lose_metrics(_metric_points((record,)), BACKLOG)
            return
        self._mqueue.append(record)
        self._mput += weight
        if self._thread is None:
            self._start_thread()
        elif waiting > self.metric_capacity >> 1 and not self._wake.is_set():
            # half full: the writer sends now rather than at its next interval (as push does at _BATCH)
            self._wake.set()

    def push_request(self, observations: tuple, span_context) -> None:
        """:attr:`Instruments.sink <llm_otel.telemetry.metrics.Instruments.sink>`: one finished
        request's GenAI observations (:meth:`~llm_otel.telemetry.metrics.Instruments.observations`)
        as one record; ``span_context`` is the request span's (None when it is not recording): its
        ids go along when it is sampled, as the SDK's ``trace_based`` exemplar filter keeps only
        sampled spans, and the exporter process's exemplars point at it. O(1), never blocks."""
        ids = None
        if span_context is not None and span_context.trace_flags.sampled and span_context.is_valid:
            ids = (span_context.trace_id, span_context.span_id, int(span_context.trace_flags))
        weight = _REQUEST_POINTS + len(observations[5])  # at most: the fixed ones and one per ITL gap
        self.push_metric(("request", observations, weight, ids), weight)

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
            logger.warning("llm-otel: %d metric observation(s) could not be handed to the exporter process (%s); "
                           "further losses are counted in llm_otel.metric_points.dropped", n, error_type)

    def set_resource(self, attributes: dict, schema_url: str) -> None:
        """The serving process's resource changed (re-labelled): an exporter process started from
        now on gets it in its ``init`` frame; a running one gets a ``resource`` frame in order with
        the spans (those ended before keep the old resource). O(1), never blocks."""
        self._init = ("init", attributes, schema_url)
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
        return _span_count(queued) + max(0, self._sent - self._acked)

    # --- caller side: O(1), never blocks --------------------------------------------------------
    def push(self, record: tuple, spans: int = 1) -> None:
        """One span record (:meth:`OffloadSpan.end`), or a tree record
        (:meth:`OffloadTracer.ship_children`: ``(None, spans, ...)``) from which the exporter
        process builds ``spans`` spans: one record either way, and a full buffer loses (and
        counts) all its spans."""
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
        """Start the writer thread, which starts the exporter process at once (:func:`prewarm`;
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
            self._mtaken += _metric_weight(batch)
            points = _metric_points(batch)
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
            if not self._send(("spans", batch), _span_count(batch)):
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
                data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - silent: a value pickle cannot take: lose that value, not the frame
                frame = self._encodable(frame)
                n = _span_count(frame[1]) if frame[0] == "spans" else n
                data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.write(_HEADER.pack(len(data)) + data)
            proc.stdin.flush()
        except (OSError, ValueError) as exc:
            self._process_died(f"{type(exc).__name__}: {exc}")
            self._lose(n, DOWN, self.last_error)
            return False
        except Exception as exc:  # noqa: BLE001 - an attribute value pickle cannot take
            self._lose(n, DOWN, f"cannot encode spans: {type(exc).__name__}: {exc}")
            return False
        self._sent += n
        return True

    def _encodable(self, frame: tuple) -> tuple:
        """``frame`` (``spans`` or ``metrics``) without what pickle cannot encode: each record that
        fails is cleaned as the SDK cleans attributes (:func:`clean_attributes`: the invalid
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
            record, n = _clean_record(kind, record)
            dropped += n
            try:
                pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
                out.append(record)
            except Exception:  # noqa: BLE001 - silent: e.g. an unpicklable span name or status description
                lost += 1 if kind == "spans" else _metric_points((record,))
        first = not (self.attributes_dropped or self.spans_unencodable)
        self.attributes_dropped += dropped
        if kind == "spans" and lost:
            self.spans_unencodable += lost
            self._lose(lost, ENCODING, "span data pickle cannot encode")
        elif lost:
            self._lose_metrics(lost, ENCODING)
        if first and (dropped or lost):
            logger.warning("llm-otel: %d attribute value(s) of types OpenTelemetry does not accept were dropped "
                           "(and %d %s that could not be encoded at all); further ones are counted quietly",
                           dropped, lost, "span(s)" if kind == "spans" else "metric observation(s)")
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
            proc = subprocess.Popen([sys.executable, "-m", "llm_otel.export.offload"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=self._env, close_fds=True)
            for frame in (self._init, self._instruments_init):
                if frame is not None:
                    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
                    proc.stdin.write(_HEADER.pack(len(data)) + data)
        except Exception as exc:  # noqa: BLE001
            self.last_error = f"cannot start the exporter process: {type(exc).__name__}: {exc}"
            process_errors().report("export.offload.start", exc, "cannot start the exporter process; its spans "
                                    "are dropped and counted (llm_otel.spans.dropped)")
            return None
        self._proc, self._sent, self._acked, self._msent, self._mexported = proc, 0, 0, 0, 0
        self._instruments_to = proc if self._instruments_init is not None else None
        self._reader = threading.Thread(target=self._read, args=(proc,), name="llm-otel-offload-status",
                                        daemon=True)
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
            logger.warning("llm-otel: the span exporter process ended (%s); a new one starts for the next spans "
                           "(further restarts are not logged until one exports)", why)

    def _read(self, proc: subprocess.Popen) -> None:
        """Status frames from the exporter process: spans exported / failed, flush answers."""
        stream = proc.stdout
        try:
            while True:
                frame = _read_frame(stream)
                if frame is None:
                    return
                kind = frame[0]
                if kind == "metrics_failed":
                    self.metric_account.failed += frame[1]
                    self.metric_account.last_error = frame[2]
                elif kind == "metrics_exported" and proc is self._proc:
                    self._mexported = max(self._mexported, frame[1])
                elif kind == "status" and proc is self._proc:
                    _, exported, failed, error = frame
                    self._acked += exported + failed
                    if failed:
                        self.last_error = error
                        self.failed += failed
                        self.drops.failed(failed, "export_failed", error)
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
            process_errors().report("export.offload.status_reader", exc, "the exporter process's status reader "
                                    "stopped; its export outcomes are not counted until it is restarted")
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
                    proc.stdin.close()
                except OSError:
                    pass
                proc.wait(max(0.0, min(0.5, deadline - time.monotonic() - 0.05)))
            else:
                proc.kill()
        except subprocess.TimeoutExpired:
            proc.kill()
        except Exception:  # noqa: BLE001 - silent: already gone
            pass


# the observations of one finished request besides its ITL gaps, at most: duration, TTFT, TPOT,
# output token rate, the request count, queue time, input and output tokens (Instruments.apply)
_REQUEST_POINTS = 8


def _metric_weight(records) -> int:
    """The buffer weight of a batch of metric records (:meth:`OffloadBuffer.push_metric`)."""
    n = 0
    for record in records:
        n += record[2] if record[0] == "request" else 1
    return n


def _metric_points(records) -> int:
    """Metric points in a batch of metric records: one per observation, :meth:`Instruments.points
    <llm_otel.telemetry.metrics.Instruments.points>` per request record (asked per batch written
    and per batch applied, for the exporter process's export marks, and for what is lost)."""
    from llm_otel.telemetry.metrics import Instruments  # once per batch, not per record

    points = Instruments.points
    n = 0
    for record in records:
        n += points(record[1]) if record[0] == "request" else 1
    return n


def _span_count(records) -> int:
    """Spans in a batch of span records and tree records (``(None, spans, ...)``)."""
    n = len(records)
    for record in records:
        if record[0] is None:
            n += record[1] - 1
    return n


class _ResourceMark:
    """A re-label in the span queue: its ``resource`` frame is sent between the spans around it."""

    __slots__ = ("frame",)

    def __init__(self, frame: tuple) -> None:
        self.frame = frame


def prewarm(tracer_provider) -> bool:
    """Start the exporter process of ``tracer_provider`` now when it is an
    :class:`OffloadTracerProvider` (else nothing; True when it is): for a process llm-otel knows
    serves requests (a vLLM API server, LightLLM's HTTP worker), so that the exporter process's
    start-up (about a second of CPU) overlaps the server's own start-up rather than its first
    requests or an early shutdown. Other processes start theirs with their first span. Never raises."""
    buffer = getattr(tracer_provider, "buffer", None)
    if not isinstance(buffer, OffloadBuffer):
        return False
    with guard("export.offload.prewarm", message="cannot prewarm the exporter process; the first span starts it"):
        buffer.start()
    return True


def _no_auto_instrumentation(env: dict) -> None:
    """The exporter process must not instrument itself: drop opentelemetry-instrument's
    ``sitecustomize`` directory (``opentelemetry/instrumentation/auto_instrumentation``) from the
    ``PYTHONPATH`` it inherits (otherwise it would build providers, pollers and perhaps its own
    exporter process) and disable the SDK's automatic configuration there."""
    suffix = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not os.path.normpath(p).endswith(suffix)]
    env["PYTHONPATH"] = os.pathsep.join(kept)
    env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "*"  # were it imported anyway


_VALID = (str, bool, int, float)


def _clean_value(value):
    """An attribute value as the SDK accepts it (``opentelemetry.attributes._clean_attribute``:
    str/bool/int/float, or a homogeneous sequence of them with None allowed), numpy-style scalars
    converted with ``.item()``; ``_INVALID`` when it is none of these."""
    if isinstance(value, _VALID):
        return value
    if isinstance(value, (list, tuple)):
        out, kind = [], None
        for item in value:
            if item is not None:
                item = _clean_value(item)
                if item is _INVALID or isinstance(item, tuple) or (kind is not None and type(item) is not kind):
                    return _INVALID
                kind = type(item)
            out.append(item)
        return tuple(out)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        try:
            value = item()
        except Exception:  # noqa: BLE001 - silent: counted as a dropped attribute by the caller
            return _INVALID
        return value if isinstance(value, _VALID) else _INVALID
    return _INVALID


_INVALID = object()


def clean_attributes(attributes) -> tuple[dict | None, int]:
    """``attributes`` with only values the SDK accepts (see :func:`_clean_value`); (dict, number of
    values dropped). Keys that are not str are dropped too."""
    if not attributes:
        return attributes, 0
    out, dropped = {}, 0
    for key, value in attributes.items():
        value = _clean_value(value)
        if value is _INVALID or not isinstance(key, str):
            dropped += 1
        else:
            out[key] = value
    return out, dropped


def _clean_record(kind: str, record: tuple) -> tuple[tuple, int]:
    """A span record (see :meth:`OffloadSpan.end`) or metric record (``push_metric``) with its
    attributes, event and link attributes cleaned; (record, values dropped)."""
    if kind == "metrics":
        if record[0] == "request":  # a request's observations: its four attribute sets
            sets, n = [], 0
            for attributes in record[1][0]:
                attributes, k = clean_attributes(attributes)
                sets.append(attributes)
                n += k
            return (record[0], (tuple(sets), *record[1][1:]), record[2], record[3]), n
        attributes, n = clean_attributes(record[2])
        return (record[0], record[1], attributes, record[3]), n
    fields = list(record)
    fields[9], n = clean_attributes(fields[9])
    events = []
    for name, attributes, ts in fields[10]:
        attributes, k = clean_attributes(attributes)
        n += k
        events.append((name, attributes, ts))
    fields[10] = events
    links = []
    for link in fields[11]:
        attributes, k = clean_attributes(link[5])
        n += k
        links.append((*link[:5], attributes))
    fields[11] = links
    return tuple(fields), n


class MetricAccount:
    """The exporter process's metric exports, for the lifecycle's exit line (a metric exporter's
    ``failed`` / ``in_flight`` / ``last_error`` / ``endpoint``): failed exports it reported and
    observations this process could not hand to it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.failed = 0
        self.in_flight = 0
        self.last_error: str | None = None


# GenAI request instruments of :class:`llm_otel.telemetry.metrics.Instruments` recorded in the
# exporter process: the ones every finished request records (attribute name -> "record"/"add")
OFFLOADED_INSTRUMENTS = {"duration": "record", "ttft": "record", "tpot": "record", "itl": "record",
                         "token_rate": "record", "queue": "record", "tokens": "record", "requests": "add"}
# the per-request instruments of :class:`llm_otel.signals.Signals` (two KV-size observations and
# the SLO checks of every request): in-process SDK records of these cost the frontend more per
# request than the tuple each becomes
OFFLOADED_SIGNAL_INSTRUMENTS = {"kv_size": "record", "slo_checks": "add"}
_OFFLOADED_KIND = {**OFFLOADED_INSTRUMENTS, **OFFLOADED_SIGNAL_INSTRUMENTS}


# llm_otel.telemetry.metrics._NO_TRACE (the context of observations without an exemplar), bound by
# offload_instruments (importing it here would import the telemetry package into every exporter process)
_NO_TRACE: list = [None]


class _RemoteInstrument:
    """Stands in for one SDK instrument in the serving process: ``record``/``add(value,
    attributes, context)`` become one tuple in the buffer; the exporter process records it into
    the same instrument, with the request span's ids as context (so the exemplar points at it)."""

    __slots__ = ("_buffer", "_name")

    def __init__(self, buffer: OffloadBuffer, name: str) -> None:
        self._buffer = buffer
        self._name = name

    def record(self, amount, attributes=None, context=None) -> None:
        ids = None
        if context is not None and context is not _NO_TRACE[0]:  # _NO_TRACE: no exemplar, nothing to look up
            buffer = self._buffer
            last = buffer._exemplar_ids  # noqa: SLF001 - (context, ids) of the previous observation
            if last[0] is context:  # a finishing request records several instruments with one context
                ids = last[1]
            else:
                sc = trace_api.get_current_span(context).get_span_context()
                if sc.is_valid and sc.trace_flags.sampled:  # only sampled spans become exemplars
                    ids = (sc.trace_id, sc.span_id, int(sc.trace_flags))
                buffer._exemplar_ids = (context, ids)  # noqa: SLF001 - one tuple: read whole by any thread
        self._buffer.push_metric((self._name, amount, attributes, ids))

    add = record


def offload_instruments(instruments, tracer_provider, meter_provider, scope: tuple, signals=None) -> bool:
    """Have the exporter process record ``instruments``' per-request GenAI metrics (and, given
    ``signals``, a :class:`llm_otel.signals.Signals` on the same meter, its KV-size and SLO-check
    observations) when ``tracer_provider`` is an :class:`OffloadTracerProvider` built together with
    ``meter_provider`` for OTLP metric export (``build_providers``); returns True when it does.
    Otherwise (the application's own providers, Prometheus, console) nothing changes.
    ``scope``: (name, version, schema_url) of the meter, so that the points keep their scope."""
    buffer = getattr(tracer_provider, "buffer", None)
    if not isinstance(buffer, OffloadBuffer) or getattr(tracer_provider, "metrics_with", None) is not meter_provider:
        return False
    from llm_otel.telemetry.metrics import _NO_TRACE as no_trace

    _NO_TRACE[0] = no_trace
    buffer._instruments_init = ("instruments", *scope, instruments.itl_every)  # noqa: SLF001
    for name in OFFLOADED_INSTRUMENTS:  # rejected requests (Instruments.record_rejected)
        setattr(instruments, name, _RemoteInstrument(buffer, name))
    instruments.sink = buffer.push_request  # finished requests: one record each
    if signals is not None:
        for name in OFFLOADED_SIGNAL_INSTRUMENTS:
            setattr(signals, name, _RemoteInstrument(buffer, name))
    return True


def _read_frame(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _write_frame(stream, frame) -> None:
    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


# --- exporter process -----------------------------------------------------------------------------
def _context(trace_id, span_id, is_remote, flags, state) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=is_remote, trace_flags=TraceFlags(flags),
                       trace_state=TraceState(list(state)))


class _SpanSink:
    """Collects the span records :class:`OffloadSpan` objects push on ``end`` (exporter process)."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list = []

    def push(self, record: tuple) -> None:
        self.records.append(record)


class _ChildTracer:
    """The tracer :meth:`SpanBuilder.children` gets in the exporter process: each span it starts
    gets the id, ``tracestate`` and sampler attributes the serving process decided for that name
    (:meth:`OffloadTracer.ship_children`), the request span as parent, and the request tracer's
    scope; a name the serving process did not sample starts a non-recording span."""

    def __init__(self, scope: tuple, parent: tuple, children: tuple, sink: _SpanSink) -> None:
        self._scope = scope
        self._parent = _context(*parent)
        self._children = {name: (span_id, state, extra) for name, span_id, state, extra in children}
        self._sink = sink

    def start_span(self, name, context=None, kind=SpanKind.INTERNAL, attributes=None, links=(), start_time=None,
                   record_exception=True, set_status_on_exception=True):
        child = self._children.get(name)
        if child is None:
            return trace_api.INVALID_SPAN
        span_id, state, extra = child
        if extra:  # what the sampler adds to the span's own attributes (as _AdaptiveSampler merges them)
            attributes = {**(attributes or {}), **extra}
        parent = self._parent
        context = SpanContext(parent.trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED),
                              trace_state=TraceState(list(state)))
        return OffloadSpan(name, context, parent, kind, attributes, (),
                           start_time if start_time is not None else time.time_ns(), self._scope, self._sink)


def expand_trees(records: Sequence[tuple]) -> tuple[list, int]:
    """Span records with every tree record (:meth:`OffloadTracer.ship_children`) replaced by the
    ``llm.prompt`` / ``llm.token_stream`` span records :class:`~llm_otel.telemetry.spans.SpanBuilder`
    builds from it - the same code and values as in the serving process. Returns (records, spans
    lost): a tree that cannot be built (logged once) loses the spans it announced."""
    if not any(record[0] is None for record in records):
        return list(records), 0
    from types import SimpleNamespace

    from llm_otel.telemetry.record import RequestRecord
    from llm_otel.telemetry.spans import SpanBuilder

    out, lost = [], 0
    for record in records:
        if record[0] is not None:
            out.append(record)
            continue
        _, n, scope, parent, children, end_ns, settings, fields = record
        sink = _SpanSink()
        try:
            builder = SpanBuilder(_ChildTracer(scope, parent, children, sink),
                                  SimpleNamespace(**dict(zip(_TREE_SETTINGS, settings))))
            builder.children(RequestRecord.from_span_fields(fields), None, end_ns)
        except Exception as exc:  # noqa: BLE001 - a bad record loses its spans, not the batch
            process_errors().report("export.offload.tree", exc, "cannot build a request's spans in the exporter "
                                    "process; that request's spans are lost and counted")
            sink.records = []
        out.extend(sink.records)
        lost += max(0, n - len(sink.records))
    return out, lost


def readable_spans(records: Sequence[tuple], resource, limits) -> list:
    """SDK ``ReadableSpan`` objects from :class:`OffloadSpan` records, with the SDK's attribute,
    event and link limits (``OTEL_SPAN_*_LIMIT``) applied as its ``_Span`` would."""
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util import BoundedList
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    scopes: dict = {}
    out = []
    for (name, trace_id, span_id, flags, state, parent, kind, start, end, attributes, events, links, status,
         scope) in records:
        inst = scopes.get(scope)
        if inst is None:
            inst = scopes[scope] = InstrumentationScope(scope[0], scope[1] or None, scope[2] or None,
                                                        scope[3])
        bounded_events = BoundedList(limits.max_events)
        for ev_name, ev_attrs, ts in events:
            bounded_events.append(Event(ev_name, BoundedAttributes(
                limits.max_event_attributes, ev_attrs, immutable=True,
                max_value_len=limits.max_attribute_length), ts))
        bounded_links = BoundedList(limits.max_links)
        for l_trace, l_span, l_remote, l_flags, l_state, l_attrs in links:
            bounded_links.append(Link(_context(l_trace, l_span, l_remote, l_flags, l_state), BoundedAttributes(
                limits.max_link_attributes, l_attrs, immutable=True, max_value_len=limits.max_attribute_length)))
        span = ReadableSpan(
            name=name, context=_context(trace_id, span_id, False, flags, state),
            parent=None if parent is None else _context(*parent), resource=resource,
            attributes=BoundedAttributes(limits.max_span_attributes, attributes, immutable=False,
                                         max_value_len=limits.max_attribute_length),
            events=bounded_events, links=bounded_links, kind=SpanKind(kind),
            status=Status(StatusCode(status[0]), status[1]), start_time=start, end_time=end,
            instrumentation_scope=inst)
        out.append(span)
    return out


# span frames (each at most _BATCH records) the exporter process holds waiting for its export
# thread; one more may be in export. Its only holding besides the SDK's: bounded.
_EXPORT_QUEUE = 4
_QUEUE_FULL = "the collector does not keep up: the exporter process's span export queue is full"


class _SpanExports:
    """The exporter process's export thread and its bounded queue of ``spans`` frames, so that the
    reading loop never waits on the collector (``metrics``, ``resource`` and ``flush`` frames are
    read while an export retries). Every ``spans`` frame gets exactly one ``status`` frame: when
    exported (or failed), or at once when the queue is full. ``write``: serialized stdout writes."""

    def __init__(self, exporter, limits, write) -> None:
        self._exporter = exporter
        self._limits = limits
        self._write = write
        self._jobs: deque = deque()
        self._busy = False
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="llm-otel-offload-export", daemon=True).start()

    def put(self, records: list, resource) -> None:
        """Queue one ``spans`` frame's records, exported under ``resource`` (the one current when
        the frame was read: ``resource`` frames go in order with the spans). When ``_EXPORT_QUEUE``
        frames wait, this newest one is reported failed at once (its spans counted ``export_failed``
        by the serving process): the frames queued first keep their order, and, as with the
        serving process's full buffer, what is lost is what came last."""
        with self._cv:
            if len(self._jobs) < _EXPORT_QUEUE:
                self._jobs.append((records, resource))
                self._cv.notify_all()
                return
        error = self._exporter.last_error
        self._write(("status", 0, _span_count(records), f"{_QUEUE_FULL} ({error})" if error else _QUEUE_FULL))

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

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        exporter = self._exporter
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                records, resource = self._jobs.popleft()
                self._busy = True
            n = _span_count(records)
            try:
                records, lost = expand_trees(records)
                spans = readable_spans(records, resource, self._limits)
                before = exporter.failed
                try:
                    result = exporter.export(spans)
                except Exception as exc:  # noqa: BLE001 - silent: counted as failed, the thread goes on
                    exporter.last_error = f"{type(exc).__name__}: {exc}"
                    result = SpanExportResult.FAILURE
                failed = len(spans) if result is not SpanExportResult.SUCCESS and exporter.failed == before \
                    else exporter.failed - before
                if lost:
                    exporter.last_error = "cannot build a request's spans in the exporter process"
                status = ("status", len(spans) - failed, failed + lost, exporter.last_error)
            except Exception as exc:  # noqa: BLE001 - silent: a frame that cannot be rebuilt is failed, reported
                exporter.last_error = f"cannot rebuild spans in the exporter process: {type(exc).__name__}: {exc}"
                status = ("status", 0, n, exporter.last_error)
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
    ``_BATCH`` spans) to :class:`_SpanExports`, whose thread exports it through
    :class:`~llm_otel.export.exporters.ProcessSpanExporter` (request size cap) and writes its
    ``status`` frame. While exports wait on a collector that is down, at most ``_EXPORT_QUEUE``
    frames wait here; a frame beyond that is reported failed at once (so the serving process's
    acknowledgements, ``llm_otel.spans.dropped`` and ``in_flight`` stay exact) and GenAI request
    metrics keep being recorded, as the in-process meter provider keeps them through an outage.
    A ``flush`` frame is answered once every ``spans`` frame before it was reported (ok False when
    its ``timeout_ms`` ran out first) and the metrics were pushed. Stdout writes are serialized.
    Exits when stdin closes (queued frames get the flush deadline, ``LLM_OTEL_FLUSH_DEADLINE_S``)
    or after a final ``flush``; :func:`_exit_with_parent` bounds it when the serving process dies."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits

    from llm_otel.export.providers import span_exporter_from_env

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the status pipe
    # the serving process logs drops once per outage and counts them in its own metrics
    logging.getLogger("llm_otel").setLevel(logging.ERROR)
    frame = _read_frame(stdin)
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
            _write_frame(stdout, frame)

    exports = _SpanExports(exporter, SpanLimits(), write)
    # a Resource of its own: a re-label changes the meter provider's in place, and span frames
    # still queued for export keep the resource they were read with
    metrics = _ChildMetrics(Resource(frame[1], frame[2] or None), write)
    try:
        while True:
            frame = _read_frame(stdin)
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
    from llm_otel.export.exporters import DEFAULT_DEADLINE_S

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


class _ChildMetrics:
    """The exporter process's GenAI request instruments: a meter provider with the OTLP metric
    exporter from the environment (``OTEL_EXPORTER_OTLP_*``, ``OTEL_METRIC_EXPORT_INTERVAL``) and
    the serving process's resource, and the same :class:`~llm_otel.telemetry.metrics.Instruments`.

    After each export the collector accepted it writes ``("metrics_exported", n)``: ``n`` metric
    points applied before that export's collection (counted as the serving process counts what it
    sent, :func:`_metric_points`). If this process dies, the serving process counts the points sent
    after the last mark as dropped (``export_process_down``): they were aggregated here only."""

    def __init__(self, resource, write=None) -> None:
        self.resource = resource
        self.provider = None
        self.instruments = None
        self.exporter = None
        self._contexts: dict = {}
        self._write = write
        self._applied = 0  # metric points recorded so far
        self._apply_lock = threading.Lock()  # a collection sees whole batches: its mark is exact

    def start(self, name: str, version: str, schema_url: str, itl_every: int) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        from llm_otel.export.providers import metric_exporter_from_env
        from llm_otel.telemetry.metrics import Instruments

        if self.provider is not None:
            return
        self.exporter = metric_exporter_from_env(os.environ)
        if self.exporter is None:
            return
        owner = self

        class _MarkingReader(PeriodicExportingMetricReader):
            """Reports which points an export the collector accepted covered: the mark is taken
            by the collection (recording held only while it gathers, never during the export)."""

            mark = 0

            def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> None:
                mark, failed = self.mark, owner.exporter.failed
                super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)
                if owner.exporter.failed == failed and owner._write is not None:
                    try:
                        owner._write(("metrics_exported", mark))
                    except (OSError, ValueError):
                        pass  # silent: the serving process went away

        reader = _MarkingReader(self.exporter)
        self.provider = MeterProvider(resource=self.resource, metric_readers=[reader], shutdown_on_exit=False)
        gather = getattr(reader, "_collect", None)  # the SDK's collection callback, set by MeterProvider
        if gather is not None:
            def collect_marked(r, timeout_millis: float = 10_000):
                with owner._apply_lock:  # whole batches only: the mark is exact
                    reader.mark = owner._applied
                    return gather(r, timeout_millis=timeout_millis)

            reader._collect = collect_marked
        meter = self.provider.get_meter(name, version or None, schema_url=schema_url or None)
        self.instruments = Instruments(meter, itl_every)
        from llm_otel.signals import request_instruments

        self.instruments.kv_size, self.instruments.slo_checks = request_instruments(meter)

    def set_resource(self, resource) -> None:
        """The serving process's new resource: the meter provider's is re-labelled in place, as
        :func:`llm_otel.process.identity.relabel` does in the serving process."""
        self.resource = resource
        if self.provider is not None:
            from llm_otel.export.resources import resource_of as _resource_of
            from llm_otel.export.resources import set_attributes as _set_attributes

            current = _resource_of(self.provider)
            if current is not None:
                _set_attributes(current, resource.attributes)

    def record(self, batch) -> None:
        instruments = self.instruments
        if instruments is None:
            return
        with self._apply_lock:
            self._record(instruments, batch)
            self._applied += _metric_points(batch)

    def _record(self, instruments, batch) -> None:
        from llm_otel.telemetry.metrics import _NO_TRACE

        contexts = self._contexts
        for name, value, attributes, ids in batch:
            ctx = _NO_TRACE
            if name == "request":  # one finished request's observations: the request span's ids, once
                if ids is not None:
                    ctx = trace_api.set_span_in_context(trace_api.NonRecordingSpan(
                        SpanContext(ids[0], ids[1], is_remote=False, trace_flags=TraceFlags(ids[2]))))
                instruments.apply(value, ctx)
                continue
            if ids is not None:
                ctx = contexts.get(ids)
                if ctx is None:
                    if len(contexts) > 4096:
                        contexts.clear()
                    ctx = contexts[ids] = trace_api.set_span_in_context(trace_api.NonRecordingSpan(
                        SpanContext(ids[0], ids[1], is_remote=False, trace_flags=TraceFlags(ids[2]))))
            instrument = getattr(instruments, name)
            if _OFFLOADED_KIND[name] == "add":
                instrument.add(value, attributes, ctx)
            else:
                instrument.record(value, attributes, ctx)

    def flush(self, timeout_ms: int, final: bool) -> int:
        """Export now (and shut down when ``final``); returns the failed exports since the last call."""
        if self.provider is None:
            return 0
        before = self.exporter.failed
        try:
            if final:
                self.provider.shutdown(timeout_millis=max(1, timeout_ms))
                self.provider = None
            else:
                self.provider.force_flush(max(1, timeout_ms))
        except Exception as exc:  # noqa: BLE001 - silent: counted as failed spans (last_error)
            self.exporter.last_error = f"{type(exc).__name__}: {exc}"
            return max(1, self.exporter.failed - before)
        return self.exporter.failed - before

    def last_error(self) -> str | None:
        return getattr(self.exporter, "last_error", None)


if __name__ == "__main__":
    sys.exit(main())
