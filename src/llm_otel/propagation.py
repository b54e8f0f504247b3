"""W3C ``traceparent``/``tracestate`` to and from engine carriers.

Inbound headers are validated before use: a malformed or oversized value is ignored with a debug
log line and the request becomes a new root - it is never an error for the request.

A *carrier* is the small ``{"traceparent": ..., "tracestate": ...}`` dict llm-otel puts on an
engine request (vLLM: ``SamplingParams.extra_args``) so engine-core and worker processes can
link to, or parent on, the request span.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE_CHARS = 512  # W3C: 32 list members; vendors cap the header around 512 bytes
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_PROPAGATOR = TraceContextTextMapPropagator()
SAMPLED_FLAG = 0x01  # W3C trace-flags: sampled
RANDOM_FLAG = 0x02  # W3C Trace Context Level 2 trace-flags: random-trace-id (low 56 bits random)
_KNOWN_FLAGS = SAMPLED_FLAG | RANDOM_FLAG


def _get(headers: Any, name: str) -> str | None:
    """Case-insensitive header lookup on dicts, Starlette Headers or lists of pairs."""
    try:
        value = headers.get(name)
        if value is None and isinstance(headers, Mapping):
            for k, v in headers.items():
                if isinstance(k, str) and k.lower() == name:
                    return v
        return value
    except Exception:  # noqa: BLE001 - silent: feature probe of a caller's header object: no carrier
        return None


def parse_traceparent(value: Any) -> SpanContext | None:
    """A remote SpanContext from a ``traceparent`` value, or None (with a debug log) if invalid.

    Accepts version 00 exactly and future versions with extra fields (W3C forward compatibility);
    rejects version ff, all-zero ids, upper-case hex and values over 512 characters. Of the
    trace-flags byte it keeps the two W3C Trace Context Level 2 flags, ``sampled`` (0x01) and
    ``random-trace-id`` (0x02: the trace id's low 56 bits are random, :data:`RANDOM_FLAG`), and
    clears the bits W3C leaves undefined, so that a child or an outbound ``traceparent`` of this
    trace carries the random flag exactly when the inbound one did.
    """
    if not isinstance(value, str) or len(value) > 512:
        logger.debug("llm-otel: ignoring malformed traceparent %.80r", value)
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if not m or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        logger.debug("llm-otel: ignoring malformed traceparent %.80r", value)
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        logger.debug("llm-otel: ignoring traceparent with zero ids %.80r", value)
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(m.group(4), 16) & _KNOWN_FLAGS))


def extract_carrier(headers: Any) -> dict[str, str] | None:
    """The valid ``traceparent`` (and ``tracestate``, if well-formed and not oversized) of inbound
    headers, or None. Never raises."""
    tp = _get(headers, TRACEPARENT)
    if tp is None or parse_traceparent(tp) is None:
        return None
    carrier = {TRACEPARENT: tp.strip()}
    ts = _get(headers, TRACESTATE)
    if isinstance(ts, str) and ts.strip():
        if len(ts) > MAX_TRACESTATE_CHARS:
            logger.debug("llm-otel: ignoring oversized tracestate (%d chars)", len(ts))
        else:
            carrier[TRACESTATE] = ts.strip()
    return carrier


def context_from_carrier(carrier: Mapping[str, str] | None) -> Context | None:
    """An OpenTelemetry Context whose current span is the carrier's remote parent, or None."""
    if not carrier:
        return None
    sc = parse_traceparent(carrier.get(TRACEPARENT))
    if sc is None:
        return None
    ts = carrier.get(TRACESTATE)
    if ts:
        try:
            problem = _tracestate_problem(ts)
            if problem is not None:
                # checked here: the API's parser logs a warning for every request that sends a bad
                # member or more than 32 (a client could flood the server's log) and drops the
                # whole header, as it does for a duplicate key (silently): one line per process here
                raise ValueError(problem)
            sc = SpanContext(sc.trace_id, sc.span_id, True, sc.trace_flags, TraceState.from_header([ts]))
        except Exception as exc:  # noqa: BLE001 - a caller's header, not our bug
            process_errors().bad_input(
                "propagation.tracestate", f"malformed tracestate ({exc}) {ts!r:.80}; the parent is kept without it"
            )
    return trace.set_span_in_context(trace.NonRecordingSpan(sc))


_MAX_TRACESTATE_MEMBERS = 32  # W3C trace-context: a tracestate list has at most 32 members


def _tracestate_problem(header: str) -> str | None:
    """Why a ``tracestate`` header is not W3C's, or None: a non-empty member that does not match the
    member grammar (the OpenTelemetry API's own pattern when it has one), a key twice, or more than
    32 members - each of which the API's parser answers by dropping the whole header."""
    pattern = _MEMBER
    keys: set[str] = set()
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        if pattern is not None:
            match = pattern.fullmatch(member)
            if match is None:
                return "a member is not key=value in W3C tracestate format"
            key = match.group(1)
        else:
            key = member.partition("=")[0]
        if key in keys:
            return "a key appears twice"
        keys.add(key)
        if len(keys) > _MAX_TRACESTATE_MEMBERS:
            return f"more than {_MAX_TRACESTATE_MEMBERS} members"
    return None


_MEMBER: re.Pattern[str] | None
try:  # the API's member grammar (opentelemetry.trace.span); without it its parser decides alone
    from opentelemetry.trace.span import _member_pattern

    _MEMBER = _member_pattern
except ImportError:  # silent: an API version without it falls back to its own parser
    _MEMBER = None


def carrier_from_span(span: trace.Span) -> dict[str, str]:
    """``traceparent``/``tracestate`` of a span, for engine request carriers: what W3C
    ``TraceContextTextMapPropagator.inject`` writes, formatted directly (once per request on the
    serving path, without building a context for the propagator). The trace-flags byte is the
    span's own: the SDK (1.42+) sets ``random-trace-id`` (0x02) on roots whose trace id its
    ``IdGenerator`` made at random and keeps the parent's on children; llm-otel's own tracer
    (:mod:`llm_otel.export.offload.recorder`) does the same."""
    sc = span.get_span_context()
    if sc == trace.INVALID_SPAN_CONTEXT:
        return {}
    carrier = {TRACEPARENT: f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}"}
    if sc.trace_state:
        carrier[TRACESTATE] = sc.trace_state.to_header()
    return carrier
