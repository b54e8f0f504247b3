"""Hypothesis properties of what llm-otel parses from a client: ``traceparent`` and ``tracestate``
(llm_otel.propagation), the ``ot=th`` sampling threshold a remote parent's tracestate carries
(read by the adaptive sampler), and request-class headers (llm_otel.signals.classes). For any
input: nothing raises, a malformed value is a safe no-op with at most one log line, a well-formed
one round-trips, and what comes out is bounded. (llm-otel reads no ``baggage``: the W3C baggage
propagator is OpenTelemetry's own, and no llm-otel code takes a value from it.)"""

from __future__ import annotations

import contextlib
import logging
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace._sampling_experimental._trace_state import OtelTraceState
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from support.pollers import idle_poller

from llm_otel.config.classes import CLASS_VALUE
from llm_otel.errors import _reset_for_tests
from llm_otel.propagation import (
    MAX_TRACESTATE_CHARS,
    TRACEPARENT,
    TRACESTATE,
    carrier_from_span,
    context_from_carrier,
    extract_carrier,
    parse_traceparent,
)
from llm_otel.sampling import UtilizationPolicy, adaptive_sampler
from llm_otel.signals.classes import OTHER, ClassExtractor

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HEX = "0123456789abcdef"
TRACE_ID = st.text(HEX, min_size=32, max_size=32).filter(lambda s: s.strip("0"))
SPAN_ID = st.text(HEX, min_size=16, max_size=16).filter(lambda s: s.strip("0"))
FLAGS = st.sampled_from(["00", "01"])
# tracestate member grammar (W3C trace-context, "list-member"): simple and multi-tenant keys,
# values of printable ASCII without ',' and '=' and not ending in a space
KEY = st.from_regex(r"[a-z][a-z0-9_\-*/]{0,20}(@[a-z][a-z0-9_\-*/]{0,10})?", fullmatch=True)
VALUE = st.from_regex(r"[\x21-\x2b\x2d-\x3c\x3e-\x7e]{1,20}", fullmatch=True)
# what a hostile client sends: any text, near-misses of the grammar, huge and control characters
HOSTILE = st.one_of(
    st.text(max_size=600),
    st.text(alphabet="0123456789abcdefABCDEF-,=;: \t\x00xyz", max_size=120),
    st.builds(lambda n, c: c * n, st.integers(0, 5000), st.sampled_from(["a", "-", "=", ",", "0"])),
)


