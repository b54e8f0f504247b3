"""The core's step API (llm_otel.telemetry.steps): ``llm.engine.step`` spans built by
EngineSteps for the layer that schedules; begin/end around a model execution, ring records
drained into the step's device child span ``llm.engine.step.device``, request device time - the
whole pipeline on the NumPy (host clock) ring, which is what runs wherever there is no GPU.

The step span is always owned and ended by the layer that schedules (issue 21): the tracker
never ends it, in whichever process the model runs."""

from __future__ import annotations

import logging
import time

import pytest
from conftest import make_captured
from opentelemetry.trace import SpanKind

from llm_otel.gpu import ring as R
from llm_otel.telemetry.steps import EngineSteps, StepTracker, step_parent

DEVICE_KEYS = {
    "llm.engine.step.device.start_ns",
    "llm.engine.step.device.end_ns",
    "llm.engine.step.device.duration",
    "llm.engine.step.device.queue_delay",
    "llm.engine.step.device.clock",
    "llm.engine.step.device.clock_error",
}


def tracker(cap, **kw):
    kw.setdefault("backend", "numpy")
    kw.setdefault("nvtx", False)
    return StepTracker(cap.telemetry, start_thread=False, **kw)


def test_device_times_go_on_a_child_of_the_step_span_which_its_owner_ends():
    cap = make_captured()
    steps = tracker(cap)
    span = cap.telemetry.tracer.start_span("llm.engine.step", start_time=time.time_ns())
    ctx = steps.begin(["a", "b"], parent=span.get_span_context(), phase="decode")
    time.sleep(0.002)
    steps.end(ctx)
    assert cap.finished() == []  # emitted only once its records are drained
    assert steps.drain() == 1
    (s,) = cap.finished()
    assert s.name == "llm.engine.step.device" and s.parent.span_id == span.get_span_context().span_id
    a = s.attributes
    assert DEVICE_KEYS <= set(a) and a["llm.engine.step.device.clock"] == "host"
    assert a["llm.engine.step.device.end_ns"] - a["llm.engine.step.device.start_ns"] == round(
        a["llm.engine.step.device.duration"] * 1e9
    )
    assert a["llm.engine.step.device.duration"] >= 0.002
    assert ctx.launch_ns <= a["llm.engine.step.device.start_ns"] <= a["llm.engine.step.device.end_ns"]
    assert (s.start_time, s.end_time) == (a["llm.engine.step.device.start_ns"], a["llm.engine.step.device.end_ns"])
    assert span.get_span_context().span_id == ctx.span_id
    assert span.is_recording()  # the tracker never ends the step span: its owner does
    end_ns = time.time_ns() + 1000
    span.end(end_time=end_ns)
    assert cap.finished()[-1].end_time == end_ns and not DEVICE_KEYS & set(cap.finished()[-1].attributes)


def test_request_device_time_accumulates_over_the_steps_that_served_it():
    cap = make_captured()
    steps = tracker(cap)
    durations = {"a": 0, "b": 0}
    for batch in (["a", "b"], ["a"], ["a", "b"]):
        ctx = steps.begin(batch, parent=cap.telemetry.tracer.start_span("llm.engine.step").get_span_context())
        steps.end(ctx)
        steps.drain()
        for rid in batch:
            durations[rid] += ctx.device_duration_ns
    secs, n = steps.request_device_time("a")
    assert n == 3 and secs == pytest.approx(durations["a"] / 1e9)
    assert steps.request_device_time("b")[1] == 2
    assert steps.request_device_time("a") is None  # popped


def test_telemetry_finish_puts_device_time_on_the_request_span():
    cap = make_captured()
    t = cap.telemetry
    rec = t.start_request(
        "r1", operation="text_completion", provider="vllm", model="m", arrival_s=time.time(), input_tokens=3
    )
    for _ in range(2):
        ctx = t.steps.begin(["r1"])  # no step span: device time only
        t.steps.end(ctx)
    rec.on_tokens([1, 2], time.monotonic())
    t.finish(rec)
    req = [s for s in cap.finished() if s.name == "text_completion m"][0]
    assert req.attributes["llm.request.device_steps"] == 2
    assert req.attributes["llm.request.device_time"] > 0
    t.steps.close()


