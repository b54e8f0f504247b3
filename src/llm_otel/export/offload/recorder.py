"""Recording in the serving process: :class:`OffloadTracerProvider` (the tracer provider when spans
are exported by an exporter process), its light recording spans (:class:`OffloadSpan`: plain values,
one record on ``end``), request trees shipped as one record (:meth:`OffloadTracer.ship_children`),
and :class:`OffloadOutlets`, the telemetry core's outlets (:mod:`llm_otel.telemetry.outlets`) for
what the exporter process builds and records (:func:`request_outlets` makes them at wiring time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

from opentelemetry import trace as trace_api
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from llm_otel.errors import guard
from llm_otel.export.offload.frames import CHILDREN, PROMPT_ONLY, settings_fields
from llm_otel.export.offload.writer import DEFAULT_BUFFER, DEFAULT_DEADLINE_S, OffloadBuffer
from llm_otel.propagation import RANDOM_FLAG


def _ids_random(id_generator: object) -> bool:
    """Whether ``id_generator`` makes random trace ids: its ``is_trace_id_random()`` (SDK 1.42+),
    else whether it is the SDK's ``RandomIdGenerator``; False when the question cannot be asked."""
    try:
        probe = getattr(id_generator, "is_trace_id_random", None)
        if probe is not None:
            return bool(probe())
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        return isinstance(id_generator, RandomIdGenerator)
    except Exception:  # noqa: BLE001 - silent: an application's id generator failing: not random
        return False


class RecordSink(Protocol):
    """Where an :class:`OffloadSpan` puts its record on ``end``: the provider's
    :class:`OffloadBuffer`, or the exporter process's collector of rebuilt tree spans."""

    def push(self, record: tuple) -> None: ...


class OffloadSpan(trace_api.Span):
    """A recording span that keeps its data as plain Python values and, on :meth:`end`, hands
    one record to its provider's :class:`OffloadBuffer`. Attribute values are kept as given
    (validated by the SDK in the exporter process); a second ``end`` is ignored."""

    __slots__ = (
        "_name",
        "_context",
        "_parent",
        "_kind",
        "_attributes",
        "_events",
        "_links",
        "_status",
        "_start",
        "_end",
        "_scope",
        "_buffer",
    )

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
        self._end: int | None = None
        self._scope = scope
        self._buffer: RecordSink = buffer

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

        attrs = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
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
        self._buffer.push(
            (
                self._name,
                ctx.trace_id,
                ctx.span_id,
                int(ctx.trace_flags),
                tuple(ctx.trace_state.items()),
                None
                if parent is None
                else (
                    parent.trace_id,
                    parent.span_id,
                    parent.is_remote,
                    int(parent.trace_flags),
                    tuple(parent.trace_state.items()),
                ),
                # no new container for a span without events or links (most): fewer objects for the
                # garbage collector to traverse while the record waits for the writer
                self._kind.value,
                self._start,
                self._end,
                self._attributes,
                self._events or (),
                tuple([_link_record(link) for link in self._links]) if self._links else (),
                self._status,
                self._scope,
            )
        )

    def __enter__(self):
        return self


def _copied(attributes) -> dict:
    return {key: tuple(value) if type(value) is list else value for key, value in attributes.items()}


def _link_record(link: Link) -> tuple:
    c = link.context
    return (
        c.trace_id,
        c.span_id,
        c.is_remote,
        int(c.trace_flags),
        tuple(c.trace_state.items()),
        dict(link.attributes) if link.attributes else None,
    )


