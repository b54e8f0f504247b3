"""Clock domains and the frontend / engine-input split (issue 16, llm_otel.telemetry.clock).

The engine core stamps events and outputs with its host's ``time.monotonic()``; the frontend
hands requests over and reads outputs on its own. Here the engine's clock is the frontend's plus
a shift (0 on one host, a day for an engine core on another host) and the messages carry the
delays a real hand-over has."""

from __future__ import annotations

import logging

import pytest
from conftest import make_captured

from llm_otel.telemetry.clock import TOLERANCE_S, EngineClock

ARRIVAL = 1_700_000_000.0  # frontend wall-clock s
OFFSET_NS = 1_699_990_000 * 10**9  # frontend: epoch_ns = mono_s * 1e9 + OFFSET_NS (mono 10_000 s at ARRIVAL)
DAY = 86_400.0


def fmono(wall_s: float) -> float:
    """The frontend's monotonic reading at a wall time."""
    return wall_s - OFFSET_NS / 1e9


def run(
    cap,
    shift_s: float,
    *,
    frontend_s=0.004,
    input_wait_s=2.0,
    queue_s=0.003,
    prefill_s=0.040,
    itl_s=0.010,
    tokens=4,
    transit_s=0.0005,
):
    """One request: handed over ``frontend_s`` after arrival, QUEUED by the engine ``input_wait_s``
    later (it was inside a long step), then queue, prefill and decode; engine stamps on a clock
    ``shift_s`` ahead of the frontend's, outputs read ``transit_s`` after the engine stamped them.
    Returns (record, spans by name)."""
    clock = EngineClock()
    rec = cap.telemetry.start_request(
        "r1", operation="text_completion", provider="vllm", model="tiny", arrival_s=ARRIVAL, input_tokens=5
    )
    rec.mono_offset_ns = OFFSET_NS
    rec.engine_clock = clock
    handed = ARRIVAL + frontend_s
    rec.handed_s, rec.handed_mono = handed, fmono(handed)
    queued = handed + input_wait_s
    clock.observe_queued(rec.handed_mono, fmono(queued) + shift_s)
    rec.on_event("queued", fmono(queued) + shift_s)
    rec.on_event("scheduled", fmono(queued + queue_s) + shift_s)
    t = queued + queue_s + prefill_s
    for i in range(tokens):
        clock.observe_output(fmono(t) + shift_s, fmono(t + transit_s))
        rec.on_tokens([10 + i], fmono(t) + shift_s)
        t += itl_s
    rec.finish_reason = "length"
    cap.telemetry.finish(rec, end_ns=round((t + 0.001) * 1e9))
    return rec, {s.name: s for s in cap.finished()}


def test_one_host_stamps_are_used_unchanged():
    cap = make_captured()
    rec, spans = run(cap, shift_s=0.0)
    p = spans["llm.prompt"].attributes
    assert rec.engine_clock.same_domain and rec.engine_clock.offset_s() == 0.0
    assert p["llm.request.timing.source"] == "engine_events"
    assert p["llm.request.frontend.duration"] == pytest.approx(0.004, abs=1e-6)
    assert p["llm.request.engine_input_wait.duration"] == pytest.approx(2.0, abs=1e-6)
    ttft = spans["llm.token_stream"].attributes["llm.time_to_first_token"]
    assert ttft == pytest.approx(0.004 + 2.0 + 0.003 + 0.040, abs=1e-6)


def test_frontend_duration_is_frontend_work_not_the_wait_behind_a_long_engine_step():
    """The demo's 'frontend=2005ms' for requests that waited behind a compiling step: the wait is
    the engine's input wait now, the frontend's own share stays milliseconds."""
    cap = make_captured()
    _, spans = run(cap, shift_s=0.0, frontend_s=0.0237, input_wait_s=1.98)
    p = spans["llm.prompt"].attributes
    assert p["llm.request.frontend.duration"] == pytest.approx(0.0237, abs=1e-6)
    assert p["llm.request.engine_input_wait.duration"] == pytest.approx(1.98, abs=1e-6)
    assert p["llm.request.queue.duration"] == pytest.approx(0.003, abs=1e-6)


@pytest.mark.parametrize("shift_s", [DAY, -DAY])
def test_engine_clock_a_day_off_is_detected_and_mapped(shift_s, caplog):
    cap = make_captured()
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        rec, spans = run(cap, shift_s=shift_s)
    clock = rec.engine_clock
    assert not clock.same_domain
    # d is bounded by the hand-over (input wait) and the output transit: the estimate is within them
    assert clock.lo <= clock.offset_s() <= clock.hi
    assert abs(clock.offset_s() - shift_s) <= 2.0
    assert "engine core's clock is not this frontend's" in caplog.text
    p, stream = spans["llm.prompt"].attributes, spans["llm.token_stream"].attributes
    assert p["llm.request.timing.source"] == "engine_clock_mapped"
    # intervals on one clock stay exact
    assert p["llm.request.frontend.duration"] == pytest.approx(0.004, abs=1e-6)
    assert p["llm.request.queue.duration"] == pytest.approx(0.003, abs=1e-6)
    assert p["llm.request.prefill.duration"] == pytest.approx(0.040, abs=1e-6)
    assert stream["llm.time_per_output_token"] == pytest.approx(0.010, abs=1e-6)
    # mixed intervals: no hours-long or zero TTFT, off by at most the bounds' width
    true_ttft = 0.004 + 2.0 + 0.003 + 0.040
    assert abs(stream["llm.time_to_first_token"] - true_ttft) <= clock.hi - clock.lo
    root = spans["text_completion tiny"]
    first = [e for e in spans["llm.token_stream"].events][0] if spans["llm.token_stream"].events else None
    assert root.start_time <= spans["llm.token_stream"].start_time <= root.end_time
    assert first is None or first.timestamp >= root.start_time


def test_small_shift_inside_the_message_delays_is_one_domain():
    """A shift the message delays cannot reveal is also one no interval can be wrong by more than."""
    clock = EngineClock()
    clock.observe_queued(100.0, 100.0005)  # handed, queued 0.5 ms later
    clock.observe_output(100.010, 100.0101)  # read 0.1 ms after stamping
    assert clock.same_domain and clock.offset_s() == 0.0
    clock.observe_output(100.020 + 10 * TOLERANCE_S, 100.020)  # an output "from the future"
    assert not clock.same_domain


def test_outputs_alone_bound_the_offset_when_no_queued_event_came():
    clock = EngineClock()
    clock.observe_output(5000.0, 10.0)
    assert not clock.same_domain and clock.offset_s() == pytest.approx(4990.0)
