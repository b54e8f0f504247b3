"""What a step computes (:func:`llm_otel.instrumentation.vllm.carrier.step_tokens`) and what its
speculative decoding verified (:func:`llm_otel.instrumentation.vllm.engine_core.spec_decode_counts`),
on vLLM 0.32's real ``SchedulerOutput`` / ``NewRequestData`` / ``CachedRequestData`` /
``ModelRunnerOutput`` classes, and the step span's life across pipelined engine steps. The same
rules on the real engine: tests/test_vllm_engine_features.py."""

from __future__ import annotations

import types

import pytest
from support.vllm_env import HAS_VLLM

from llm_otel.instrumentation.vllm.carrier import StepTokens, request_step_tokens, step_tokens

pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")


def new_req(req_id, prompt, computed=0, prefill_token_ids=None):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=computed,
        lora_request=None,
        prefill_token_ids=prefill_token_ids,
    )


def output(scheduled, new=(), cached=(), resumed=(), spec=None):
    """A SchedulerOutput: ``scheduled`` {req_id: tokens}; ``cached``: (req_id, computed, outputs)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens = dict(scheduled)
    so.total_num_scheduled_tokens = sum(scheduled.values())
    so.scheduled_new_reqs = list(new)
    so.scheduled_spec_decode_tokens = dict(spec or {})
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=[c[0] for c in cached],
        resumed_req_ids=set(resumed),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None for _ in cached],
        num_computed_tokens=[c[1] for c in cached],
        num_output_tokens=[c[2] for c in cached],
    )
    return so


def prompts(**lengths):
    """The scheduler's ``requests``: only ``num_prompt_tokens`` is read."""
    return {rid: types.SimpleNamespace(num_prompt_tokens=n) for rid, n in lengths.items()}


def test_a_new_prompt_is_prefill_and_its_last_chunk_emits_the_first_token():
    assert step_tokens(output({"a": 64}, new=[new_req("a", 100)])) == StepTokens(64, 0, 0, 0)
    assert step_tokens(output({"a": 100}, new=[new_req("a", 100)])) == StepTokens(100, 0, 0, 1)


def test_a_chunked_prefill_continuing_is_prefill():
    so = output({"a": 36}, cached=[("a", 64, 0)])
    assert step_tokens(so, prompts(a=100)) == StepTokens(36, 0, 0, 1)


def test_a_running_request_decodes_its_last_token_and_its_drafts():
    so = output({"a": 1, "b": 4}, cached=[("a", 110, 1 + 10), ("b", 120, 21)], spec={"b": [7, 8, 9]})
    assert step_tokens(so, prompts(a=100, b=100)) == StepTokens(0, 5, 0, 0)


def test_a_resumed_request_recomputes_prompt_and_outputs_then_decodes_its_last_token():
    # 100 prompt + 22 output tokens, KV dropped: computes positions 0..120 again, 121 is decode
    so = output({"a": 122, "b": 1}, cached=[("b", 40, 5), ("a", 0, 22)], resumed=["a"])
    assert step_tokens(so, prompts(a=100, b=36)) == StepTokens(121, 2, 121, 0)


def test_a_resumed_request_recomputing_in_chunks_is_prefill_until_its_last_known_token():
    first = output({"a": 64}, cached=[("a", 0, 22)], resumed=["a"])
    assert step_tokens(first, prompts(a=100)) == StepTokens(64, 0, 64, 0)
    # the next chunk is an ordinary cached request (not in resumed_req_ids): still recompute
    second = output({"a": 58}, cached=[("a", 64, 22)])
    assert step_tokens(second, prompts(a=100)) == StepTokens(57, 1, 57, 0)


def test_under_model_runner_v2_a_resumed_request_comes_as_new_with_its_outputs():
    resumed = new_req("a", 100, computed=0, prefill_token_ids=list(range(122)))
    assert step_tokens(output({"a": 122}, new=[resumed])) == StepTokens(121, 1, 121, 0)