@contextlib.contextmanager
def log_records():
    """Every log record llm-otel or the OpenTelemetry API/SDK emits inside the block (any level)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(logging.DEBUG)
    loggers = [logging.getLogger(name) for name in ("llm_otel", "opentelemetry")]
    saved = [(lg, lg.level) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg, level in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)


def remote(carrier) -> SpanContext | None:
    ctx = context_from_carrier(carrier)
    return None if ctx is None else trace.get_current_span(ctx).get_span_context()


# --- traceparent --------------------------------------------------------------------------------
@PROPERTY
@given(st.one_of(HOSTILE, st.none(), st.integers(), st.binary(max_size=80), st.lists(st.text(max_size=5))))
def test_any_traceparent_value_parses_or_is_one_debug_line_and_none(value):
    with log_records() as records:
        sc = parse_traceparent(value)
    assert len(records) <= 1 and all(r.levelno == logging.DEBUG for r in records)
    if sc is None:
        return
    assert isinstance(value, str) and len(value) <= 512
    assert 0 < sc.trace_id < 2**128 and 0 < sc.span_id < 2**64 and sc.is_remote
    assert int(sc.trace_flags) in (0, 1)  # only the sampled flag is taken


@PROPERTY
@given(TRACE_ID, SPAN_ID, FLAGS)
def test_a_well_formed_traceparent_round_trips_through_a_carrier(trace_id, span_id, flags):
    value = f"00-{trace_id}-{span_id}-{flags}"
    sc = parse_traceparent(value)
    assert (sc.trace_id, sc.span_id, int(sc.trace_flags)) == (int(trace_id, 16), int(span_id, 16), int(flags, 16))
    assert extract_carrier({"TraceParent": f" {value} "}) == {TRACEPARENT: value}
    assert carrier_from_span(NonRecordingSpan(sc)) == {TRACEPARENT: value}


@PROPERTY
@given(st.integers(1, 254), TRACE_ID, SPAN_ID, st.text(HEX, min_size=2, max_size=2), st.text(max_size=40))
def test_a_future_version_with_extra_fields_keeps_the_ids(version, trace_id, span_id, flags, extra):
    extra = "".join(c for c in extra if c.isprintable() and c.isascii())
    sc = parse_traceparent(f"{version:02x}-{trace_id}-{span_id}-{flags}-{extra}")
    assert (sc.trace_id, sc.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert int(sc.trace_flags) == int(flags, 16) & 0x03  # W3C Level 2: sampled and random-trace-id


# --- tracestate ----------------------------------------------------------------------------------
@PROPERTY
@given(
    st.dictionaries(
        st.sampled_from(["traceparent", "TRACEPARENT", "tracestate", "TraceState", "x-other"]),
        st.one_of(HOSTILE, st.none(), st.integers()),
        max_size=5,
    ),
    TRACE_ID,
    SPAN_ID,
)
def test_any_headers_give_a_bounded_carrier_or_none_and_never_raise(headers, trace_id, span_id):
    if headers.get("traceparent") == "valid":
        headers["traceparent"] = f"00-{trace_id}-{span_id}-01"
    with log_records() as records:
        carrier = extract_carrier(headers)
        sc = remote(carrier)
    assert len(records) <= 2  # at most one line each for the traceparent and the tracestate
    if carrier is None:
        assert sc is None
        return
    assert set(carrier) <= {TRACEPARENT, TRACESTATE} and len(carrier[TRACEPARENT]) <= 512
    assert len(carrier.get(TRACESTATE, "")) <= MAX_TRACESTATE_CHARS
    assert sc is not None and sc.is_valid and len(sc.trace_state) <= 32


MEMBER = st.tuples(KEY, VALUE).map("=".join)


@PROPERTY
@given(TRACE_ID, SPAN_ID, st.one_of(st.lists(st.one_of(HOSTILE, MEMBER), max_size=60), st.lists(MEMBER, max_size=60)))
def test_any_tracestate_keeps_the_parent_and_logs_at_most_one_line_per_process(trace_id, span_id, members):
    """Hostile tracestates (bad members, duplicate keys, more than 32 members): the parent is kept,
    its tracestate is the header's or empty, and the whole run logs at most one line (llm-otel's
    once-per-site line; never the OpenTelemetry API's warning per request)."""
    _reset_for_tests()
    header = ",".join(members)
    traceparent = f"00-{trace_id}-{span_id}-01"
    with log_records() as records:
        for _ in range(3):  # the same client, again and again
            sc = remote({TRACEPARENT: traceparent, TRACESTATE: header})
    assert (sc.trace_id, sc.span_id) == (int(trace_id, 16), int(span_id, 16))
    assert len(sc.trace_state) <= 32
    assert len([r for r in records if r.levelno >= logging.INFO]) <= 1, [r.getMessage() for r in records]
    assert not [r for r in records if not r.name.startswith("llm_otel")], [r.getMessage() for r in records]


@PROPERTY
@given(
    TRACE_ID,
    SPAN_ID,
    st.dictionaries(KEY, VALUE, min_size=1, max_size=32),
    st.sampled_from([", ", ",", " ,\t"]),
)
def test_a_well_formed_tracestate_round_trips(trace_id, span_id, entries, separator):
    header = separator.join(f"{k}={v}" for k, v in entries.items())
    with log_records() as records:
        sc = remote({TRACEPARENT: f"00-{trace_id}-{span_id}-01", TRACESTATE: header})
    assert dict(sc.trace_state.items()) == entries
    assert carrier_from_span(NonRecordingSpan(sc))[TRACESTATE] == ",".join(f"{k}={v}" for k, v in entries.items())
    assert records == []


# --- ot=th: the sampling threshold of a remote parent ------------------------------------------


