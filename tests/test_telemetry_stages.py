"""Stage spans built by the core (telemetry/stages.py) from StageRecords, as LightLLM's router and
model-infer worker fill them: names, parents, attributes, events and abort status, exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import make_captured
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from llm_otel.config import Settings
from llm_otel.telemetry.stages import INFER, ROUTER

T0 = 1_700_000_000 * 10**9  # epoch ns the sub-request entered the stage
MS = 10**6


def request_span(cap):
    """A request span standing in for the HTTP worker's; its Context is the stage's parent."""
    span = cap.telemetry.tracer.start_span("text_completion tiny")
    return span, trace.set_span_in_context(span)


def test_router_stage_span_is_queued_to_released_with_queue_events_under_the_request_span(captured):
    req, parent = request_span(captured)
    rec = captured.telemetry.start_stage(
        ROUTER,
        1025,
        parent,
        group_id=1024,
        choice_index=1,
        start_ns=T0,
        queued_ns=T0,
        frontend_arrival_s=(T0 - 4 * MS) / 1e9,
    )
    rec.scheduled_ns = T0 + 2 * MS
    rec.input_tokens, rec.output_tokens, rec.cached_tokens, rec.finish_reason = 7, 3, 4, "stop"
    captured.telemetry.end_stage(rec, end_ns=T0 + 9 * MS)
    (span,) = captured.finished()
    assert span.name == "llm.router.request" and span.kind == SpanKind.INTERNAL
    assert span.parent.span_id == req.get_span_context().span_id
    assert span.context.trace_id == req.get_span_context().trace_id
    assert (span.start_time, span.end_time) == (T0, T0 + 9 * MS)
    assert dict(span.attributes) == {
        "llm.request.id": "1025",
        "llm.request.choice.index": 1,
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.usage.cache_read.input_tokens": 4,
        "llm.request.frontend.duration": pytest.approx(0.004, abs=1e-6),
        "llm.request.queue.duration": 0.002,
        "gen_ai.response.finish_reasons": ("stop",),
    }
    assert [(e.name, e.timestamp) for e in span.events] == [
        ("llm.request.queued", T0),
        ("llm.request.scheduled", T0 + 2 * MS),
    ]
    assert span.status.status_code == StatusCode.UNSET
    assert (
        captured.telemetry.start_stage(ROUTER, 1, parent, group_id=1, choice_index=0, start_ns=T0).span_context
        == req.get_span_context()
    )  # step spans link to the request through the record


def test_infer_stage_span_has_token_events_prefill_decode_tpot_and_perplexity(captured):
    _req, parent = request_span(captured)
    rec = captured.telemetry.start_stage(
        INFER, 1024, parent, group_id=1024, choice_index=0, start_ns=T0, output_tokens=0
    )
    rec.input_tokens = 5
    for i, (t, lp) in enumerate(((T0 + 10 * MS, -0.5), (T0 + 12 * MS, -1.0), (T0 + 15 * MS, -1.5))):
        rec.on_token(np.int64(100 + i), lp, t)
    rec.finish_reason = "length"
    captured.telemetry.end_stage(rec, end_ns=T0 + 16 * MS)
    (span,) = captured.finished()
    assert span.name == "llm.infer.request" and (span.start_time, span.end_time) == (T0, T0 + 16 * MS)
    assert dict(span.attributes) == {
        "llm.request.id": "1024",
        "llm.request.choice.index": 0,
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 3,
        "llm.request.prefill.duration": 0.01,
        "llm.request.decode.duration": 0.005,
        "llm.logit.perplexity": math.exp(1.0),
        "llm.time_per_output_token": 0.005 / 2,
        "gen_ai.response.finish_reasons": ("length",),
    }
    # engine times, latency since the previous token (the first: since admission); no token ids
    # without content capture (they decode back to the text)
    assert [(e.name, e.timestamp, dict(e.attributes)) for e in span.events] == [
        ("llm.token", T0 + 10 * MS, {"llm.token.index": 0, "llm.token.latency": 0.01}),
        ("llm.token", T0 + 12 * MS, {"llm.token.index": 1, "llm.token.latency": 0.002}),
        ("llm.token", T0 + 15 * MS, {"llm.token.index": 2, "llm.token.latency": 0.003}),
    ]


def test_infer_stage_token_events_are_capped_and_carry_ids_only_with_content_capture():
    cap = make_captured(Settings(token_events=2, capture_content=True))
    _req, parent = request_span(cap)
    rec = cap.telemetry.start_stage(INFER, 8, parent, group_id=8, choice_index=0, start_ns=T0, output_tokens=0)
    for i in range(3):
        rec.on_token(7 + i, 0.0, T0 + (i + 1) * MS)
    cap.telemetry.end_stage(rec, end_ns=T0 + 4 * MS)
    (span,) = cap.finished()
    assert span.attributes["gen_ai.usage.output_tokens"] == 3
    assert [dict(e.attributes) for e in span.events] == [
        {"llm.token.index": 0, "llm.token.latency": 0.001, "llm.token.id": 7},
        {"llm.token.index": 1, "llm.token.latency": 0.001, "llm.token.id": 8},
    ]


def test_aborted_stage_ends_with_error_and_at_its_last_token_when_that_is_later(captured):
    _req, parent = request_span(captured)
    rec = captured.telemetry.start_stage(INFER, 16, parent, group_id=16, choice_index=0, start_ns=T0, output_tokens=0)
    rec.on_token(1, -0.1, T0 + 5 * MS)
    rec.aborted = True
    captured.telemetry.end_stage(rec, end_ns=T0 + 3 * MS)  # released before its last stamp
    (span,) = captured.finished()
    assert span.end_time == T0 + 5 * MS
    assert span.attributes["error.type"] == "aborted" and span.attributes["gen_ai.usage.output_tokens"] == 1
    assert "llm.time_per_output_token" not in span.attributes
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "aborted")


def test_worker_stage_that_produced_no_token_counts_zero_and_a_router_one_without_a_count_none(captured):
    _req, parent = request_span(captured)
    infer = captured.telemetry.start_stage(INFER, 24, parent, group_id=24, choice_index=0, start_ns=T0, output_tokens=0)
    router = captured.telemetry.start_stage(ROUTER, 24, parent, group_id=24, choice_index=0, start_ns=T0, queued_ns=T0)
    captured.telemetry.end_stage(infer, end_ns=T0 + MS)
    captured.telemetry.end_stage(router, end_ns=T0 + MS)
    spans = {s.name: s for s in captured.finished()}
    assert spans["llm.infer.request"].attributes["gen_ai.usage.output_tokens"] == 0
    assert spans["llm.infer.request"].events == ()
    assert "gen_ai.usage.output_tokens" not in spans["llm.router.request"].attributes
    assert "llm.request.queue.duration" not in spans["llm.router.request"].attributes  # never scheduled


def test_logit_rows_become_a_full_vocab_logit_dist_span_under_the_request(captured):
    req, parent = request_span(captured)
    rec = captured.telemetry.start_stage(
        INFER, 32, parent, group_id=32, choice_index=0, start_ns=T0, output_tokens=0, logit_top_k=2
    )
    for i in range(2):
        rec.logit_rows.append((T0 + (i + 1) * MS, np.array([5, 6]), np.array([-0.1, -2.0]), 0.4, 1.9, False, -0.1))
    captured.telemetry.end_stage(rec, end_ns=T0 + 3 * MS)
    spans = {s.name: s for s in captured.finished()}
    dist = spans["llm.logit_dist"]
    assert dist.parent.span_id == req.get_span_context().span_id
    assert (dist.start_time, dist.end_time) == (T0 + MS, T0 + 2 * MS)
    assert dist.attributes["llm.logit.source"] == "full_vocab_logits" and dist.attributes["llm.logit.steps"] == 2
    assert rec.logit_rows == []  # freed once emitted


def test_a_token_that_is_not_a_number_records_nothing_and_an_unknown_stage_is_refused(captured):
    _req, parent = request_span(captured)
    rec = captured.telemetry.start_stage(INFER, 40, parent, group_id=40, choice_index=0, start_ns=T0, output_tokens=0)
    with pytest.raises(TypeError):
        rec.on_token(1, None, T0 + MS)
    assert (len(rec.token_times), rec.token_ids, rec.output_tokens) == (0, [], 0)
    with pytest.raises(ValueError, match="unknown stage"):
        captured.telemetry.start_stage("llm.detokenize.request", 40, parent, group_id=40, choice_index=0, start_ns=T0)