def test_remote_step_span_gets_a_device_child_span():
    cap = make_captured()
    steps = tracker(cap)
    parent = step_parent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)
    ctx = steps.begin(["a", "b", "c"], parent=parent, phase="prefill")
    steps.end(ctx)
    steps.drain()
    (child,) = cap.finished()
    assert child.name == "llm.engine.step.device" and child.kind == SpanKind.INTERNAL
    assert child.parent.span_id == 0x00F067AA0BA902B7
    assert child.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert child.start_time == child.attributes["llm.engine.step.device.start_ns"]
    assert child.end_time == child.attributes["llm.engine.step.device.end_ns"]
    assert child.attributes["llm.engine.step.batch_size"] == 3


def test_unsampled_remote_step_emits_nothing_but_still_counts_device_time():
    cap = make_captured()
    steps = tracker(cap)
    ctx = steps.begin(["a"], parent=step_parent(1, 2, sampled=False))
    steps.end(ctx)
    steps.drain()
    assert cap.finished() == []
    assert steps.request_device_time("a")[1] == 1


def test_the_core_step_api_builds_the_step_span_with_links_and_the_device_child_under_it():
    cap = make_captured()
    steps = tracker(cap)
    engine = EngineSteps(cap.telemetry)
    req = cap.telemetry.tracer.start_span("text_completion m")
    assert engine.start([], start_ns=time.time_ns(), batch_size=1) is None  # no sampled request: no span
    start_ns = time.time_ns()
    span = engine.start(
        [req.get_span_context()], start_ns=start_ns, batch_size=1, prefill_tokens=3, decode_tokens=0, preempted=0
    )
    trace_id, span_id, sampled = engine.ids(span)
    ctx = steps.begin(["a"], parent=step_parent(trace_id, span_id, sampled))
    steps.end(ctx)
    steps.drain()
    end_ns = time.time_ns()
    engine.finish(span, end_ns=end_ns, cpu_time_s=0.001)
    dev, s = cap.finished()
    assert s.name == "llm.engine.step" and s.kind == SpanKind.INTERNAL
    assert [l.context.span_id for l in s.links] == [req.get_span_context().span_id]
    assert s.parent is None and (s.start_time, s.end_time) == (start_ns, end_ns)
    assert dict(s.attributes) == {
        "llm.engine.step.batch_size": 1,
        "llm.engine.step.prefill_tokens": 3,
        "llm.engine.step.decode_tokens": 0,
        "llm.engine.step.preempted": 0,
        "llm.engine.step.cpu_time": 0.001,
    }
    assert dev.name == "llm.engine.step.device" and dev.parent.span_id == s.context.span_id
    assert dev.context.trace_id == s.context.trace_id
    assert dev.attributes["llm.engine.step.batch_size"] == 1 and DEVICE_KEYS <= set(dev.attributes)


def test_in_process_worker_step_puts_device_times_on_a_child_of_the_engine_cores_span():
    """vLLM with one GPU: engine core and worker share a process (UniProcExecutor); the layout is
    the multi-process one's: the core ends its span, the device timing is a child span."""
    cap = make_captured()
    steps = tracker(cap)
    engine = EngineSteps(cap.telemetry)
    req = cap.telemetry.tracer.start_span("text_completion m")
    span = engine.start([req.get_span_context()], start_ns=time.time_ns(), batch_size=1)  # engine core
    ctx = steps.begin(["a"], parent=span.get_span_context())  # worker, same process
    steps.end(ctx)  # worker done
    end_ns = time.time_ns()
    engine.finish(span, end_ns=end_ns)  # the core ends its span at its own time, drained or not
    (s,) = cap.finished()
    assert s.name == "llm.engine.step" and s.end_time == end_ns and not DEVICE_KEYS & set(s.attributes)
    steps.drain()
    s, dev = cap.finished()
    assert dev.name == "llm.engine.step.device" and dev.parent.span_id == s.context.span_id
    assert DEVICE_KEYS <= set(dev.attributes)
    assert s.start_time <= dev.start_time <= dev.end_time <= s.end_time


def test_steps_without_records_are_completed_after_the_timeout():
    cap = make_captured()

    class Silent(R.NumpyRing):
        def poll(self):  # records never come back (e.g. the device hangs)
            return super().poll()[:0]

    steps = tracker(cap, backend=Silent(8), step_timeout_s=0.0)
    ctx = steps.begin(["a"], parent=step_parent(1, 2))
    steps.end(ctx)
    time.sleep(0.001)
    steps.drain()
    assert ctx.completed and ctx.device_duration_ns is None and steps._pending == {}
    assert cap.finished() == []  # no device times: no device span
    assert steps.counts["completed_without_device"] == 1


