"""Rebuilding in the exporter process what the serving process recorded: SDK ``ReadableSpan``
objects from span records (:func:`readable_spans`), ``llm.prompt`` / ``llm.token_stream`` from tree
records by the core's own :meth:`~llm_otel.telemetry.spans.SpanBuilder.children`
(:func:`expand_trees`), and the per-request GenAI metrics replayed into the same instruments
(:class:`ChildMetrics`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from opentelemetry import trace as trace_api
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from llm_otel.config import Settings
from llm_otel.errors import process_errors
from llm_otel.export.offload.frames import TREE_SETTINGS, metric_points
from llm_otel.export.offload.recorder import OffloadSpan
from llm_otel.export.resources import resource_of, set_attributes

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.metrics import MeterProvider

    from llm_otel.export.exporters import ProcessMetricExporter
    from llm_otel.telemetry.metrics import Instruments

# GenAI request instruments of :class:`llm_otel.telemetry.metrics.Instruments` recorded in the
# exporter process: the ones every finished request records (attribute name -> "record"/"add")
OFFLOADED_INSTRUMENTS = {
    "duration": "record",
    "ttft": "record",
    "tpot": "record",
    "itl": "record",
    "token_rate": "record",
    "queue": "record",
    "tokens": "record",
    "requests": "add",
}
# the per-request instruments of :class:`llm_otel.signals.Signals` (two KV-size observations and
# the SLO checks of every request): in-process SDK records of these cost the frontend more per
# request than the tuple each becomes
OFFLOADED_SIGNAL_INSTRUMENTS = {"kv_size": "record", "slo_checks": "add"}
_OFFLOADED_KIND = {**OFFLOADED_INSTRUMENTS, **OFFLOADED_SIGNAL_INSTRUMENTS}


def _context(trace_id, span_id, is_remote, flags, state) -> SpanContext:
    return SpanContext(
        trace_id, span_id, is_remote=is_remote, trace_flags=TraceFlags(flags), trace_state=TraceState(list(state))
    )


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

    def start_span(
        self,
        name,
        context=None,
        kind=SpanKind.INTERNAL,
        attributes=None,
        links=(),
        start_time=None,
        record_exception=True,
        set_status_on_exception=True,
    ):
        child = self._children.get(name)
        if child is None:
            return trace_api.INVALID_SPAN
        span_id, state, extra = child
        if extra:  # what the sampler adds to the span's own attributes (as _AdaptiveSampler merges them)
            attributes = {**(attributes or {}), **extra}
        parent = self._parent
        context = SpanContext(
            parent.trace_id,
            span_id,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED | (parent.trace_flags & TraceFlags.RANDOM_TRACE_ID)),
            trace_state=TraceState(list(state)),
        )
        return OffloadSpan(
            name,
            context,
            parent,
            kind,
            attributes,
            (),
            start_time if start_time is not None else time.time_ns(),
            self._scope,
            self._sink,
        )


@functools.lru_cache(maxsize=16)
def _tree_settings(values: tuple) -> Settings:
    """The :class:`Settings` a tree record's :data:`TREE_SETTINGS` values describe (the rest at
    their defaults: :meth:`SpanBuilder.children` reads only these). Frozen, so one object per
    distinct tuple is shared (a serving process sends the same values with every tree)."""
    return dataclasses.replace(Settings(), **dict(zip(TREE_SETTINGS, values, strict=False)))


def expand_trees(records: Sequence[tuple]) -> tuple[list, int]:
    """Span records with every tree record (:meth:`OffloadTracer.ship_children`) replaced by the
    ``llm.prompt`` / ``llm.token_stream`` span records :class:`~llm_otel.telemetry.spans.SpanBuilder`
    builds from it - the same code and values as in the serving process. Returns (records, spans
    lost): a tree that cannot be built (logged once) loses the spans it announced."""
    if not any(record[0] is None for record in records):
        return list(records), 0
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
            # _ChildTracer is no opentelemetry Tracer subclass: it has the one method
            # SpanBuilder.children calls (start_span), with Tracer.start_span's signature
            builder = SpanBuilder(
                cast("trace_api.Tracer", _ChildTracer(scope, parent, children, sink)), _tree_settings(settings)
            )
            builder.children(RequestRecord.from_span_fields(fields), None, end_ns)
        except Exception as exc:  # noqa: BLE001 - a bad record loses its spans, not the batch
            process_errors().report(
                "export.offload.tree",
                exc,
                "cannot build a request's spans in the exporter process; that request's spans are lost and counted",
            )
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
    for (
        name,
        trace_id,
        span_id,
        flags,
        state,
        parent,
        kind,
        start,
        end,
        attributes,
        events,
        links,
        status,
        scope,
    ) in records:
        inst = scopes.get(scope)
        if inst is None:
            inst = scopes[scope] = InstrumentationScope(scope[0], scope[1] or None, scope[2] or None, scope[3])
        bounded_events: BoundedList[Event] = BoundedList(limits.max_events)
        for ev_name, ev_attrs, ts in events:
            bounded_events.append(
                Event(
                    ev_name,
                    BoundedAttributes(
                        limits.max_event_attributes, ev_attrs, immutable=True, max_value_len=limits.max_attribute_length
                    ),
                    ts,
                )
            )
        bounded_links: BoundedList[Link] = BoundedList(limits.max_links)
        for l_trace, l_span, l_remote, l_flags, l_state, l_attrs in links:
            bounded_links.append(
                Link(
                    _context(l_trace, l_span, l_remote, l_flags, l_state),
                    BoundedAttributes(
                        limits.max_link_attributes, l_attrs, immutable=True, max_value_len=limits.max_attribute_length
                    ),
                )
            )
        span = ReadableSpan(
            name=name,
            context=_context(trace_id, span_id, False, flags, state),
            parent=None if parent is None else _context(*parent),
            resource=resource,
            attributes=BoundedAttributes(
                limits.max_span_attributes, attributes, immutable=False, max_value_len=limits.max_attribute_length
            ),
            events=bounded_events,
            links=bounded_links,
            kind=SpanKind(kind),
            status=Status(StatusCode(status[0]), status[1]),
            start_time=start,
            end_time=end,
            instrumentation_scope=inst,
        )
        out.append(span)
    return out


class ChildMetrics:
    """The exporter process's GenAI request instruments: a meter provider with the OTLP metric
    exporter ``new_exporter()`` makes (:func:`~llm_otel.export.providers.metric_exporter_from_env`:
    ``OTEL_EXPORTER_OTLP_*``, ``OTEL_METRIC_EXPORT_INTERVAL``; None: no metrics) and the serving
    process's resource, and the same :class:`~llm_otel.telemetry.metrics.Instruments` (with the
    signals' :func:`~llm_otel.signals.request_instruments`).

    After each export the collector accepted it writes ``("metrics_exported", n)``: ``n`` metric
    points applied before that export's collection (counted as the serving process counts what it
    sent, :func:`~llm_otel.export.offload.frames.metric_points`). If this process dies, the serving
    process counts the points sent after the last mark as dropped (``export_process_down``): they
    were aggregated here only."""

    def __init__(self, resource, write=None, new_exporter=None) -> None:
        self.resource = resource
        self.provider: MeterProvider | None = None
        self.instruments: Instruments | None = None
        self.exporter: ProcessMetricExporter | None = None
        self._new_exporter = new_exporter
        self._by_name: dict = {}  # instrument name in a metric record -> the SDK instrument
        self._contexts: dict[tuple, Context] = {}
        self._write = write
        self._applied = 0  # metric points recorded so far
        self._apply_lock = threading.Lock()  # a collection sees whole batches: its mark is exact

    def start(self, name: str, version: str, schema_url: str, itl_every: int) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        from llm_otel.signals import request_instruments
        from llm_otel.telemetry.metrics import Instruments

        if self.provider is not None:
            return
        self.exporter = self._new_exporter() if self._new_exporter is not None else None
        if self.exporter is None:
            return
        exporter: ProcessMetricExporter = self.exporter  # for _MarkingReader: never None there
        owner = self

        class _MarkingReader(PeriodicExportingMetricReader):
            """Reports which points an export the collector accepted covered: the mark is taken
            by the collection (recording held only while it gathers, never during the export)."""

            mark = 0

            def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> None:
                mark, failed = self.mark, exporter.failed
                super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)
                if exporter.failed == failed and owner._write is not None:
                    try:
                        owner._write(("metrics_exported", mark))
                    except (OSError, ValueError):
                        pass  # silent: the serving process went away

        reader = _MarkingReader(exporter)
        self.provider = MeterProvider(resource=self.resource, metric_readers=[reader], shutdown_on_exit=False)
        gather = getattr(reader, "_collect", None)  # the SDK's collection callback, set by MeterProvider
        if gather is not None:

            def collect_marked(r, timeout_millis: float = 10_000):
                with owner._apply_lock:  # whole batches only: the mark is exact
                    reader.mark = owner._applied
                    return gather(r, timeout_millis=timeout_millis)

            reader._collect = collect_marked
        meter = self.provider.get_meter(name, version or None, schema_url=schema_url or None)
        self.instruments = instruments = Instruments(meter, itl_every)
        self._by_name = {name: getattr(instruments, name) for name in OFFLOADED_INSTRUMENTS}
        self._by_name.update(zip(OFFLOADED_SIGNAL_INSTRUMENTS, request_instruments(meter), strict=False))

    def set_resource(self, resource) -> None:
        """The serving process's new resource: the meter provider's is re-labelled in place, as
        :func:`llm_otel.process.identity.relabel` does in the serving process."""
        self.resource = resource
        if self.provider is not None:
            current = resource_of(self.provider)
            if current is not None:
                set_attributes(current, resource.attributes)

    def record(self, batch) -> None:
        instruments = self.instruments
        if instruments is None:
            return
        with self._apply_lock:
            self._record(instruments, batch)
            self._applied += metric_points(batch)

    def _record(self, instruments, batch) -> None:
        from llm_otel.telemetry.metrics import NO_TRACE

        contexts, by_name = self._contexts, self._by_name
        for name, value, attributes, ids in batch:
            ctx = NO_TRACE
            if name == "request":  # one finished request's observations: the request span's ids, once
                if ids is not None:
                    ctx = trace_api.set_span_in_context(
                        trace_api.NonRecordingSpan(
                            SpanContext(ids[0], ids[1], is_remote=False, trace_flags=TraceFlags(ids[2]))
                        )
                    )
                instruments.apply(value, ctx)
                continue
            if ids is not None:
                cached = contexts.get(ids)
                if cached is None:
                    if len(contexts) > 4096:
                        contexts.clear()
                    cached = contexts[ids] = trace_api.set_span_in_context(
                        trace_api.NonRecordingSpan(
                            SpanContext(ids[0], ids[1], is_remote=False, trace_flags=TraceFlags(ids[2]))
                        )
                    )
                ctx = cached
            instrument = by_name[name]
            if _OFFLOADED_KIND[name] == "add":
                instrument.add(value, attributes, ctx)
            else:
                instrument.record(value, attributes, ctx)

    def flush(self, timeout_ms: int, final: bool) -> int:
        """Export now (and shut down when ``final``); returns the failed exports since the last call."""
        exporter = self.exporter
        if self.provider is None or exporter is None:  # set together by start
            return 0
        before = exporter.failed
        try:
            if final:
                self.provider.shutdown(timeout_millis=max(1, timeout_ms))
                self.provider = None
            else:
                self.provider.force_flush(max(1, timeout_ms))
        except Exception as exc:  # noqa: BLE001 - silent: counted as failed spans (last_error)
            exporter.last_error = f"{type(exc).__name__}: {exc}"
            return max(1, exporter.failed - before)
        return exporter.failed - before

    def last_error(self) -> str | None:
        return getattr(self.exporter, "last_error", None)
