"""KV transfers between serving instances (prefill/decode disaggregation): the core API engine
adapters call - one ``llm.kv_transfer`` span per request and side, and the transfer metrics.

An adapter reads its engine's connector (vLLM's KV connector, LightLLM's transfer process) and
hands over plain values in a :class:`KVTransfer`; :meth:`KVTransfers.record` emits the span - a
child of the request's span on this instance, only when that span is sampled - and records
``llm.kv_transfer.duration`` and ``llm.kv_transfer.size`` for every transfer, sampled or not.
Nothing here blocks or raises into the engine: the adapter calls it under its hook guard.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode

from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.semconv import spans as S
from llm_otel.telemetry.bounds import MAX_ID_CHARS

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter
    from opentelemetry.trace import Tracer

SEND = "send"
RECEIVE = "receive"


@dataclasses.dataclass
class KVTransfer:
    """One request's KV transfer on one side, as the engine's connector reported it.

    Attributes:
        connector: the connector's name (vLLM: its class name, e.g. ``ExampleConnector``).
        direction: :data:`SEND` (prefill side) or :data:`RECEIVE` (decode side).
        start_ns / end_ns: epoch nanoseconds (``time.time_ns()``) the transfer began / ended.
        request_id: the engine's request id (cut to 256 characters on the span).
        parent: the SpanContext of the request's span on this instance, or a Context whose
            current span it is (None or unsampled: metrics only).
        tokens: prompt tokens whose KV moved (None: unknown).
        blocks: KV-cache blocks they cover (None: unknown).
        nbytes: bytes those tokens occupy in this engine's paged KV cache (None: unknown).
        remote_engine: the peer, as the request's transfer parameters name it (client input:
            cut to 256 characters, spans only).
        asynchronous: the transfer ran beside the engine's steps rather than inside one.
        role: the request's disaggregation role on this instance (``prefill`` / ``decode`` / ``both``).
        error_type: why the transfer failed (None: it completed).
        load_failure_policy: the engine's policy for failed loads, recorded with a failure.
    """

    connector: str
    direction: str
    start_ns: int
    end_ns: int
    request_id: str | None = None
    parent: SpanContext | Context | None = None
    tokens: int | None = None
    blocks: int | None = None
    nbytes: int | None = None
    remote_engine: str | None = None
    asynchronous: bool = False
    role: str | None = None
    error_type: str | None = None
    load_failure_policy: str | None = None


class KVTransfers:
    """Emits :class:`KVTransfer` records: spans for sampled requests, metrics for all.

    Metrics (semconv ``metric.llm.kv_transfer.*``): ``llm.kv_transfer.duration`` (s) and
    ``llm.kv_transfer.size`` (By), with ``llm.kv_transfer.connector``, ``llm.kv_transfer.direction``
    and ``error.type`` on failures - bounded: the connector is a class name of the engine's
    configuration, never client input.
    """

    def __init__(self, tracer: Tracer, meter: Meter) -> None:
        self.tracer = tracer
        self.duration = meter.create_histogram(
            M.LLM_KV_TRANSFER_DURATION,
            unit=M.LLM_KV_TRANSFER_DURATION_UNIT,
            description="Duration of each request's KV transfer on this instance.",
            explicit_bucket_boundaries_advisory=list(M.LLM_KV_TRANSFER_DURATION_BUCKETS),
        )
        self.size = meter.create_histogram(
            M.LLM_KV_TRANSFER_SIZE,
            unit=M.LLM_KV_TRANSFER_SIZE_UNIT,
            description="KV-cache bytes of each request's transfer on this instance.",
            explicit_bucket_boundaries_advisory=list(M.LLM_KV_TRANSFER_SIZE_BUCKETS),
        )

    @staticmethod
    def on_step(span: Span, role: str | None, receive_s: float, send_s: float, completed: int) -> None:
        """The step span's disaggregation part: the instance's ``role`` and, when non-zero, the
        seconds the worker spent in the connector's load / save calls during the step and the
        transfers completed in it (``llm.engine.step.kv_transfer.*``)."""
        if role is not None:
            span.set_attribute(A.LLM_DISAGGREGATION_ROLE, role)
        if receive_s:
            span.set_attribute(A.LLM_ENGINE_STEP_KV_TRANSFER_RECEIVE_TIME, receive_s)
        if send_s:
            span.set_attribute(A.LLM_ENGINE_STEP_KV_TRANSFER_SEND_TIME, send_s)
        if completed:
            span.set_attribute(A.LLM_ENGINE_STEP_KV_TRANSFER_REQUESTS, completed)

    def record(self, t: KVTransfer) -> None:
        """Record one transfer: metrics always; the span when ``t.parent`` is sampled."""
        if isinstance(t.parent, Context):  # an adapter's parent context: its current span's
            t.parent = trace.get_current_span(t.parent).get_span_context()
        end_ns = max(t.end_ns, t.start_ns)
        dims: dict[str, str] = {A.LLM_KV_TRANSFER_CONNECTOR: t.connector, A.LLM_KV_TRANSFER_DIRECTION: t.direction}
        if t.error_type is not None:
            dims[A.ERROR_TYPE] = t.error_type
        self.duration.record((end_ns - t.start_ns) / 1e9, dims)
        if t.nbytes is not None:
            self.size.record(t.nbytes, dims)
        if t.parent is None or not t.parent.trace_flags.sampled:
            return
        attrs: dict[str, Any] = {
            A.LLM_KV_TRANSFER_CONNECTOR: t.connector,
            A.LLM_KV_TRANSFER_DIRECTION: t.direction,
            A.LLM_KV_TRANSFER_ASYNCHRONOUS: t.asynchronous,
        }
        for key, value in (
            (A.LLM_KV_TRANSFER_TOKENS, t.tokens),
            (A.LLM_KV_TRANSFER_BLOCKS, t.blocks),
            (A.LLM_KV_TRANSFER_BYTES, t.nbytes),
            (A.LLM_DISAGGREGATION_ROLE, t.role),
        ):
            if value is not None:
                attrs[key] = value
        if t.remote_engine:
            attrs[A.LLM_KV_TRANSFER_REMOTE_ENGINE] = t.remote_engine[:MAX_ID_CHARS]
        if t.request_id is not None:
            attrs[A.LLM_REQUEST_ID] = t.request_id[:MAX_ID_CHARS]
        if t.error_type is not None:
            attrs[A.ERROR_TYPE] = t.error_type
            if t.load_failure_policy is not None:
                attrs[A.LLM_KV_TRANSFER_LOAD_FAILURE_POLICY] = t.load_failure_policy
        span = self.tracer.start_span(
            S.LLM_KV_TRANSFER,
            context=trace.set_span_in_context(NonRecordingSpan(t.parent)),
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            start_time=t.start_ns,
        )
        if t.error_type is not None:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end_ns)
