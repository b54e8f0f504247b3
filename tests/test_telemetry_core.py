"""The engine-agnostic core on synthetic request records: span tree, timing, events, metrics."""

from __future__ import annotations

import random

import pytest
from conftest import make_captured
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from llm_otel.config import Settings
from llm_otel.export.providers import SystemRandomIdGenerator
from llm_otel.telemetry.record import RequestRecord

ARRIVAL = 1_700_000_000.0  # wall-clock s
OFFSET_NS = 1_699_990_000 * 10**9  # epoch_ns = mono_s * 1e9 + OFFSET_NS, so mono = 10_000 s at ARRIVAL


def mono(wall_s: float) -> float:
    return wall_s - OFFSET_NS / 1e9


def at(wall_s: float):
    """Epoch ns of a wall time, to within 1 us (engine stamps are float seconds)."""
    return pytest.approx(round(wall_s * 1e9), abs=1000)


def start(cap, rid="r1", input_tokens=7, **kw) -> RequestRecord:
    rec = cap.telemetry.start_request(
        rid,
        operation="text_completion",
        provider="vllm",
        model="tiny",
        arrival_s=ARRIVAL,
        input_tokens=input_tokens,
        **kw,
    )
    rec.mono_offset_ns = OFFSET_NS
    return rec


def run_request(cap, delays=(0.050, 0.010, 0.010, 0.010, 0.010), queued=0.001, scheduled=0.003, **kw):
    """Tokens at ARRIVAL + cumulative delays; returns (record, spans by name)."""
    rec = start(cap, **kw)
    rec.on_event("queued", mono(ARRIVAL + queued))
    rec.on_event("scheduled", mono(ARRIVAL + scheduled))
    t = ARRIVAL
    for i, d in enumerate(delays):
        t += d
        rec.on_tokens([100 + i], mono(t))
    rec.finish_reason = "length"
    cap.telemetry.finish(rec, end_ns=round((t + 0.002) * 1e9))
    spans = {s.name: s for s in cap.finished()}
    return rec, spans


def test_request_tree_has_prompt_and_token_stream_children_of_the_request_span(captured):
    _, spans = run_request(captured)
    assert set(spans) == {"text_completion tiny", "llm.prompt", "llm.token_stream"}
    root = spans["text_completion tiny"]
    assert root.parent is None and root.kind == SpanKind.INTERNAL
    for name in ("llm.prompt", "llm.token_stream"):
        assert spans[name].parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
        assert spans[name].kind == SpanKind.INTERNAL


def test_span_times_come_from_the_engine_stamps(captured):
    _, spans = run_request(captured)
    root, prompt, stream = spans["text_completion tiny"], spans["llm.prompt"], spans["llm.token_stream"]
    assert root.start_time == round(ARRIVAL * 1e9)
    assert prompt.start_time == root.start_time
    assert prompt.end_time == stream.start_time == at(ARRIVAL + 0.050)
    assert stream.end_time == at(ARRIVAL + 0.090)
    assert root.end_time == at(ARRIVAL + 0.092)


def test_request_attributes_use_current_genai_names(captured):
    _, spans = run_request(captured)
    a = spans["text_completion tiny"].attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == 7
    assert a["gen_ai.usage.output_tokens"] == 5
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert "gen_ai.usage.prompt_tokens" not in a and "gen_ai.system" not in a


def test_prompt_span_separates_queue_and_prefill(captured):
    _, spans = run_request(captured)
    p = spans["llm.prompt"]
    assert p.attributes["llm.request.frontend.duration"] == pytest.approx(0.001, abs=1e-6)
    assert p.attributes["llm.request.queue.duration"] == pytest.approx(0.002, abs=1e-6)
    assert p.attributes["llm.request.prefill.duration"] == pytest.approx(0.047, abs=1e-6)
    assert [e.name for e in p.events] == ["llm.request.queued", "llm.request.scheduled"]
    assert p.attributes["llm.request.timing.source"] == "engine_events"


