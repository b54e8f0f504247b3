"""Worker-side logit statistics on a stand-in model runner (torch on CPU): the shape of vLLM's
GPUModelRunner._sample call (vllm/v1/worker/gpu_model_runner.py: _sample(logits, spec_decode_metadata),
input_batch.req_ids, requests[req_id].sampling_params.extra_args / output_token_ids)."""

from __future__ import annotations

import math
import types

import pytest
from conftest import make_captured

from llm_otel.config import Settings
from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, CARRIER_STATE_KEY, CARRIER_TOPK_KEY
from llm_otel.instrumentation.vllm.worker import WorkerAdapter

torch = pytest.importorskip("torch")

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def runner(rows: dict[str, dict | None], max_tokens=3):
    requests = {}
    for rid, extra in rows.items():
        sp = types.SimpleNamespace(extra_args=extra, max_tokens=max_tokens)
        requests[rid] = types.SimpleNamespace(sampling_params=sp, output_token_ids=[])
    return types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=list(rows)), requests=requests)


def sample_fn(logits, spec_decode_metadata=None):
    return types.SimpleNamespace(sampled_token_ids=logits.argmax(dim=1, keepdim=True))


def test_only_chosen_rows_are_reduced_and_a_span_is_emitted_when_max_tokens_is_reached():
    cap = make_captured(Settings(capture_content=True))  # top token ids are content
    worker = WorkerAdapter(cap.telemetry)
    wrap = worker.sample("hook")
    chosen = {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 3}
    r = runner({"a": chosen, "b": None, "c": {"other": 1}})
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    for step in range(3):
        out = wrap(sample_fn, r, (logits,), {})
        assert out.sampled_token_ids.shape == (3, 1)  # the engine's result is untouched
        r.requests["a"].output_token_ids.append(3)
    (span,) = cap.finished()
    assert span.name == "llm.logit_dist"
    assert f"{span.context.trace_id:032x}" == TID and f"{span.parent.span_id:016x}" == SID
    a = span.attributes
    assert a["llm.logit.source"] == "full_vocab_logits" and a["llm.logit.steps"] == 3 and a["llm.logit.top_k"] == 3
    p = torch.softmax(logits[0], 0)
    assert a["llm.logit.entropy.mean"] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert a["llm.logit.perplexity"] == pytest.approx(math.exp(-float(p.log()[3])), rel=1e-5)
    step = [e for e in span.events if e.name == "llm.logit.step"][0]
    assert list(step.attributes["llm.logit.top_token_ids"]) == [3, 2, 1]