@pytest.mark.case("C13")
def test_ring_overflow_is_counted_in_a_self_metric():
    cap = make_captured()
    steps = tracker(cap, capacity=16)
    for _ in range(20):  # 40 records, nobody draining
        steps.end(steps.begin(["a"], parent=cap.telemetry.tracer.start_span("llm.engine.step").get_span_context()))
    steps.drain()
    (point,) = cap.metric_points("llm_otel.gpu.ring.overwritten")
    assert point.value == 24 and point.attributes == {"llm.gpu.ring.backend": "numpy"}
    assert steps.counts["overwritten"] == 24


class Exploding(R.NumpyRing):
    def __init__(self, fail_after):
        super().__init__(64)
        self.calls = 0
        self.fail_after = fail_after

    def record(self, span_id, kind, stream=None):
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().record(span_id, kind, stream)


def test_a_device_error_mid_run_turns_timing_off_with_one_log_line_and_spans_still_end(caplog):
    cap = make_captured()
    steps = tracker(cap, backend=Exploding(fail_after=3))
    parents = [step_parent(1, i) for i in range(1, 5)]
    ctxs = []
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        for parent in parents:
            ctxs.append(steps.begin(["a"], parent=parent))
            steps.end(ctxs[-1])
            steps.drain()
    assert steps.backend == "off"
    assert all(ctx.completed for ctx in ctxs)  # every step completed
    (dev,) = cap.finished()  # device times (and so a device span) only before the error
    assert dev.parent.span_id == 1 and DEVICE_KEYS <= set(dev.attributes)
    assert [ctx.device_duration_ns is not None for ctx in ctxs] == [True, False, False, False]
    lines = [r for r in caplog.records if "GPU step timing turned off" in r.getMessage()]
    assert len(lines) == 1
    assert cap.telemetry.errors.counts == {}  # handled, not a hook failure


def test_asking_for_cupy_without_it_logs_once_and_runs_without_a_ring(caplog):
    cap = make_captured()
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed")
    except Exception:  # noqa: BLE001
        pass
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        steps = tracker(cap, backend="cupy")
    assert steps.backend == "off"
    assert len([r for r in caplog.records if "GPU step timing off" in r.getMessage()]) == 1
    ctx = steps.begin(["a"], parent=step_parent(1, 2))
    steps.end(ctx)
    assert ctx.completed and ctx.device_duration_ns is None  # completed at once
    assert cap.finished() == []


def test_end_of_none_and_bad_input_never_raise():
    cap = make_captured()
    steps = tracker(cap)
    steps.end(None)
    assert steps.begin(["a"], parent=object()) is None  # not a SpanContext: counted, not raised
    assert cap.telemetry.errors.counts == {"gpu.step.begin": 1}


def test_drain_thread_completes_steps_without_anyone_calling_drain():
    cap = make_captured()
    steps = StepTracker(cap.telemetry, backend="numpy", nvtx=False, drain_period_s=0.001)
    steps.end(steps.begin(["a"], parent=step_parent(1, 2)))
    deadline = time.monotonic() + 5
    while not cap.finished() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [s.name for s in cap.finished()] == ["llm.engine.step.device"]
    steps.close()
    assert steps.backend == "off"


def test_close_completes_pending_steps():
    cap = make_captured()
    steps = tracker(cap)
    ctx = steps.begin(["a"], parent=step_parent(1, 2))  # never ended
    steps.close()
    assert ctx.completed and steps._pending == {}
    assert cap.finished() == []  # no end record: no device times, no device span


@pytest.mark.case("C12")
def test_no_prompt_text_reaches_nvtx_messages_or_ring_records():
    from test_gpu_nvtx import RecordingDomain

    from llm_otel.gpu.nvtx import NvtxRanges

    cap = make_captured()
    domain = RecordingDomain()
    ring = R.NumpyRing(16)
    steps = StepTracker(cap.telemetry, backend=ring, nvtx=NvtxRanges(domain=domain), start_thread=False)
    secret = "SECRET-PROMPT-7f3a"
    rec = cap.telemetry.start_request(
        "r1",
        operation="text_completion",
        provider="vllm",
        model="m",
        arrival_s=time.time(),
        input_tokens=3,
        prompt_text=secret,
    )
    sc = rec.span.get_span_context()
    ctx = steps.begin(["r1"], phase="prefill", request_spans={"r1": (sc.trace_id, sc.span_id)})
    words = ring._words.copy()
    steps.end(ctx)
    steps.end_requests(["r1"])
    messages = [c[1]["message"] for c in domain.calls if c[0] in ("push", "start")]
    assert all(secret not in m for m in messages)
    assert secret.encode() not in words.tobytes() and secret.encode() not in ring._words.tobytes()