def test_token_stream_timing_ttft_tpot_and_itl(captured):
    _, spans = run_request(captured, delays=(0.050, 0.010, 0.020, 0.010, 0.040))
    a = spans["llm.token_stream"].attributes
    assert a["gen_ai.usage.output_tokens"] == 5
    assert a["llm.time_to_first_token"] == pytest.approx(0.050, abs=1e-6)
    assert a["llm.time_per_output_token"] == pytest.approx(0.080 / 4, abs=1e-6)
    assert a["llm.inter_token_latency.p50"] == pytest.approx(0.015, abs=1e-6)
    assert a["llm.inter_token_latency.max"] == pytest.approx(0.040, abs=1e-6)


@pytest.mark.case("C08")
def test_delayed_first_token_span_starts_before_first_token_and_ttft_is_the_delay(captured):
    delay = 0.750
    _, spans = run_request(captured, delays=(delay, 0.01, 0.01))
    root, stream = spans["text_completion tiny"], spans["llm.token_stream"]
    first_token_ns = round((ARRIVAL + delay) * 1e9)
    assert root.start_time < first_token_ns - 10**8 and spans["llm.prompt"].start_time == root.start_time
    assert stream.start_time == at(ARRIVAL + delay)
    ttft = stream.attributes["llm.time_to_first_token"]
    assert ttft == pytest.approx(delay, abs=1e-6)
    e2e = (root.end_time - root.start_time) / 1e9
    assert e2e - ttft > 0.015


def test_token_events_for_the_first_n_tokens_with_ids_and_latency():
    cap = make_captured(Settings(token_events=3, capture_content=True))
    _, spans = run_request(cap, delays=(0.05, 0.01, 0.01, 0.01, 0.01))
    events = [e for e in spans["llm.token_stream"].events if e.name == "llm.token"]
    assert [e.attributes["llm.token.index"] for e in events] == [0, 1, 2]
    assert [e.attributes["llm.token.id"] for e in events] == [100, 101, 102]
    assert events[0].attributes["llm.token.latency"] == pytest.approx(0.05, abs=1e-6)
    assert events[1].attributes["llm.token.latency"] == pytest.approx(0.01, abs=1e-6)
    assert events[0].timestamp == at(ARRIVAL + 0.05)


def test_stall_events_mark_tokens_slower_than_k_times_the_median_itl():
    cap = make_captured(Settings(stall_factor=3.0, max_stall_events=1))
    _, spans = run_request(cap, delays=(0.05, 0.01, 0.01, 0.5, 0.01, 0.01, 0.4, 0.01))
    stream = spans["llm.token_stream"]
    stalls = [e for e in stream.events if e.name == "llm.token.stall"]
    assert len(stalls) == 1  # capped
    assert stalls[0].attributes["llm.token.index"] == 3
    assert stalls[0].attributes["llm.token.latency"] == pytest.approx(0.5, abs=1e-6)
    assert stream.attributes["llm.token.events.dropped"] == 1
    assert stream.attributes["llm.token.stall.threshold"] == pytest.approx(0.03, abs=1e-6)


@pytest.mark.case("C01")
def test_prompt_and_token_stream_cover_at_least_90_percent_of_the_request(captured):
    _, spans = run_request(captured)
    root = spans["text_completion tiny"]
    covered = sum(spans[n].end_time - spans[n].start_time for n in ("llm.prompt", "llm.token_stream"))
    assert covered / (root.end_time - root.start_time) >= 0.9


def test_no_child_starts_before_or_ends_after_its_parent_even_with_skewed_stamps(captured):
    rec = start(captured)
    rec.on_tokens([1], mono(ARRIVAL - 5.0))  # an engine stamp before arrival (clock skew)
    rec.on_tokens([2], mono(ARRIVAL + 0.1))
    captured.telemetry.finish(rec, end_ns=round((ARRIVAL + 0.05) * 1e9))  # end before last token
    spans = captured.finished()
    root = next(s for s in spans if s.parent is None)
    for s in spans:
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time