def test_nan_logits_mark_the_step_and_never_raise():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner({"a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2}}, max_tokens=1)
    out = worker.sample("hook")(sample_fn, r, (torch.tensor([[float("nan"), 1.0, 2.0]]),), {})
    assert out is not None
    (span,) = cap.finished()
    assert span.attributes["llm.logit.nonfinite_steps"] == 1
    assert span.status.status_code.name == "ERROR"


def test_requests_that_stop_early_are_flushed_when_idle_or_dropped_by_vllm():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner({"a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2}}, max_tokens=100)
    worker.sample("hook")(sample_fn, r, (torch.randn(1, 8),), {})
    assert cap.finished() == []
    assert worker.flush(idle_s=0.0) == 1
    assert [s.name for s in cap.finished()] == ["llm.logit_dist"]


def test_a_failing_reduction_is_counted_and_sampling_still_runs(monkeypatch):
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    monkeypatch.setattr(worker, "_prepare", lambda *a: 1 / 0)
    r = runner({"a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2}})
    out = worker.sample("hook")(sample_fn, r, (torch.randn(1, 8),), {})
    assert out.sampled_token_ids.shape == (1, 1)
    assert cap.telemetry.errors.counts == {"hook": 1}


def test_the_request_spans_tracestate_reaches_the_worker_span():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner(
        {"a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_STATE_KEY: "ot=th:c,vendor=x", CARRIER_TOPK_KEY: 2}},
        max_tokens=1,
    )
    worker.sample("hook")(sample_fn, r, (torch.randn(1, 8),), {})
    (span,) = cap.finished()
    assert span.context.trace_state.get("ot") == "th:c" and span.context.trace_state.get("vendor") == "x"


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (only its class name matters)."""


class OutputProcessor:
    """Stands in for vllm.v1.engine.output_processor.OutputProcessor (a weak-referenceable key)."""


def test_engine_dying_mid_generate_ends_every_request_in_flight_with_the_error():
    """Review finding: when the engine died inside LLM.generate, the requests it was serving were
    never ended (no spans, no metrics) and one bogus 'rejected' span appeared instead."""
    import time

    from llm_otel.instrumentation.vllm.adapter import VLLMAdapter

    cap = make_captured()
    adapter = VLLMAdapter(cap.telemetry)
    output_processor = OutputProcessor()
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(output_processor=output_processor))
    state = adapter._state_for(output_processor)
    for rid in ("a", "b"):
        rec = cap.telemetry.start_request(
            rid, operation="text_completion", provider="vllm", model="tiny", arrival_s=time.time(), input_tokens=3
        )
        rec.on_tokens([5], time.monotonic())
        state.records[rid] = rec

    def generate(*args, **kwargs):
        raise EngineDeadError("EngineCore encountered an issue: the prompt was 'secret'")

    wrapper = adapter.traced_operation("vllm.entrypoints.llm:LLM.generate")
    with pytest.raises(EngineDeadError):  # the user's exception, unchanged
        wrapper(generate, llm, (), {})
    assert state.records == {}
    roots = [s for s in cap.finished() if s.name == "text_completion tiny"]
    assert sorted(s.attributes["llm.request.id"] for s in roots) == ["a", "b"]  # no extra 'rejected' span
    for span in roots:
        assert span.attributes["error.type"] == "EngineDeadError"
        assert "secret" not in (span.status.description or "")
    counts = {p.attributes.get("error.type"): p.value for p in cap.metric_points("llm.server.requests")}
    assert counts == {"EngineDeadError": 2}


# --- speculative decoding (V1 rejection sampler layout) ------------------------------------------
def spec_metadata(drafts: list[list[int]]):
    """vLLM's own SpecDecodeMetadata (vllm/v1/spec_decode/metadata.py) for these draft tokens."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    return SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))


def rejection_fn(sampled):
    """Stands in for the V1 RejectionSampler's output: (num_reqs, max_spec_len + 1), -1 rejected."""

    def sample(logits, spec_decode_metadata=None):
        return types.SimpleNamespace(sampled_token_ids=sampled)

    return sample


def logit_steps(span):
    return [e.attributes for e in span.events if e.name == "llm.logit.step"]


@pytest.mark.case("C24")
def test_speculative_steps_report_each_emitted_tokens_target_row_and_never_a_rejected_draft():
    pytest.importorskip("vllm")
    cap = make_captured(Settings(capture_content=True))
    worker = WorkerAdapter(cap.telemetry)
    chosen = {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2}
    r = runner({"b": None, "a": chosen}, max_tokens=10)
    # b: 1 draft (rows 0-1); a: 3 drafts (rows 2-4) + bonus (row 5); each row's top token is its index
    logits = torch.full((6, 8), -2.0)
    for row in range(6):
        logits[row, row] = 3.0 + row / 10
    # a accepted its first draft (token 2 at row 2), rejected the second: the recovered token 5 is
    # sampled from row 3; rows 4 and 5 are not output tokens
    sampled = torch.tensor([[1, 7, -1, -1], [2, 5, -1, -1]])
    out = worker.sample("hook")(rejection_fn(sampled), r, (logits, spec_metadata([[7], [2, 9, 4]])), {})
    assert out.sampled_token_ids is sampled
    r.requests["a"].output_token_ids += [2, 5]
    del r.requests["a"]  # vLLM dropped it: the span comes at the next step with a chosen request
    worker.flush(0.0)
    (span,) = cap.finished()
    steps = logit_steps(span)
    assert span.attributes["llm.logit.steps"] == 2
    assert [list(s["llm.logit.top_token_ids"])[0] for s in steps] == [2, 3]
    lp = torch.log_softmax(logits, dim=1)
    assert [s["llm.logit.sampled_logprob"] for s in steps] == pytest.approx([float(lp[2, 2]), float(lp[3, 5])])


def test_a_speculative_step_past_max_tokens_or_a_stop_token_reports_only_the_tokens_vllm_keeps():
    pytest.importorskip("vllm")
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner(
        {
            "a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2},
            "c": {CARRIER_KEY: f"00-{TID}-{'1' * 16}-01", CARRIER_TOPK_KEY: 2},
        },
        max_tokens=3,
    )
    r.requests["a"].output_token_ids += [6]  # a has 1 of its 3 tokens: 2 more are kept
    r.requests["c"].sampling_params.eos_token_id = 4  # c stops at its second token (eos 4)
    r.requests["c"].sampling_params.stop_token_ids = []
    logits = torch.randn(8, 8)
    sampled = torch.tensor([[1, 2, 3, 5], [3, 4, 6, 7]])  # all drafts accepted, bonus included
    worker.sample("hook")(rejection_fn(sampled), r, (logits, spec_metadata([[1, 2, 3], [3, 4, 6]])), {})
    spans = {f"{s.parent.span_id:016x}": s for s in cap.finished()}  # both done: emitted at once
    assert spans[SID].attributes["llm.logit.steps"] == 2 and spans["1" * 16].attributes["llm.logit.steps"] == 2
    lp = torch.log_softmax(logits, dim=1)
    assert [s["llm.logit.sampled_logprob"] for s in logit_steps(spans["1" * 16])] == pytest.approx(
        [float(lp[4, 3]), float(lp[5, 4])]
    )


def v1_spec_run(monkeypatch, lag: int):
    """Three V1 speculative steps of two chosen requests, each step's copy completing ``lag``
    polls later; a is dropped by vLLM (EOS) after step 2 while its rows may be pending."""
    from support.deferred_copies import late_copies, step_clock

    late_copies(monkeypatch, lag)
    clock = step_clock(monkeypatch)
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner(
        {
            "a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2},
            "c": {CARRIER_KEY: f"00-{TID}-{'2' * 16}-01", CARRIER_TOPK_KEY: 2},
        },
        max_tokens=50,
    )
    gen = torch.Generator().manual_seed(3)
    wrap = worker.sample("hook")
    for n, (ids, sampled) in enumerate(
        [(["a", "c"], [[1, 2, -1], [3, 4, 5]]), (["a", "c"], [[6, -1, -1], [7, 1, -1]]), (["c"], [[2, 2, 2]])], 1
    ):
        clock.step = n
        r.input_batch.req_ids = ids
        wrap(
            rejection_fn(torch.tensor(sampled)),
            r,
            (torch.randn(3 * len(ids), 8, generator=gen), spec_metadata([[0, 0]] * len(ids))),
            {},
        )
        for rid, row in zip(ids, sampled):
            r.requests[rid].output_token_ids += [t for t in row if t >= 0]
        if n == 2:
            del r.requests["a"]
    worker.flush(0.0)
    return {
        f"{s.parent.span_id:016x}": [(e.timestamp, dict(e.attributes)) for e in s.events if e.name == "llm.logit.step"]
        for s in cap.finished()
    }


@pytest.mark.case("C24")
def test_v1_deferred_collection_gives_exactly_the_results_of_collecting_at_once(monkeypatch):
    pytest.importorskip("vllm")
    at_once = v1_spec_run(monkeypatch, 0)
    assert v1_spec_run(monkeypatch, 2) == at_once
    assert [t for t, _ in at_once[SID]] == [1, 1, 2] and [t for t, _ in at_once["2" * 16]] == [1, 1, 1, 2, 2, 3, 3, 3]


def test_the_idle_flush_keeps_a_request_vllm_still_holds(monkeypatch):
    """Review finding (issue 28): vLLM's first ngram proposal compiles for seconds, so the idle
    flush split a request's llm.logit_dist in two (1 step, then the rest)."""
    from llm_otel.instrumentation.vllm import logit_rows

    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    r = runner({"a": {CARRIER_KEY: f"00-{TID}-{SID}-01", CARRIER_TOPK_KEY: 2}}, max_tokens=100)
    worker.sample("hook")(sample_fn, r, (torch.randn(1, 8),), {})
    assert worker.flush(idle_s=1e-9) == 0 and cap.finished() == []  # idle, but vLLM still holds it
    monkeypatch.setattr(logit_rows, "HELD_IDLE_S", 0.0)
    assert worker.flush(idle_s=1e-9) == 1  # ... unless it has been held without a step for that long
    worker.sample("hook")(sample_fn, r, (torch.randn(1, 8),), {})
    monkeypatch.setattr(logit_rows, "HELD_IDLE_S", 120.0)
    del r.requests["a"]  # vLLM dropped it (EOS): the idle flush emits it
    assert worker.flush(idle_s=1e-9) == 1 and len(cap.finished()) == 2