SAMPLER = adaptive_sampler(UtilizationPolicy(), poller=idle_poller())
OT_VALUE = st.one_of(
    st.from_regex(r"th:[0-9a-f]{1,14}", fullmatch=True),
    st.from_regex(r"(th|rv):[\x21-\x2b\x2d-\x3a\x3c\x3e-\x7e]{0,20}(;[a-z]{1,3}:[a-z0-9]{0,5}){0,3}", fullmatch=True),
    VALUE,
)


@PROPERTY
@given(
    st.integers(1, 2**128 - 1),
    st.integers(1, 2**64 - 1),
    st.booleans(),
    OT_VALUE,
    st.dictionaries(KEY, VALUE, max_size=4),
    st.booleans(),
)
def test_any_ot_value_of_a_remote_parent_gives_a_decision_and_a_bounded_well_formed_ot(
    trace_id, span_id, sampled, ot, others, random_flag
):
    entries = [("ot", ot)] + [(k, v) for k, v in others.items() if k != "ot"]
    flags = TraceFlags(int(sampled) | (0x02 if random_flag else 0))
    parent = SpanContext(trace_id, span_id, True, flags, TraceState(entries))
    ctx = trace.set_span_in_context(NonRecordingSpan(parent))
    with log_records() as records:
        result = SAMPLER.should_sample(ctx, trace_id, "text_completion m")
    assert result.decision in (Decision.DROP, Decision.RECORD_AND_SAMPLE)
    assert not [r for r in records if r.levelno >= logging.WARNING]
    state = result.trace_state
    assert state is None or (len(state) <= 32 and len(state.to_header()) <= 512)
    out = state.get("ot") if state is not None else None
    if out is not None and out != ot:  # a client's own ot value passes through as the W3C says
        assert len(out) <= 256
        for member in out.split(";"):  # what the sampler writes is well-formed
            if member.startswith("th:"):
                assert re.fullmatch(r"[0-9a-f]{1,14}", member[3:]), out
    # the child follows its parent's sampled flag, whatever the ot value (OTEP 235 parent-based)
    assert (result.decision == Decision.RECORD_AND_SAMPLE) == sampled
    th = re.fullmatch(r"th:([0-9a-f]{1,14})", ot)
    if sampled and th:  # the parent's threshold is kept iff checkable randomness passes it
        threshold = int(th.group(1), 16) << (4 * (14 - len(th.group(1))))
        passes = threshold == 0 or (random_flag and (trace_id & (2**56 - 1)) >= threshold)  # no rv here
        assert OtelTraceState.parse(state).threshold == (threshold if passes else -1), (ot, state)


# --- request-class headers ----------------------------------------------------------------------
@PROPERTY
@given(
    st.lists(st.tuples(st.sampled_from(["x-tenant-id", "X-Tenant-ID", "x-priority", "x-other"]), HOSTILE), max_size=6),
    st.lists(st.text(max_size=12), max_size=4),
)
def test_any_class_headers_give_bounded_values_and_labels(headers, tenants):
    extractor = ClassExtractor({"tenant": "x-tenant-id", "priority": "x-priority"}, max_values=3, max_len=32)
    labels_seen: dict[str, set[str]] = {"tenant": set(), "priority": set()}
    with log_records() as records:
        for request in [headers] + [[("x-tenant-id", t)] for t in tenants]:
            values, labels = extractor.extract(request)
            for dim, value in values.items():
                assert value == OTHER or (len(value) <= 32 and CLASS_VALUE.fullmatch(value)), value
                assert labels[dim] in (value, OTHER)
                labels_seen[dim].add(labels[dim])
    assert all(len(seen - {OTHER}) <= 3 for seen in labels_seen.values())
    assert records == []


@PROPERTY
@given(st.text(alphabet=st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=32))
def test_a_well_formed_class_value_is_kept_as_sent(value):
    extractor = ClassExtractor({"tenant": "x-tenant-id"}, max_values=3, max_len=32)
    assert extractor.extract({"X-Tenant-Id": f"  {value} "}) == ({"tenant": value}, {"tenant": value})