def test_metrics_are_recorded_for_requests_the_sampler_dropped():
    cap = make_captured(sampler=ALWAYS_OFF)
    run_request(cap)
    assert cap.finished() == []
    (ttft,) = cap.metric_points("gen_ai.server.time_to_first_token")
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.050, abs=1e-6)
    (dur,) = cap.metric_points("gen_ai.server.request.duration")
    assert dur.count == 1
    assert list(dur.explicit_bounds) == [
        0.01,
        0.02,
        0.04,
        0.08,
        0.16,
        0.32,
        0.64,
        1.28,
        2.56,
        5.12,
        10.24,
        20.48,
        40.96,
        81.92,
    ]
    (tpot,) = cap.metric_points("gen_ai.server.time_per_output_token")
    assert tpot.sum == pytest.approx(0.010, abs=1e-6)
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in cap.metric_points("llm.server.token.usage")}
    assert usage == {"input": 7, "output": 5}
    (queue,) = cap.metric_points("llm.server.request.queue_time")
    assert queue.sum == pytest.approx(0.002, abs=1e-6)


def test_failed_request_gets_error_status_and_error_type_on_the_duration_metric(captured):
    rec = start(captured)
    rec.on_tokens([5, 6], mono(ARRIVAL + 0.02))
    rec.finish_reason, rec.error_type = "abort", "aborted"
    captured.telemetry.finish(rec, end_ns=round((ARRIVAL + 0.03) * 1e9))
    spans = {s.name: s for s in captured.finished()}
    root = spans["text_completion tiny"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["error.type"] == "aborted"
    assert root.attributes["gen_ai.usage.output_tokens"] == 2
    assert spans["llm.token_stream"].status.status_code == StatusCode.ERROR
    (dur,) = captured.metric_points("gen_ai.server.request.duration")
    assert dur.attributes["error.type"] == "aborted"
    assert captured.metric_points("gen_ai.server.time_to_first_token") == []


def test_request_that_never_produced_a_token_has_only_an_error_prompt_span(captured):
    rec = start(captured)
    rec.error_type = "aborted"
    captured.telemetry.finish(rec, end_ns=round((ARRIVAL + 0.5) * 1e9))
    spans = {s.name: s for s in captured.finished()}
    assert set(spans) == {"text_completion tiny", "llm.prompt"}
    assert spans["llm.prompt"].status.status_code == StatusCode.ERROR
    assert spans["llm.prompt"].end_time == at(ARRIVAL + 0.5)


def test_finish_twice_emits_once(captured):
    rec = start(captured)
    rec.on_tokens([1], mono(ARRIVAL + 0.01))
    captured.telemetry.finish(rec)
    captured.telemetry.finish(rec)
    assert len([s for s in captured.finished() if s.parent is None]) == 1
    (dur,) = captured.metric_points("gen_ai.server.request.duration")
    assert dur.count == 1


def test_request_span_is_child_of_the_current_span(captured):
    tracer = captured.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("app") as app:
        rec = start(captured)
    rec.on_tokens([1], mono(ARRIVAL + 0.01))
    captured.telemetry.finish(rec)
    root = next(s for s in captured.finished() if s.name == "text_completion tiny")
    assert root.parent.span_id == app.get_span_context().span_id


@pytest.mark.case("C12")
def test_rejection_messages_quoting_the_prompt_are_not_exported_unless_capture_is_on():
    secret = "SECRET-7f3a9c"
    cap = make_captured()
    cap.telemetry.reject(
        operation="chat",
        provider="vllm",
        model="m",
        arrival_s=ARRIVAL,
        error=ValueError(f"template error near {secret}"),
    )
    (span,) = cap.finished()
    assert secret not in span.to_json() and span.status.description == "ValueError"
    cap = make_captured(Settings(capture_content=True))
    cap.telemetry.reject(
        operation="chat",
        provider="vllm",
        model="m",
        arrival_s=ARRIVAL,
        error=ValueError(f"template error near {secret}"),
    )
    assert secret in cap.finished()[0].status.description


def test_rejected_request_yields_one_error_span_and_duration_metric(captured):
    captured.telemetry.reject(
        operation="text_completion",
        provider="vllm",
        model="tiny",
        arrival_s=ARRIVAL,
        error=ValueError("prompt too long"),
    )
    (span,) = captured.finished()
    assert span.name == "text_completion tiny"
    assert span.attributes["error.type"] == "ValueError"
    assert span.status.status_code == StatusCode.ERROR
    assert [e.name for e in span.events] == ["llm.request.rejected"]
    (dur,) = captured.metric_points("gen_ai.server.request.duration")
    assert dur.attributes["error.type"] == "ValueError"


def test_logit_dist_span_from_engine_logprobs():
    import numpy as np

    cap = make_captured(Settings(logit_events=2, capture_content=True))
    rec = start(cap)
    rec.logprob_cap = 100
    rec.vocab_size = 4
    lp = np.log(np.array([[0.5, 0.5, 0.3, 0.2], [0.7, 0.7, 0.2, 0.1], [0.4, 0.4, 0.4, 0.2]]))
    ids = np.array([[9, 9, 3, 1], [4, 4, 2, 0], [7, 7, 6, 5]])
    for i in range(3):
        rec.on_logprobs(ids[i : i + 1], lp[i : i + 1])
        rec.on_tokens([int(ids[i, 0])], mono(ARRIVAL + 0.01 * (i + 1)))
    cap.telemetry.finish(rec)
    spans = {s.name: s for s in cap.finished()}
    dist = spans["llm.logit_dist"]
    assert dist.parent.span_id == spans["text_completion tiny"].context.span_id
    a = dist.attributes
    assert a["llm.logit.source"] == "engine_logprobs"
    assert a["llm.logit.top_k"] == 3 and a["llm.logit.steps"] == 3 and a["llm.logit.nonfinite_steps"] == 0
    exact = [-(p * np.log(p)).sum() for p in np.exp(lp[:, 1:])]  # top-3 hold all the mass here
    assert a["llm.logit.entropy.mean"] == pytest.approx(float(np.mean(exact)), rel=1e-9)
    assert a["llm.logit.margin.min"] == pytest.approx(0.0, abs=1e-12)
    assert a["llm.logit.perplexity"] == pytest.approx(float(np.exp(-lp[:, 0].mean())), rel=1e-9)
    steps = [e for e in dist.events if e.name == "llm.logit.step"]
    assert len(steps) == 2 and a["llm.token.events.dropped"] == 1
    assert list(steps[0].attributes["llm.logit.top_token_ids"]) == [9, 3, 1]
    assert steps[0].attributes["llm.logit.sampled_logprob"] == pytest.approx(np.log(0.5))


def test_nan_logprobs_mark_the_step_never_raise():
    import numpy as np

    cap = make_captured()
    rec = start(cap)
    rec.logprob_cap = 10
    rec.on_logprobs(np.array([[1, 1, 2]]), np.array([[np.nan, np.nan, -1.0]]))
    rec.on_tokens([1], mono(ARRIVAL + 0.01))
    cap.telemetry.finish(rec)
    dist = next(s for s in cap.finished() if s.name == "llm.logit_dist")
    assert dist.attributes["llm.logit.nonfinite_steps"] == 1
    assert dist.status.status_code == StatusCode.ERROR
    (step,) = [e for e in dist.events if e.name == "llm.logit.step"]
    assert step.attributes["llm.logit.nonfinite"] is True


def test_broken_span_building_is_counted_and_the_request_span_still_ends(captured, caplog):
    rec = start(captured)
    rec.on_tokens([1], mono(ARRIVAL + 0.01))

    def broken(*args, **kwargs):
        raise TypeError("corrupt record")

    captured.telemetry.spans._token_stream = broken  # span building raises half-way through the tree
    captured.telemetry.finish(rec)
    assert captured.telemetry.errors.counts == {"telemetry.spans": 1}
    assert len([r for r in caplog.records if "telemetry.spans failed" in r.getMessage()]) == 1
    assert [s.name for s in captured.finished()][-1] == "text_completion tiny"
    (point,) = captured.metric_points("llm_otel.instrumentation.errors")
    assert point.value == 1 and point.attributes["llm.instrumentation.hook"] == "telemetry.spans"


@pytest.mark.case("C12")
def test_prompt_content_is_not_captured_by_default_and_truncated_when_opted_in():
    secret = "SECRET-" + "x" * 50
    cap = make_captured()
    rec = start(cap, prompt_text=secret)
    cap.telemetry.finish(rec)
    assert all(secret[:7] not in str(s.to_json()) for s in cap.finished())
    cap = make_captured(Settings(capture_content=True, content_max_chars=10))
    rec = start(cap, prompt_text=secret)
    cap.telemetry.finish(rec)
    root = next(s for s in cap.finished() if s.parent is None)
    import json

    (message,) = json.loads(root.attributes["gen_ai.input.messages"])
    assert message == {"role": "user", "parts": [{"type": "text", "content": secret[:10]}]}


def test_id_generator_ignores_the_seeded_global_random():
    gen = SystemRandomIdGenerator()
    random.seed(0)
    a = [gen.generate_span_id() for _ in range(3)] + [gen.generate_trace_id()]
    random.seed(0)
    b = [gen.generate_span_id() for _ in range(3)] + [gen.generate_trace_id()]
    assert a != b and len(set(a)) == 4 and all(a)
    assert isinstance(trace.INVALID_SPAN_ID, int)


def test_id_generator_does_not_repeat_its_parents_ids_in_a_forked_child():
    import os

    gen = SystemRandomIdGenerator()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the same generator state, re-seeded at fork
        os.write(w, str(gen.generate_trace_id()).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    child = int(os.read(r, 64).decode())
    os.close(r)
    assert child != gen.generate_trace_id()


def test_completion_text_needs_content_capture():
    import json

    cap = make_captured()
    rec = start(cap)
    cap.telemetry.set_completion(rec, "hello world", "stop")
    cap.telemetry.finish(rec)
    assert "gen_ai.output.messages" not in next(s for s in cap.finished() if s.parent is None).attributes
    cap = make_captured(Settings(capture_content=True, content_max_chars=5))
    rec = start(cap)
    cap.telemetry.set_completion(rec, "hello world", "stop")
    cap.telemetry.finish(rec)
    root = next(s for s in cap.finished() if s.parent is None)
    assert json.loads(root.attributes["gen_ai.output.messages"]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "hello"}], "finish_reason": "stop"}
    ]


