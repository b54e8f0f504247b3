"""W3C trace context from inbound headers: valid values are used, anything else ignored."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from llm_otel.propagation import carrier_from_span, context_from_carrier, extract_carrier, parse_traceparent

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_valid_traceparent_and_tracestate_are_kept_case_insensitively():
    carrier = extract_carrier({"TraceParent": f"00-{TID}-{SID}-01", "tracestate": "vendor=probe,ot=th:8"})
    assert carrier == {"traceparent": f"00-{TID}-{SID}-01", "tracestate": "vendor=probe,ot=th:8"}
    sc = trace.get_current_span(context_from_carrier(carrier)).get_span_context()
    assert (f"{sc.trace_id:032x}", f"{sc.span_id:016x}", sc.is_remote, sc.trace_flags.sampled) == (TID, SID, True, True)
    assert sc.trace_state.get("ot") == "th:8"


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "",
        None,
        42,
        f"00-{'0' * 32}-{SID}-01",
        f"00-{TID}-{'0' * 16}-01",
        f"00-{TID.upper()}-{SID}-01",
        f"ff-{TID}-{SID}-01",
        f"00-{TID}-{SID}-01-extra",
        f"00-{TID}-{SID}",
        "00-" + "a" * 1000,
    ],
)
def test_malformed_traceparent_is_ignored(value):
    assert parse_traceparent(value) is None
    assert extract_carrier({"traceparent": value}) is None


def test_future_versions_with_extra_fields_are_accepted():
    assert parse_traceparent(f"01-{TID}-{SID}-01-whatever") is not None


def test_oversized_or_broken_tracestate_is_dropped_but_the_parent_kept():
    carrier = extract_carrier({"traceparent": f"00-{TID}-{SID}-00", "tracestate": "x" * 5000})
    assert carrier == {"traceparent": f"00-{TID}-{SID}-00"}
    sc = trace.get_current_span(context_from_carrier(carrier)).get_span_context()
    assert not sc.trace_flags.sampled


def test_carrier_from_span_round_trips():
    span = TracerProvider().get_tracer("t").start_span("s")
    carrier = carrier_from_span(span)
    sc = parse_traceparent(carrier["traceparent"])
    assert sc.trace_id == span.get_span_context().trace_id and sc.span_id == span.get_span_context().span_id


@pytest.mark.parametrize("state", [[], [("vendor", "probe"), ("ot", "th:8")]])
@pytest.mark.parametrize("flags", [0, 1])
def test_carrier_from_span_writes_what_the_w3c_propagator_injects(state, flags):
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    spans = [
        NonRecordingSpan(SpanContext(int(TID, 16), int(SID, 16), False, TraceFlags(flags), TraceState(state))),
        trace.INVALID_SPAN,
    ]
    for span in spans:
        expected: dict = {}
        TraceContextTextMapPropagator().inject(expected, context=trace.set_span_in_context(span))
        assert carrier_from_span(span) == expected


def test_a_malformed_tracestate_is_one_log_line_not_one_per_request(caplog):
    """Fresh-install review of issue 21: the API's tracestate parser logged a warning echoing the
    bad member for every request, so a client could flood the server's log; the parent is kept
    without the tracestate, as the API's parser would have done."""
    import logging

    from opentelemetry import trace as otel_trace

    from llm_otel.propagation import context_from_carrier, extract_carrier

    caplog.set_level(logging.DEBUG)
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=" + "b" * 300}
    for _ in range(5):
        ctx = context_from_carrier(extract_carrier(headers))
        sc = otel_trace.get_current_span(ctx).get_span_context()
        assert sc.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and not sc.trace_state
    echoes = [r for r in caplog.records if "bbbbbbbbbb" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(echoes) <= 1, [r.getMessage()[:120] for r in echoes]


@pytest.mark.parametrize(
    "tracestate, why",
    [
        (",".join(f"k{i}=v" for i in range(33)), "more than 32 members"),  # 230 characters: not oversized
        ("a=1,b=2,a=3", "a key appears twice"),
    ],
)
def test_a_tracestate_the_api_would_drop_is_one_llm_otel_line_per_process_not_an_api_warning_per_request(
    tracestate, why, caplog
):
    """Found by tests/test_propagation_properties.py: 33 members made the OpenTelemetry API log a
    warning on every request that sent them (and drop the header); a duplicate key was dropped
    without a word. Both now keep the parent without the tracestate, one llm-otel line per process."""
    caplog.set_level(logging.DEBUG)
    carrier = extract_carrier({"traceparent": f"00-{TID}-{SID}-01", "tracestate": tracestate})
    assert carrier["tracestate"] == tracestate  # within the size bound: handed on, judged on use
    for _ in range(3):
        sc = trace.get_current_span(context_from_carrier(carrier)).get_span_context()
        assert (f"{sc.trace_id:032x}", len(sc.trace_state)) == (TID, 0)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and why in lines[0] and lines[0].startswith("llm-otel:"), lines