class OffloadTracer(trace_api.Tracer):
    """Starts :class:`OffloadSpan` objects the way the SDK's ``Tracer.start_span`` starts spans
    (same id generator, sampler call, trace flags and ``tracestate``); unsampled spans are
    ``NonRecordingSpan`` with their real context, as in the SDK."""

    def __init__(self, provider: OffloadTracerProvider, scope: tuple) -> None:
        self._provider = provider
        self._scope = scope
        self._settings: tuple = (None, ())  # (Settings, settings_fields of it) of the last tree shipped

    def start_span(
        self,
        name: str,
        context=None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes=None,
        links=(),
        start_time=None,
        record_exception=True,
        set_status_on_exception=True,
    ):
        provider = self._provider
        links = links or ()
        parent: SpanContext | None = trace_api.get_current_span(context).get_span_context()
        ids = provider.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
        else:
            trace_id = parent.trace_id
        result = provider.sampler.should_sample(context, trace_id, name, kind, attributes, links)
        flags = TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT
        # W3C random-trace-id (0x02), as the SDK's tracer sets it: a root's from its id generator,
        # a child's from its parent (never claimed for a trace id someone else made non-random)
        if parent is None:
            if _ids_random(ids):
                flags |= RANDOM_FLAG
        else:
            flags |= parent.trace_flags & RANDOM_FLAG
        span_context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=result.trace_state,
        )
        if not result.decision.is_recording() or provider.buffer is None:
            return trace_api.NonRecordingSpan(span_context)
        return OffloadSpan(
            name,
            span_context,
            parent,
            kind,
            result.attributes,
            tuple(link for link in links if link.context is not None and link.context.is_valid),
            start_time if start_time is not None else time.time_ns(),
            self._scope,
            provider.buffer,
        )

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
        for name in CHILDREN if rec.step_times else PROMPT_ONLY:
            if result is None or not provider.children_decide_alike:
                result = sampler.should_sample(context, trace_id, name, SpanKind.INTERNAL, None, ())
                decision = (
                    tuple(result.trace_state.items()) if result.trace_state else (),
                    dict(result.attributes) if result.attributes else None,
                )
            span_id = ids.generate_span_id()
            if result.decision.is_sampled():  # recording but not sampled: not exported, as in start_span
                children.append((name, span_id, *decision))
        if children:
            if settings is not self._settings[0]:
                self._settings = (settings, settings_fields(settings))
            span._buffer.push(
                (
                    None,
                    len(children),
                    self._scope,
                    (trace_id, parent.span_id, False, int(parent.trace_flags), tuple(parent.trace_state.items())),
                    tuple(children),
                    end_ns,
                    self._settings[1],
                    rec.span_fields(settings.capture_content),
                ),
                len(children),
            )
        return True

    def start_as_current_span(
        self,
        name,
        context=None,
        kind=SpanKind.INTERNAL,
        attributes=None,
        links=(),
        start_time=None,
        record_exception=True,
        set_status_on_exception=True,
        end_on_exit=True,
    ):
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return trace_api.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        )


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

    def __init__(
        self,
        resource,
        sampler,
        id_generator,
        endpoint: str = "",
        buffer_size: int = DEFAULT_BUFFER,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.resource = resource
        self.sampler = sampler
        self.id_generator = id_generator
        # the sampler decides a child of a given parent the same whatever its name and attributes
        # (parent-based: the SDK's static and parent-based samplers, llm-otel's): one call serves
        # both children of a request (OffloadTracer.ship_children); any other sampler is asked per child
        from llm_otel.sampling import decides_children_by_parent

        self.children_decide_alike = decides_children_by_parent(sampler)
        # started lazily, with the first span; prewarm() starts it now where llm-otel knows this
        # is a serving frontend (under opentelemetry-instrument every Python process builds one)
        self.buffer: OffloadBuffer | None = OffloadBuffer(
            dict(resource.attributes), resource.schema_url or "", endpoint, buffer_size, env
        )
        # the meter provider built together with this one for OTLP metric export (same resource),
        # set by whoever built both: the per-request GenAI metrics recorded on it may be recorded
        # by the exporter process instead (request_outlets); None: they stay in process
        self.metrics_with = None

    def resource_changed(self) -> None:
        """This provider's resource was re-labelled (:func:`llm_otel.process.identity.relabel`,
        also after fork): spans ended from now on are exported under it (and the exporter
        process's GenAI metrics). Never raises."""
        buffer = self.buffer
        if buffer is not None:
            buffer.set_resource(dict(self.resource.attributes), self.resource.schema_url or "")

    def get_tracer(
        self, instrumenting_module_name, instrumenting_library_version=None, schema_url=None, attributes=None
    ):
        return OffloadTracer(
            self,
            (
                instrumenting_module_name or "",
                instrumenting_library_version or "",
                schema_url or "",
                dict(attributes) if attributes else None,
            ),
        )

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        buffer = self.buffer
        return True if buffer is None else buffer.flush(timeout_millis / 1000, final=False)

    def shutdown(self, timeout_millis: int | None = None) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.flush(timeout_millis / 1000 if timeout_millis is not None else DEFAULT_DEADLINE_S, final=True)


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


class OffloadOutlets:
    """The telemetry core's outlets (:class:`llm_otel.telemetry.outlets.RequestOutlets`) for an
    :class:`OffloadTracerProvider`: a finished request's ``llm.prompt`` / ``llm.token_stream`` go
    to its exporter process as one tree record (:meth:`OffloadTracer.ship_children`), and, with
    ``metrics`` (the meter provider is the one built with it for OTLP), the per-request GenAI
    metrics and the signals' per-request observations go there as records too
    (:class:`~llm_otel.export.offload.writer.OffloadBuffer` as the metrics outlet). Made by
    :func:`request_outlets`."""

    def __init__(self, provider: OffloadTracerProvider, metrics: bool) -> None:
        self.provider = provider
        self.metrics = metrics

    def span_tree(self, tracer) -> OffloadTracer | None:
        """``tracer`` itself when it is one of ours (it ships request trees), else None."""
        return tracer if type(tracer) is OffloadTracer else None

    def request_metrics(self, scope: tuple, itl_every: int) -> OffloadBuffer | None:
        """The provider's buffer, told the meter's ``scope`` (name, version, schema_url: the
        exporter process's instruments keep it) and ``itl_every``, when the metrics go to the
        exporter process; None (recorded in process) otherwise or once the provider is shut down."""
        buffer = self.provider.buffer
        if not self.metrics or not isinstance(buffer, OffloadBuffer):
            return None
        from llm_otel.telemetry.metrics import NO_TRACE

        buffer.declare_instruments(scope, itl_every, NO_TRACE)
        return buffer


def request_outlets(tracer_provider=None, meter_provider=None) -> OffloadOutlets | None:
    """The outlets :class:`~llm_otel.telemetry.Telemetry` is handed (its ``outlets`` argument) for
    these providers (the global ones for None, as ``Telemetry`` uses them): :class:`OffloadOutlets`
    when ``tracer_provider`` is an :class:`OffloadTracerProvider`, with the per-request metrics
    when ``meter_provider`` is the one built with it for OTLP (``metrics_with``); None otherwise
    (the application's providers, console output, the SDK's in-process export)."""
    if tracer_provider is None:
        tracer_provider = trace_api.get_tracer_provider()
    if not isinstance(tracer_provider, OffloadTracerProvider):
        return None
    if meter_provider is None:
        from opentelemetry.metrics import get_meter_provider

        meter_provider = get_meter_provider()
    return OffloadOutlets(tracer_provider, metrics=tracer_provider.metrics_with is meter_provider)