def test_a_step_that_is_never_ended_is_completed_after_the_timeout():
    cap = make_captured()
    steps = tracker(cap, step_timeout_s=0.0)
    ctx = steps.begin(["a"], parent=step_parent(1, 2))
    time.sleep(0.001)
    steps.drain()
    assert ctx.completed and ctx.device_duration_ns is None and steps._pending == {}
    assert cap.finished() == []


def test_a_step_begun_before_the_ring_was_ready_ends_at_once_without_device_times():
    cap = make_captured()
    steps = tracker(cap, backend="off")  # as while CuPy is still being imported in the background
    ctx = steps.begin(["a"], parent=step_parent(1, 2))
    steps.ring = ring = R.NumpyRing(8)  # the ring becomes ready mid-step
    steps.end(ctx)
    assert ctx.completed and ctx.device_duration_ns is None  # at once, without device times
    assert cap.finished() == []
    assert len(ring.poll()) == 0  # no orphan end record
    assert steps.wait_ready(0) is True


def test_ended_requests_drop_their_sums_and_the_sums_are_bounded():
    cap = make_captured()
    steps = tracker(cap, max_requests=3)
    for rid in ("a", "b", "c", "d"):
        steps.end(steps.begin([rid]))
    steps.drain()
    assert list(steps._requests) == ["b", "c", "d"]  # "a", the oldest, went first
    steps.end_requests(["c"])
    assert list(steps._requests) == ["b", "d"]


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"request_ids": None}, "request_ids must be an iterable of request ids, got NoneType"),
        ({"request_ids": "r1"}, "request_ids must be an iterable of request ids, got str"),
        ({"request_ids": 7}, "request_ids must be an iterable of request ids, got int"),
        ({"request_ids": ["a"], "parent": object()}, "parent must be a SpanContext, got object"),
    ],
)
def test_bad_input_to_begin_is_one_log_line_without_traceback_and_starts_no_span(kwargs, problem, caplog):
    from opentelemetry.sdk.trace import SpanProcessor

    started = []

    class OnStart(SpanProcessor):
        def on_start(self, span, parent_context=None):
            started.append(span.name)

    cap = make_captured()
    cap.tracer_provider.add_span_processor(OnStart())
    steps = tracker(cap)
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        assert steps.begin(**kwargs) is None
        assert steps.begin(**kwargs) is None  # counted again, not logged again
    records = [r for r in caplog.records if r.name == "llm_otel"]
    assert len(records) == 1, [r.getMessage() for r in records]
    (record,) = records
    assert record.levelno == logging.WARNING and record.exc_info is None and "\n" not in record.getMessage()
    assert "gpu.step.begin ignored a call with bad input" in record.getMessage() and problem in record.getMessage()
    assert cap.telemetry.errors.counts == {"gpu.step.begin": 2}
    assert started == [] and cap.finished() == [] and steps.counts["steps"] == 0
    points = [
        p
        for p in cap.metric_points("llm_otel.instrumentation.errors")
        if p.attributes.get("llm.instrumentation.hook") == "gpu.step.begin"
    ]
    assert [(p.attributes["error.type"], p.value) for p in points] == [("invalid_input", 2)]
    steps.end(steps.begin(("a", "b"), parent=step_parent(1, 2)))  # good input still works after
    steps.drain()
    assert [s.name for s in cap.finished()] == ["llm.engine.step.device"]


def test_bad_input_to_end_is_one_log_line_and_a_real_step_still_ends(caplog):
    cap = make_captured()
    steps = tracker(cap)
    ctx = steps.begin(iter(["a", "b"]), parent=step_parent(1, 2))  # any iterable, read once
    assert ctx.request_ids == ("a", "b")
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        steps.end("not a context")
    (record,) = [r for r in caplog.records if r.name == "llm_otel"]
    assert record.exc_info is None and "gpu.step.end ignored a call with bad input" in record.getMessage()
    assert cap.telemetry.errors.counts == {"gpu.step.end": 1}
    steps.end(ctx)
    steps.drain()
    assert [s.name for s in cap.finished()] == ["llm.engine.step.device"]