def test_token_ids_are_content_and_stay_out_of_spans_without_content_capture():
    """Token ids decode back to the completion with the model's tokenizer: with content capture
    off (the default) neither llm.token nor llm.logit.step events carry them."""
    import numpy as np

    cap = make_captured(Settings(token_events=3))
    rec = start(cap)
    rec.logprob_cap = 100
    lp = np.log(np.array([[0.5, 0.5, 0.3, 0.2], [0.7, 0.7, 0.2, 0.1]]))
    ids = np.array([[9, 9, 3, 1], [4, 4, 2, 0]])
    for i in range(2):
        rec.on_logprobs(ids[i : i + 1], lp[i : i + 1])
        rec.on_tokens([int(ids[i, 0])], mono(ARRIVAL + 0.01 * (i + 1)))
    cap.telemetry.finish(rec)
    spans = {s.name: s for s in cap.finished()}
    tokens = [e for e in spans["llm.token_stream"].events if e.name == "llm.token"]
    steps = [e for e in spans["llm.logit_dist"].events if e.name == "llm.logit.step"]
    assert len(tokens) == 2 and len(steps) == 2
    assert all("llm.token.id" not in e.attributes for e in tokens)
    assert all("llm.logit.top_token_ids" not in e.attributes for e in steps)
    assert list(steps[0].attributes["llm.logit.top_logprobs"]) == pytest.approx(list(np.log([0.5, 0.3, 0.2])))


def test_requests_sharing_attribute_sets_keep_their_own_error_type_and_finish_reason(captured):
    """Per-request metric attribute sets are built once and reused: a failed request's
    ``error.type`` must not leak into the next successful request with the same labels."""
    for error, reason in ((None, "length"), ("aborted", "abort"), (None, "length"), (None, "stop")):
        rec = start(captured)
        rec.on_tokens([5, 6], mono(ARRIVAL + 0.02))
        rec.finish_reason, rec.error_type = reason, error
        captured.telemetry.finish(rec, end_ns=round((ARRIVAL + 0.03) * 1e9))
    counts = {
        (p.attributes.get("llm.response.finish_reason"), p.attributes.get("error.type")): p.value
        for p in captured.metric_points("llm.server.requests")
    }
    assert counts == {("length", None): 2, ("abort", "aborted"): 1, ("stop", None): 1}
    usage = sorted((p.attributes["gen_ai.token.type"], p.sum) for p in captured.metric_points("llm.server.token.usage"))
    assert usage == [("input", 28), ("output", 8)]
    assert {tuple(sorted(p.attributes)) for p in captured.metric_points("llm.server.token.usage")} == {
        ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model", "gen_ai.token.type")
    }