def test_with_prefix_cache_hits_a_resumed_request_recomputes_only_past_them():
    so = output({"a": 58}, cached=[("a", 64, 22)], resumed=["a"])  # 64 tokens found in the cache
    assert step_tokens(so, prompts(a=100)) == StepTokens(57, 1, 57, 0)


def test_without_prompt_lengths_the_last_tokens_and_drafts_are_decode():
    """The worker (no scheduler ``requests``) only needs the phase."""
    so = output({"a": 122, "b": 4}, cached=[("a", 0, 22), ("b", 120, 21)], resumed=["a"], spec={"b": [1, 2, 3]})
    assert step_tokens(so) == StepTokens(121, 5, 121, 0)


@pytest.mark.parametrize(
    "computed, scheduled, prompt, outputs, drafts, want",
    [
        (0, 100, 100, 0, 0, StepTokens(100, 0, 0, 1)),
        (0, 99, 100, 0, 0, StepTokens(99, 0, 0, 0)),
        (104, 1, 100, 5, 0, StepTokens(0, 1, 0, 0)),
        (104, 4, 100, 5, 3, StepTokens(0, 4, 0, 0)),
        (0, 105, 100, 5, 0, StepTokens(104, 1, 104, 0)),
        (0, 50, 100, 5, 0, StepTokens(50, 0, 50, 0)),
        # async scheduling: the output count includes the placeholder of the batch in flight
        (105, 1, 100, 6, 0, StepTokens(0, 1, 0, 0)),
    ],
)
def test_request_step_tokens(computed, scheduled, prompt, outputs, drafts, want):
    assert request_step_tokens(computed, scheduled, prompt, outputs, drafts) == want


# --- speculative decoding as Scheduler.update_from_output counts it -------------------------------
class FakeRequest:
    def __init__(self, finished=False):
        self.finished = finished
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False

    def is_finished(self):
        return self.finished


