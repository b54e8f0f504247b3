"""The core's client calls (``telemetry/client.py``) on their own, without a client library: the
span tree, times, status rules and GenAI client metrics that the Triton adapter gets from it.
tests/test_triton.py checks the same through real tritonclient calls against a real tritonserver."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_captured
from opentelemetry.trace import SpanKind, StatusCode

from llm_otel.config import Settings
from llm_otel.telemetry.client import CANCELLED, ClientCalls

SERVER = {"server.address": "127.0.0.1", "server.port": 8001}


def calls_of(cap) -> ClientCalls:
    return cap.telemetry.client_calls("triton")


def by_name(cap, name: str) -> list:
    return [s for s in cap.finished() if s.name == name]


def test_streamed_call_builds_token_stream_from_the_response_times():
    cap = make_captured()
    calls = calls_of(cap)
    call = calls.start(
        operation="text_completion",
        model="m",
        server=SERVER,
        attributes={"llm.triton.client": "grpc", "gen_ai.request.max_tokens": 5},
        request_id="r1",
        streaming=True,
    )
    offsets = [0.1, 0.15, 0.3, 0.32, 0.5]  # seconds after the call started
    for dt in offsets:
        call.on_response(call.start_mono + dt)
    calls.finish(call, end_reason="final_flag", end_mono=call.start_mono + 0.5)

    (span,) = by_name(cap, "text_completion m")
    assert span.kind is SpanKind.CLIENT and span.status.status_code is StatusCode.UNSET
    a = span.attributes
    assert (a["gen_ai.provider.name"], a["gen_ai.request.model"], a["gen_ai.operation.name"]) == (
        "triton",
        "m",
        "text_completion",
    )
    assert a["llm.request.id"] == "r1" and a["gen_ai.request.stream"] is True and a["server.port"] == 8001
    assert a["llm.stream.responses"] == 5 and a["llm.stream.end"] == "final_flag"
    (ts,) = by_name(cap, "llm.token_stream")
    assert ts.parent.span_id == span.context.span_id
    assert ts.start_time == call.epoch_ns(call.start_mono + 0.1) and ts.end_time == call.epoch_ns(call.start_mono + 0.5)
    assert ts.attributes["llm.time_to_first_token"] == pytest.approx(0.1)
    gaps = np.diff(offsets)
    for q, key in ((50, "p50"), (90, "p90"), (99, "p99")):
        assert ts.attributes[f"llm.stream.response_gap.{key}"] == pytest.approx(np.percentile(gaps, q))
    assert ts.attributes["llm.stream.response_gap.max"] == pytest.approx(gaps.max())
    # the first LLM_OTEL_TOKEN_EVENTS (4) responses are events; the rest are counted
    assert [e.attributes["llm.stream.response.index"] for e in ts.events] == [0, 1, 2, 3]
    assert [e.attributes["llm.stream.response.gap"] for e in ts.events] == pytest.approx([0.1, 0.05, 0.15, 0.02])
    assert ts.attributes["llm.token.events.dropped"] == 1

    def points(name):
        return [p for p in cap.metric_points(name) if p.attributes.get("gen_ai.request.model") == "m"]

    (duration,) = points("gen_ai.client.operation.duration")
    assert duration.count == 1 and duration.sum == pytest.approx(0.5)
    assert duration.attributes == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "triton",
        "gen_ai.request.model": "m",
        **SERVER,
    }
    (first,) = points("gen_ai.client.operation.time_to_first_chunk")
    assert first.count == 1 and first.sum == pytest.approx(0.1)
    (per_chunk,) = points("gen_ai.client.operation.time_per_output_chunk")
    assert per_chunk.count == 4 and per_chunk.sum == pytest.approx(0.4)


def test_error_message_goes_on_the_span_only_with_content_capture_or_when_content_free():
    for capture, content_free, expected in (
        (False, False, "500"),
        (False, True, "no outputs"),
        (True, False, "no outputs"),
    ):
        cap = make_captured(Settings.from_env({"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": str(capture)}))
        calls = calls_of(cap)
        call = calls.start(operation="infer", model="m", server={}, attributes={})
        calls.finish(call, error=RuntimeError("no outputs"), error_type="500", content_free=content_free)
        (span,) = by_name(cap, "infer m")
        assert span.status.status_code is StatusCode.ERROR and span.status.description == expected
        assert span.attributes["error.type"] == "500"
        assert not by_name(cap, "llm.token_stream")  # unary: no response times
        (point,) = cap.metric_points("gen_ai.client.operation.duration")
        assert point.attributes["error.type"] == "500"
        assert not cap.metric_points("gen_ai.client.operation.time_to_first_chunk")


def test_cancelled_call_and_stream_record_the_type_without_an_error_status():
    cap = make_captured()
    calls = calls_of(cap)
    stream = calls.start_stream("llm.triton.stream", {"llm.triton.client": "grpc"})
    call = calls.start(
        operation="text_completion", model="m", server={}, attributes={}, request_id="r", streaming=True, stream=stream
    )
    call.on_response()
    calls.finish(call, error=RuntimeError("stopped"), error_type=CANCELLED, end_reason="cancelled")
    calls.end_stream(stream, {"llm.triton.stream.requests": 1}, error_type="UNAVAILABLE", cancelled=True)
    (span,) = by_name(cap, "text_completion m")
    (ts,) = by_name(cap, "llm.token_stream")
    (stream_span,) = by_name(cap, "llm.triton.stream")
    for s in (span, ts, stream_span):
        assert s.attributes["error.type"] == CANCELLED and s.status.status_code is StatusCode.UNSET
    assert span.attributes["llm.stream.end"] == "cancelled"
    assert stream_span.kind is SpanKind.CLIENT and stream_span.attributes["llm.triton.stream.requests"] == 1
    assert stream_span.attributes["gen_ai.provider.name"] == "triton"


def test_stream_requests_parent_on_the_caller_else_the_stream_and_always_link_it():
    cap = make_captured()
    calls = calls_of(cap)
    stream = calls.start_stream("llm.triton.stream", {})
    bare = calls.start(operation="infer", model="a", server={}, attributes={}, streaming=True, stream=stream)
    with cap.tracer_provider.get_tracer("app").start_as_current_span("app") as app:
        nested = calls.start(operation="infer", model="b", server={}, attributes={}, streaming=True, stream=stream)
        # while a call's span is current, the carrier is its context
        with calls.use(nested):
            carrier = calls.carrier(nested)
    for call in (bare, nested, bare):  # a second finish is ignored
        calls.finish(call)
    calls.end_stream(stream, {}, error_type="UNAVAILABLE")
    (stream_span,) = by_name(cap, "llm.triton.stream")
    (a,) = by_name(cap, "infer a")
    (b,) = by_name(cap, "infer b")
    assert a.parent.span_id == stream_span.context.span_id
    assert b.parent.span_id == app.get_span_context().span_id
    for s in (a, b):
        assert [link.context.span_id for link in s.links] == [stream_span.context.span_id]
        assert s.attributes["llm.stream.end"] == "stream_end" and s.attributes["llm.stream.responses"] == 0
    assert (
        carrier["traceparent"]
        == f"00-{b.context.trace_id:032x}-{b.context.span_id:016x}-{int(b.context.trace_flags):02x}"
    )
    assert stream_span.status.status_code is StatusCode.ERROR and stream_span.attributes["error.type"] == "UNAVAILABLE"
    (point,) = [
        p for p in cap.metric_points("gen_ai.client.operation.duration") if p.attributes["gen_ai.request.model"] == "a"
    ]
    assert point.count == 1


def test_requests_on_a_stream_are_matched_by_id_until_they_finish():
    """A stream's responses find their request by the id the server echoes (oldest first for a
    repeated id; the only request in flight whatever the id); a finished request is no longer in
    flight; the stream's end drains what is left."""
    cap = make_captured()
    calls = calls_of(cap)
    stream = calls.start_stream("llm.triton.stream", {})

    def start(rid):
        return calls.start(
            operation="infer", model="m", server={}, attributes={}, request_id=rid, streaming=True, stream=stream
        )

    only = start("a")
    assert stream.lookup("a") is only and stream.lookup("unknown") is only  # the only one in flight
    first, second, other = start("r"), start("r"), start("x")
    assert stream.requests == 4
    assert stream.lookup("r") is first and stream.lookup("x") is other
    assert stream.lookup("unknown") is None  # several in flight: an unknown id is no one's
    calls.finish(first)
    assert stream.lookup("r") is second
    calls.finish(first)  # a second finish changes nothing
    assert stream.lookup("r") is second
    stream.remove(first)  # removing what is not in flight is harmless
    assert sorted(c.request_id for c in stream.drain()) == ["a", "r", "x"]
    assert stream.drain() == [] and stream.lookup("r") is None and stream.requests == 4
    for call in (only, second, other):
        calls.finish(call)  # drained calls still end once
    assert len(by_name(cap, "infer m")) == 4


def test_a_calls_headers_are_a_copy_with_its_trace_context_in_place_of_any_other():
    cap = make_captured()
    calls = calls_of(cap)
    call = calls.start(operation="infer", model="m", server={}, attributes={})
    theirs = {"Traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "TRACESTATE": "x=y", "x-user": "u", 7: "n"}
    before = dict(theirs)
    out = calls.headers_with_context(theirs, call)
    assert theirs == before  # the caller's dict is never modified
    assert out == {"x-user": "u", 7: "n", **calls.carrier(call)}
    assert out["traceparent"].split("-")[1] == format(call.span.get_span_context().trace_id, "032x")
    assert calls.headers_with_context(None, call) == calls.carrier(call)
    calls.finish(call)
