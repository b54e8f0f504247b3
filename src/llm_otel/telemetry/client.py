"""Client calls: requests an application sends to an inference server through a client library
(tritonclient), recorded and emitted by the core.

An adapter reads the library's arguments and responses; this module owns what becomes of them:

* :meth:`ClientCalls.start` starts a :class:`ClientCall` with its CLIENT span
  ``{gen_ai.operation.name} {gen_ai.request.model}`` in the caller's context;
  :meth:`ClientCalls.use` makes the span current while the library runs (so spans of the gRPC /
  aiohttp instrumentations nest under it) and :meth:`ClientCalls.carrier` is its W3C trace
  context for the request's headers.
* :meth:`ClientCall.on_response` is the hot path: one ``time.monotonic()`` append per response.
* :meth:`ClientCalls.finish`, exactly once per call: ``llm.token_stream`` of a streamed call (its
  response times, gap percentiles, ``llm.stream.response`` events), the error status, the GenAI
  client metrics.
* A stream of requests that share one trace context (a gRPC stream sends its metadata once) is a
  :class:`ClientStream` with a span of its own (:meth:`ClientCalls.start_stream` /
  :meth:`ClientCalls.end_stream`); each request on it is a call whose span links to it.

Unlike a :class:`~llm_otel.telemetry.record.RequestRecord`, counts are *responses*, not tokens: a
client sees what the server sends, not token ids.

Clocks: span times are epoch ns (``time.time_ns()``); ``start_mono`` and response times are the
client's ``time.monotonic()`` seconds, mapped to epoch ns once per call
(:func:`llm_otel.telemetry.record.mono_offset_ns`). Durations and gaps are seconds.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from llm_otel.propagation import carrier_from_span
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.semconv import spans as S
from llm_otel.telemetry.bounds import bounded_id
from llm_otel.telemetry.metrics import BoundedValues
from llm_otel.telemetry.record import mono_offset_ns
from llm_otel.telemetry.spans import _percentiles

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from opentelemetry.metrics import Histogram, Meter
    from opentelemetry.trace import Span, Tracer

    from llm_otel.config import Settings
    from llm_otel.telemetry.errors import HookErrors

MAX_CLIENT_MODELS = 64  # distinct model names per process with their own client metric series
# ``error.type`` of a call or stream the application cancelled: recorded, but no error status
CANCELLED = "cancelled"


class ClientInstruments:
    """GenAI client histograms (seconds), created once per meter with the semconv bucket advisories.

    * ``gen_ai.client.operation.duration``: call -> last response or error, every call.
    * ``gen_ai.client.operation.time_to_first_chunk``: call -> first response, successful streams.
    * ``gen_ai.client.operation.time_per_output_chunk``: each gap between consecutive responses
      after the first, successful streams.
    """

    def __init__(self, meter: Meter) -> None:
        def hist(name: str, unit: str, buckets: tuple[float, ...], description: str) -> Histogram:
            return meter.create_histogram(
                name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
            )

        self.duration = hist(
            M.GEN_AI_CLIENT_OPERATION_DURATION,
            M.GEN_AI_CLIENT_OPERATION_DURATION_UNIT,
            M.GEN_AI_CLIENT_OPERATION_DURATION_BUCKETS,
            "GenAI operation duration.",
        )
        self.first_chunk = hist(
            M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
            M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK_UNIT,
            M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK_BUCKETS,
            "Time to the first chunk of a streamed response.",
        )
        self.per_chunk = hist(
            M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK,
            M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK_UNIT,
            M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK_BUCKETS,
            "Time between consecutive chunks of a streamed response.",
        )


class ClientCall:
    """One request sent through a client library: its span and the client-side times of its responses.

    ``start_mono``/``times`` are ``time.monotonic()`` seconds; ``offset_ns`` maps them to epoch ns.
    ``expected`` (output names the caller asked for) and ``problem`` (the first finding on a
    streamed response that does not have what was asked for: output names and data types only,
    never content) are the adapter's to fill.
    """

    __slots__ = (
        "span",
        "recording",
        "request_id",
        "metric_attrs",
        "start_mono",
        "offset_ns",
        "times",
        "streaming",
        "finished",
        "end_reason",
        "lock",
        "expected",
        "problem",
        "stream",
    )

    def __init__(
        self,
        span: Span,
        request_id: str,
        metric_attrs: dict[str, Any],
        streaming: bool,
        expected: tuple[str, ...] = (),
        stream: ClientStream | None = None,
    ) -> None:
        self.stream = stream  # the stream it is in flight on until it finishes, or None
        self.expected = expected
        self.problem: str | None = None
        self.span = span
        self.recording = span.is_recording()
        self.request_id = request_id
        self.metric_attrs = metric_attrs
        self.offset_ns = mono_offset_ns()
        self.start_mono = time.monotonic()
        self.times = array("d")
        self.streaming = streaming
        self.finished = False
        self.end_reason: str | None = None
        self.lock = threading.Lock()

    def on_response(self, now: float | None = None) -> None:
        """Hot path: one response arrived (``time.monotonic()`` seconds; now when None)."""
        self.times.append(time.monotonic() if now is None else now)

    def epoch_ns(self, mono_s: float) -> int:
        return round(mono_s * 1e9) + self.offset_ns


class ClientStream:
    """One stream of requests sharing one trace context (a gRPC stream): its span, whose context
    is the stream's ``traceparent`` and hence the server's parent for every request on it, and the
    requests in flight on it by request id, oldest first (a call is in flight from
    :meth:`ClientCalls.start` with ``stream=`` until :meth:`ClientCalls.finish`).

    The server echoes a request's id on each response: :meth:`lookup` matches a response to its
    request. ``requests`` counts the requests started on the stream; ``closed`` is the adapter's
    mark that the stream ended (its open requests were drained). Thread-safe (the application's
    thread starts requests while the library's stream thread delivers responses)."""

    __slots__ = ("span", "lock", "inflight", "requests", "closed")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.lock = threading.Lock()
        self.inflight: dict[str, deque[ClientCall]] = {}
        self.requests = 0
        self.closed = False

    def add(self, call: ClientCall) -> None:
        with self.lock:
            self.requests += 1
            self.inflight.setdefault(call.request_id, deque()).append(call)

    def lookup(self, request_id: str) -> ClientCall | None:
        """The oldest request in flight with ``request_id``; with a single request in flight, that
        one whatever the id (the server echoes ids: an unknown one can only be ours); else None."""
        with self.lock:
            calls = self.inflight.get(request_id)
            if calls:
                return calls[0]
            if len(self.inflight) == 1:
                (only,) = self.inflight.values()
                return only[0] if len(only) == 1 else None
            return None

    def remove(self, call: ClientCall) -> None:
        with self.lock:
            calls = self.inflight.get(call.request_id)
            if calls:
                try:
                    calls.remove(call)
                except ValueError:
                    pass
                if not calls:
                    del self.inflight[call.request_id]

    def drain(self) -> list[ClientCall]:
        """Every request still in flight (no longer tracked here), oldest first per id."""
        with self.lock:
            out = [c for calls in self.inflight.values() for c in calls]
            self.inflight.clear()
            return out


class ClientCalls:
    """Spans and GenAI client metrics of the calls one client library makes (``provider`` is the
    ``gen_ai.provider.name``, ``triton``). Created by :meth:`llm_otel.telemetry.Telemetry.client_calls`;
    the histograms live on the telemetry's meter."""

    def __init__(
        self,
        *,
        provider: str,
        tracer: Tracer,
        meter: Meter,
        settings: Settings,
        errors: HookErrors,
        truncate: Callable[[str], str],
    ) -> None:
        self.provider = provider
        self.tracer = tracer
        self.settings = settings
        self.errors = errors
        self._truncate = truncate
        self.instruments = ClientInstruments(meter)
        # the model names the application passes: the first MAX_CLIENT_MODELS keep their own series
        self._models = BoundedValues(MAX_CLIENT_MODELS, f"models called through {provider}")

    # --- start ----------------------------------------------------------------------------------
    def start(
        self,
        *,
        operation: str,
        model: str,
        server: Mapping[str, Any],
        attributes: Mapping[str, Any],
        request_id: str = "",
        streaming: bool = False,
        expected: tuple[str, ...] = (),
        stream: ClientStream | None = None,
    ) -> ClientCall:
        """Start a call's CLIENT span ``{operation} {model}`` now, in the current context.

        ``server``: ``server.address``/``server.port`` (span and metric attributes);
        ``attributes``: the adapter's request attributes (``gen_ai.request.*``, library fields);
        ``streaming`` sets ``gen_ai.request.stream``; ``request_id`` (if any) ``llm.request.id``.
        ``model`` and ``request_id`` are cut to :data:`~llm_otel.telemetry.bounds.MAX_ID_CHARS`
        characters; on the metrics the first :data:`MAX_CLIENT_MODELS` models keep their names,
        later ones are ``_OTHER``.
        On a ``stream``: the child of the caller's current span when there is one, else of the
        stream span, and always linked to the stream span; in flight on it until :meth:`finish`.
        """
        model = bounded_id(model)  # the application's argument: cut to MAX_ID_CHARS on the span
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_PROVIDER_NAME: self.provider,
            A.GEN_AI_REQUEST_MODEL: model,
            **server,
            **attributes,
        }
        if streaming:
            attrs[A.GEN_AI_REQUEST_STREAM] = True
        if request_id:
            attrs[A.LLM_REQUEST_ID] = bounded_id(request_id)
        parent = links = None
        if stream is not None:
            if not trace.get_current_span().get_span_context().is_valid:
                parent = trace.set_span_in_context(stream.span)
            links = [Link(stream.span.get_span_context())]
        span = self.tracer.start_span(
            f"{operation} {model}", context=parent, kind=SpanKind.CLIENT, attributes=attrs, links=links
        )
        metric_attrs = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_PROVIDER_NAME: self.provider,
            A.GEN_AI_REQUEST_MODEL: self._models(model),
            **server,
        }
        call = ClientCall(span, request_id, metric_attrs, streaming, expected, stream)
        if stream is not None:
            stream.add(call)
        return call

    def start_stream(self, name: str, attributes: Mapping[str, Any]) -> ClientStream:
        """Start a stream's CLIENT span ``name`` (the semconv name of the library's stream span) now,
        in the current context; ``attributes`` are the library's (client, ``server.*``)."""
        span = self.tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes={A.GEN_AI_PROVIDER_NAME: self.provider, **attributes}
        )
        return ClientStream(span)

    @staticmethod
    def use(record: ClientCall | ClientStream) -> AbstractContextManager[Span]:
        """Context manager: ``record``'s span is current inside (never ended, nothing recorded on
        it by leaving with an exception: :meth:`finish` decides that)."""
        return trace.use_span(record.span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    @staticmethod
    def carrier(record: ClientCall | ClientStream) -> dict[str, str]:
        """``traceparent`` (and ``tracestate`` when there is one) of ``record``'s span, lowercase keys."""
        return carrier_from_span(record.span)

    @classmethod
    def headers_with_context(
        cls, headers: Mapping[str, Any] | None, record: ClientCall | ClientStream
    ) -> dict[str, Any]:
        """A new dict: the caller's ``headers`` (never modified) without any ``traceparent`` /
        ``tracestate`` key in any letter case, plus ``record``'s (:meth:`carrier`, lowercase: gRPC
        metadata requires it)."""
        out = dict(headers) if headers else {}
        for key in [k for k in out if isinstance(k, str) and k.lower() in ("traceparent", "tracestate")]:
            del out[key]
        out.update(cls.carrier(record))
        return out

    # --- end ------------------------------------------------------------------------------------
    def finish(
        self,
        call: ClientCall,
        *,
        error: BaseException | None = None,
        error_type: str | None = None,
        content_free: bool = False,
        end_reason: str | None = None,
        end_mono: float | None = None,
    ) -> None:
        """End ``call`` exactly once (a second call is ignored; it leaves its stream's requests in
        flight): ``llm.token_stream`` (streams with responses), status, metrics. Never raises
        (failures counted as ``{provider}.finish``).

        ``error_type``: the call's ``error.type`` (None: success); ``error``: what failed, whose
        message becomes the status description only with content capture on (server messages can
        quote the input) or when ``content_free`` (a finding naming outputs and types only).
        ``cancelled`` is recorded without an error status. ``end_reason``: ``llm.stream.end`` of a
        streamed call (default ``error`` or ``stream_end``); ``end_mono``: when it ended
        (monotonic s, default now).
        """
        with call.lock:
            if call.finished:
                return
            call.finished = True
        if call.stream is not None:
            call.stream.remove(call)
        try:
            end = time.monotonic() if end_mono is None else end_mono
            end_ns = call.epoch_ns(end)
            if call.streaming:
                call.end_reason = end_reason or ("error" if error_type is not None else "stream_end")
            if call.recording:
                self._emit(call, end_ns, error, error_type, content_free)
            else:
                call.span.end(end_time=end_ns)
            attrs = call.metric_attrs
            if error_type is not None:
                attrs = {**attrs, A.ERROR_TYPE: error_type}
            self.instruments.duration.record(max(0.0, end - call.start_mono), attrs)
            if error_type is None and call.streaming and call.times:
                self.instruments.first_chunk.record(max(0.0, call.times[0] - call.start_mono), attrs)
                for gap in np.diff(np.frombuffer(call.times, dtype=np.float64)):
                    self.instruments.per_chunk.record(float(gap), attrs)
        except Exception as exc:  # noqa: BLE001
            self.errors.report(f"{self.provider}.finish", exc)
            try:
                call.span.end()
            except Exception:  # noqa: BLE001 - silent: cleanup after the failure reported above
                pass

    def end_stream(
        self,
        stream: ClientStream,
        attributes: Mapping[str, Any],
        *,
        error_type: str | None = None,
        cancelled: bool = False,
    ) -> None:
        """End the stream span now with the library's closing ``attributes`` (request count):
        ``cancelled`` -> ``error.type=cancelled`` without an error status (the application's
        choice); else ``error_type`` (the stream itself failed) -> ``error.type`` and status ERROR."""
        span = stream.span
        span.set_attributes(attributes)
        if cancelled:
            span.set_attribute(A.ERROR_TYPE, CANCELLED)
        elif error_type is not None:
            span.set_attribute(A.ERROR_TYPE, error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()

    def _emit(
        self, call: ClientCall, end_ns: int, error: BaseException | None, error_type: str | None, content_free: bool
    ) -> None:
        span = call.span
        start_time = getattr(span, "start_time", None)  # the SDK span's (epoch ns); absent on API spans
        start_ns = start_time if start_time else call.epoch_ns(call.start_mono)
        end_ns = max(end_ns, start_ns)
        if call.streaming:
            span.set_attribute(A.LLM_STREAM_RESPONSES, len(call.times))
            span.set_attribute(A.LLM_STREAM_END, call.end_reason)
            if call.times:
                self._token_stream(call, start_ns, end_ns, error_type)
        if error_type is not None:
            span.set_attribute(A.ERROR_TYPE, error_type)
            if error_type != CANCELLED:  # cancelling is the application's choice, not a failure
                detail = (
                    self._truncate(str(error))
                    if error is not None and (self.settings.capture_content or content_free)
                    else error_type
                )
                span.set_status(Status(StatusCode.ERROR, detail))
        span.end(end_time=end_ns)

    def _token_stream(self, call: ClientCall, start_ns: int, end_ns: int, error_type: str | None) -> None:
        """``llm.token_stream``: first -> last response the client received, clamped into the call span."""
        times = np.frombuffer(call.times, dtype=np.float64)
        clamp: Callable[[int], int] = lambda t: min(max(t, start_ns), end_ns)  # noqa: E731
        first_ns, last_ns = clamp(call.epoch_ns(times[0])), clamp(call.epoch_ns(times[-1]))
        attrs: dict[str, Any] = {
            A.LLM_STREAM_RESPONSES: len(times),
            A.LLM_TIME_TO_FIRST_TOKEN: max(0.0, float(times[0] - call.start_mono)),
            A.LLM_STREAM_END: call.end_reason,
        }
        gaps = np.diff(times, prepend=call.start_mono)  # gaps[0]: call -> first response
        if len(times) > 1:
            p50, p90, p99, mx = _percentiles(gaps[1:].tolist())
            attrs.update(
                {
                    A.LLM_STREAM_RESPONSE_GAP_P50: p50,
                    A.LLM_STREAM_RESPONSE_GAP_P90: p90,
                    A.LLM_STREAM_RESPONSE_GAP_P99: p99,
                    A.LLM_STREAM_RESPONSE_GAP_MAX: mx,
                }
            )
        n_ev = min(len(times), self.settings.token_events)
        attrs[A.LLM_TOKEN_EVENTS_DROPPED] = len(times) - n_ev
        if error_type is not None:
            attrs[A.ERROR_TYPE] = error_type
        span = self.tracer.start_span(
            S.LLM_TOKEN_STREAM,
            context=trace.set_span_in_context(call.span),
            kind=SpanKind.INTERNAL,
            start_time=first_ns,
            attributes=attrs,
        )
        for i in range(n_ev):
            span.add_event(
                S.EVENT_LLM_STREAM_RESPONSE,
                {A.LLM_STREAM_RESPONSE_INDEX: i, A.LLM_STREAM_RESPONSE_GAP: float(gaps[i])},
                timestamp=clamp(call.epoch_ns(times[i])),
            )
        if error_type is not None and error_type != CANCELLED:
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end(end_time=last_ns)