def test_spec_decode_counts_follow_vllms_rule():
    from vllm.v1.outputs import ModelRunnerOutput

    from llm_otel.instrumentation.vllm.engine_core import SpecCounts, spec_decode_counts

    so = output(
        {"a": 4, "b": 4, "c": 3, "d": 4, "e": 1},
        cached=[("a", 50, 5), ("b", 50, 5), ("c", 50, 5), ("d", 50, 5), ("e", 50, 5)],
        spec={"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2], "d": [1, 2, 3]},
    )
    so.num_invalid_spec_tokens = {"b": 1}  # one of b's drafts invalidated by its grammar
    scheduler = types.SimpleNamespace(
        requests={"a": FakeRequest(), "b": FakeRequest(), "c": FakeRequest(), "d": FakeRequest(finished=True)},
        num_sampled_tokens_per_step=1,
    )
    mro = ModelRunnerOutput(
        req_ids=["a", "b", "c", "d", "e"],
        req_id_to_index={"a": 0, "b": 1, "c": 2, "d": 3, "e": 4},
        sampled_token_ids=[[5, 6, 7, 8], [5], [5, 6], [5, 6], [5]],
    )
    # a: 3 drafted, 3 accepted (+ bonus); b: 3 - 1 invalid drafted, 0 accepted; c: 2 drafted, 1
    # accepted; d finished (vLLM skips it); e had no drafts
    assert spec_decode_counts(scheduler, so, mro) == SpecCounts(draft=7, accepted=4)


def test_a_pipelined_step_span_ends_when_its_own_batch_output_is_processed(captured):
    """Async scheduling: batch 1 is scheduled in engine step 1, batch 2 in step 2, whose
    update processes batch 1: span 1 ends there, span 2 stays open until step 3."""
    from opentelemetry.trace import SpanContext, TraceFlags

    from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY
    from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter

    core = EngineCoreAdapter(captured.telemetry)
    sc = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    carrier = {CARRIER_KEY: f"00-{sc.trace_id:032x}-{sc.span_id:016x}-01"}
    sp = types.SimpleNamespace(extra_args=carrier)
    scheduler = types.SimpleNamespace(requests={"a": types.SimpleNamespace(sampling_params=sp, num_prompt_tokens=8)})
    batches = iter([output({"a": 8}, new=[new_req("a", 8)]), output({"a": 1}, cached=[("a", 8, 1)])])
    wrapped_schedule = core.schedule("Scheduler.schedule")

    def schedule():
        return wrapped_schedule(lambda: next(batches), scheduler, (), {})

    processed = []
    update = core.update_from_output("Scheduler.update_from_output")
    step = core.step("EngineCore.step_with_batch_queue")

    def engine_step(process=None):
        def body():
            schedule()
            if process is not None:
                update(lambda so, mro: processed.append(so) or {}, scheduler, (process, None), {})

        step(body, None, (), {})

    engine_step()
    first = core._last_output
    assert captured.finished() == []  # its output is not processed yet
    engine_step(process=first)
    second = core._last_output
    (span1,) = captured.finished()
    assert span1.attributes["llm.engine.step.prefill_tokens"] == 8
    step(lambda: update(lambda so, mro: {}, scheduler, (second, None), {}), None, (), {})
    span2 = captured.finished()[1]
    assert span2.attributes["llm.engine.step.decode_tokens"] == 1
    assert span1.start_time <= span2.start_time <= span1.end_time <= span2.end_time  # overlapping batches
    assert core._open == {}


def spec_step(log_stats: bool):
    """A step with ngram drafts: ``a`` drafted 3 and had 2 accepted, ``b`` drafted 2, none accepted."""
    from vllm.v1.outputs import ModelRunnerOutput

    so = output({"a": 4, "b": 3}, cached=[("a", 50, 5), ("b", 50, 5)], spec={"a": [1, 2, 3], "b": [1, 2]})
    scheduler = types.SimpleNamespace(
        requests={"a": FakeRequest(), "b": FakeRequest()},
        num_sampled_tokens_per_step=1,
        log_stats=log_stats,
        vllm_config=None,
    )
    mro = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[5, 6, 7], [5]])
    return so, scheduler, mro


def counters(cap):
    return {
        name: sum(p.value for p in cap.metric_points(name))
        for name in ("llm.server.spec_decode.draft_tokens", "llm.server.spec_decode.accepted_tokens")
    }


def test_spec_decode_counters_take_vllms_own_per_step_count_when_it_keeps_statistics(captured):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter

    core = EngineCoreAdapter(captured.telemetry)
    so, scheduler, mro = spec_step(log_stats=True)
    # unsampled step (no span open): nothing counted per request here ...
    core.update_from_output("Scheduler.update_from_output")(lambda so, mro: {}, scheduler, (so, mro), {})
    assert counters(captured) == {"llm.server.spec_decode.draft_tokens": 0, "llm.server.spec_decode.accepted_tokens": 0}
    # ... vLLM hands its own count to make_stats
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    core.make_stats("Scheduler.make_stats")(lambda spec: object(), scheduler, (stats,), {})
    assert counters(captured) == {"llm.server.spec_decode.draft_tokens": 5, "llm.server.spec_decode.accepted_tokens": 2}


def test_spec_decode_counters_count_by_vllms_rule_when_it_keeps_no_statistics(captured):
    from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter

    core = EngineCoreAdapter(captured.telemetry)
    so, scheduler, mro = spec_step(log_stats=False)
    core.update_from_output("Scheduler.update_from_output")(lambda so, mro: {}, scheduler, (so, mro), {})
    core.make_stats("Scheduler.make_stats")(lambda spec: None, scheduler, (None,), {})  # log_stats off: None
    assert counters(captured) == {"llm.server.spec_decode.draft_tokens": 5, "llm.server.spec_decode.accepted_tokens": 2}
