"""Device check of the GPU step timeline (issue 6), for a CUDA machine; finishes in well under 5 min.

What it does, on torch's current CUDA stream (the stream vLLM's model runs on):

1. **Ordered and complete**: ``--steps`` steps of a torch workload with varied kernel sizes
   (matmuls of 64..4096, elementwise ops, a reduction), each bracketed by the core's
   ``StepTracker.begin/end`` with the CuPy ring. Every step must get exactly one begin and one
   end record, begin <= end, and step i's end <= step i+1's begin (one stream, so device order).
2. **Accuracy**: each step's device duration from the ring (``%globaltimer``) against
   ``torch.cuda.Event`` elapsed time bracketing the same kernels; reports the error.
3. **Never blocks**: ``begin``/``end`` host time while the stream is busy with ~100 ms of work.
4. **Cost**: wall time per step of a launch-bound workload (tiny kernels) with and without the
   tracker; and per-step host cost of ``begin`` + ``end``.
5. **Overflow**: a small ring written faster than it is drained counts exactly what it lost.
6. **Clock**: the calibration window (offset error bound) and the queueing delay seen.
7. **Logit statistics** (issue 17): the worker's per-step reduction (``TorchLogitStats``: top-k,
   entropy, non-finite flag, then one transfer) on ``(rows, 131072)`` bf16 logits, rows 8/64/256,
   timed with CUDA events (device) and wall clock (host, including the transfer); checked
   against a float64 reference. Target: <= 50 us per step for 256 x 128k on an H200.
8. **MRv2 sampler hook**: ``WorkerAdapter.sampler_add_request`` / ``sampler_call`` driven with CUDA
   tensors through stand-ins of MRv2's ``Sampler`` / ``InputBatch`` (the fields the contract test
   holds to vLLM 0.32/0.33: req_ids, idx_mapping_np, cu_num_logits_np, ...): 256 requests, 32
   chosen, spans emitted at max_tokens, hook cost per step beside the bare sampler.
8b. **MRv2 speculative decoding and overlap** (issue 28): ``RejectionSampler.__call__`` driven the
   same way with 3 drafts per request: every emitted row reported (``num_sampled``), sampled
   log-probs against a reference; and the overlap figure - host time of a hooked sampler call
   queued behind ~2 ms of device work, no chosen row vs one (the statistics are copied to pinned
   memory with a non-blocking copy and an event, so both must stay far below 2 ms).
9. **NVTX**: step ranges recorded by tests/nvtx_tool/recorder.c as an NVTX injection tool (what
   Nsight attaches), when a C compiler and NVTX headers are present (or a prebuilt tool is given).
10. **NVML**: ``NvmlSource`` reads utilisation and memory of the visible GPUs.
11. **CUDA-graph capture while the drain thread polls** (case C23): torch graphs captured on the
   engine's thread between ring-recorded steps while the real drain thread polls events; every
   capture must succeed with llm-otel's capture gate. A control run with the gate bypassed
   counts how many captures the unguarded poller breaks (run last: a broken capture may leave
   CUDA in an error state).

Writes a short Markdown report (``--out``) and a JSON file next to it. Exit status 0 when every
check passed, 1 when one failed, 2 when the machine cannot run it (no CUDA / CuPy / torch).

``--cpu-dry-run`` runs the same code paths with the NumPy ring and host timers (no GPU needed;
numbers are meaningless) so the script itself is exercised where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))


def percentile(values, q):
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


class Env:
    """torch + CUDA (or the CPU dry run): streams, timing events, workload."""

    def __init__(self, dry: bool):
        import torch

        self.torch = torch
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        if not dry:
            torch.cuda.init()
        self.mats = {n: torch.randn(n, n, device=self.device, dtype=torch.float16 if not dry else torch.float32)
                     for n in (64, 256, 1024, 2048, 4096)}

    def stream(self):
        return None if self.dry else self.torch.cuda.current_stream().cuda_stream

    def sync(self):
        if not self.dry:
            self.torch.cuda.synchronize()

    def event(self):
        if self.dry:
            return HostEvent()
        return self.torch.cuda.Event(enable_timing=True)

    def work(self, step: int):
        """Varied kernel sizes: step-dependent matmul size and repeat count, plus small ops."""
        sizes = (64, 256, 1024, 2048, 4096) if not self.dry else (64, 256)
        n = sizes[step % len(sizes)]
        a = self.mats[n]
        reps = 1 + (step * 7) % 4
        for _ in range(reps):
            a = (a @ self.mats[n]).clamp_(-1, 1)
        return (a.float().sum() + a.abs().max()).item() if step < 0 else a

    def busy(self, ms: float):
        """Enqueue roughly ``ms`` of device work: torch's spin kernel (clock cycles at the GPU's
        clock rate), else 4096 matmuls."""
        torch = self.torch
        if not self.dry and hasattr(torch.cuda, "_sleep"):
            rate_khz = torch.cuda.get_device_properties(0).clock_rate if hasattr(
                torch.cuda.get_device_properties(0), "clock_rate") else 1_500_000
            torch.cuda._sleep(int(ms * rate_khz))
            return None
        a = self.mats[4096] if not self.dry else self.mats[256]
        for _ in range(max(1, int(ms / 2))):
            a = a @ self.mats[4096 if not self.dry else 256]
        return a


class HostEvent:
    def record(self, stream=None):
        self.t = time.perf_counter_ns()

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e6


def make_tracker(ring):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llm_otel.config import Settings
    from llm_otel.telemetry import Telemetry
    from llm_otel.telemetry.steps import StepTracker

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(tp, MeterProvider(metric_readers=[reader]), Settings.from_env({}))
    tracker = StepTracker(telemetry, backend=ring, nvtx=False, start_thread=False, step_timeout_s=60)
    return telemetry, tracker, exporter


def new_ring(dry: bool, capacity: int):
    from llm_otel.gpu.ring import CupyRing, NumpyRing

    return NumpyRing(capacity) if dry else CupyRing(capacity)


def check_order_and_accuracy(env: Env, steps: int, results: dict, failures: list):
    from llm_otel.gpu.ring import KIND_BEGIN, KIND_END

    ring = new_ring(env.dry, capacity=4 * steps + 16)
    telemetry, tracker, exporter = make_tracker(ring)
    polled = []
    real_poll = ring.poll

    def keep_poll():
        recs = real_poll()
        polled.extend((int(r["span_id"]), int(r["kind"]), int(r["timestamp"])) for r in recs)
        return recs

    ring.poll = keep_poll
    env.work(0)
    env.sync()
    events = []
    ctxs = []
    for i in range(steps):
        span = telemetry.tracer.start_span("llm.engine.step")
        ctx = tracker.begin([f"r{i % 8}"], parent=span.get_span_context(), phase="decode", stream=env.stream())
        e0, e1 = env.event(), env.event()
        e0.record()
        env.work(i)
        e1.record()
        tracker.end(ctx, stream=env.stream())
        events.append((e0, e1))
        ctxs.append(ctx)
        if i % 16 == 0:
            tracker.drain()  # concurrently with the running stream, as the drain thread does
    env.sync()
    deadline = time.monotonic() + 30
    while tracker._pending and time.monotonic() < deadline:
        tracker.drain()
        time.sleep(0.001)
    spans = {s.context.span_id: s for s in exporter.get_finished_spans()}
    # 1. ordered and complete
    by_step: dict[int, list] = {}
    for sid, kind, ts in polled:
        by_step.setdefault(sid, []).append((kind, ts))
    complete = sum(1 for c in ctxs if sorted(k for k, _ in by_step.get(c.span_id, [])) == [KIND_BEGIN, KIND_END])
    ordered = all(b[1] <= e[1] for c in ctxs for b, e in [sorted(by_step.get(c.span_id, [(1, 0), (2, 0)]))])
    seq_ordered = all(ctxs[i].device_end_ns is not None and ctxs[i + 1].device_begin_ns is not None
                      and ctxs[i].device_end_ns <= ctxs[i + 1].device_begin_ns for i in range(len(ctxs) - 1))
    results["steps"] = steps
    results["records_read"] = len(polled)
    results["steps_complete"] = complete
    results["overwritten"] = ring.overwritten
    results["begin_before_end"] = ordered
    results["steps_in_stream_order"] = seq_ordered
    # the device timing of each step is its child span llm.engine.step.device
    results["spans_with_device_time"] = sum(1 for s in spans.values() if "llm.engine.step.device.duration" in s.attributes)
    if complete != steps or ring.overwritten or not ordered or not seq_ordered:
        failures.append(f"records incomplete or out of order: {complete}/{steps} complete, overwritten "
                        f"{ring.overwritten}, begin<=end {ordered}, stream order {seq_ordered}")
    if results["spans_with_device_time"] != steps:
        failures.append(f"only {results['spans_with_device_time']}/{steps} steps got a device span")
    # 2. accuracy against CUDA events
    errors_us, rel = [], []
    for c, (e0, e1) in zip(ctxs, events):
        if c.device_duration_ns is None:
            continue
        ref_ms = e0.elapsed_time(e1)
        err = c.device_duration_ns / 1e3 - ref_ms * 1e3
        errors_us.append(err)
        if ref_ms > 0:
            rel.append(abs(err) / (ref_ms * 1e3))
    abs_err = [abs(e) for e in errors_us]
    results["duration_error_us"] = {
        "mean": statistics.fmean(errors_us) if errors_us else None,
        "p50_abs": percentile(abs_err, 50), "p99_abs": percentile(abs_err, 99), "max_abs": max(abs_err, default=None),
        "p50_rel": percentile(rel, 50), "p99_rel": percentile(rel, 99)}
    durations = [c.device_duration_ns / 1e3 for c in ctxs if c.device_duration_ns is not None]
    results["step_device_us"] = {"min": min(durations, default=None), "p50": percentile(durations, 50),
                                 "max": max(durations, default=None)}
    queue = [c.queue_delay_ns / 1e3 for c in ctxs if c.queue_delay_ns is not None]
    results["queue_delay_us"] = {"p50": percentile(queue, 50), "p99": percentile(queue, 99)}
    results["clock_error_us"] = ring.clock_error_ns / 1e3
    results["clock"] = ring.clock
    # with globaltimer granularity (up to ~1 us on some GPUs) and the two extra tiny kernels
    # inside the bracket, a healthy ring stays within a few tens of microseconds
    if not env.dry and errors_us and percentile(abs_err, 50) > 50:
        failures.append(f"median |device duration - CUDA event| = {percentile(abs_err, 50):.1f} us > 50 us")
    # the request span accumulations
    acc = tracker.request_device_time("r0")
    results["request_r0_device_steps"] = acc[1] if acc else 0
    tracker.close()


def check_never_blocks(env: Env, results: dict, failures: list):
    ring = new_ring(env.dry, capacity=64)
    telemetry, tracker, _ = make_tracker(ring)
    env.sync()
    env.busy(100)  # ~100 ms queued on the stream
    t0 = time.perf_counter_ns()
    ctx = tracker.begin(["a"], parent=telemetry.tracer.start_span("s").get_span_context(), stream=env.stream())
    env.work(1)
    tracker.end(ctx, stream=env.stream())
    tracker.drain()  # must not wait for the stream either
    host_us = (time.perf_counter_ns() - t0) / 1e3
    env.sync()
    tracker.drain()
    results["begin_end_drain_while_busy_us"] = host_us
    results["queue_delay_while_busy_ms"] = (ctx.queue_delay_ns or 0) / 1e6
    if not env.dry and host_us > 20_000:
        failures.append(f"begin/end/drain took {host_us:.0f} us while the stream was busy: something waited")
    if not env.dry and results["queue_delay_while_busy_ms"] < 20:
        failures.append(f"queue delay behind ~100 ms of queued work read {results['queue_delay_while_busy_ms']:.1f} ms "
                        "(launch -> execution mapping or clock calibration is off)")
    tracker.close()


def check_cost(env: Env, steps: int, results: dict):
    torch = env.torch
    x = torch.randn(64, 64, device=env.device)

    def tiny():
        y = x
        for _ in range(8):
            y = y * 1.0001 + 0.5
        return y

    def run(tracker, telemetry):
        env.sync()
        t0 = time.perf_counter_ns()
        for i in range(steps):
            ctx = tracker.begin(["a"], parent=telemetry.tracer.start_span("s").get_span_context(), stream=env.stream()) if tracker else None
            tiny()
            if tracker:
                tracker.end(ctx, stream=env.stream())
        env.sync()
        return (time.perf_counter_ns() - t0) / steps / 1e3

    ring = new_ring(env.dry, capacity=4 * steps + 16)
    telemetry, tracker, _ = make_tracker(ring)
    run(None, telemetry)
    run(tracker, telemetry)  # warm-up (kernel compile, events)
    base = [run(None, telemetry) for _ in range(3)]
    with_t = []
    for _ in range(3):
        with_t.append(run(tracker, telemetry))
        tracker.drain()
    results["launch_bound_step_us"] = {"without": min(base), "with": min(with_t),
                                      "added_per_step": min(with_t) - min(base)}
    # host cost of begin + end alone
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        tracker.end(tracker.begin(["a"], parent=telemetry.tracer.start_span("s").get_span_context(), stream=env.stream()),
                    stream=env.stream())
    results["begin_plus_end_host_us"] = (time.perf_counter_ns() - t0) / steps / 1e3
    env.sync()
    tracker.close()


def check_overflow(env: Env, results: dict, failures: list):
    ring = new_ring(env.dry, capacity=32)
    telemetry, tracker, _ = make_tracker(ring)
    for _ in range(50):  # 100 records into 32 slots, nobody draining
        tracker.end(tracker.begin(["a"], parent=telemetry.tracer.start_span("s").get_span_context(), stream=env.stream()),
                    stream=env.stream())
    env.sync()
    tracker.drain()
    results["overflow_overwritten"] = tracker.counts["overwritten"]
    if tracker.counts["overwritten"] != 100 - 32:
        failures.append(f"overflow counted {tracker.counts['overwritten']} lost records, expected 68")
    tracker.close()


def cuda_ms(env: Env, fn, reps: int):
    """Median device ms of ``fn`` between CUDA events, and median host us per call (synchronised)."""
    device, host = [], []
    for _ in range(reps):
        e0, e1 = env.event(), env.event()
        env.sync()
        t0 = time.perf_counter_ns()
        e0.record()
        fn()
        e1.record()
        env.sync()
        host.append((time.perf_counter_ns() - t0) / 1e3)
        device.append(e0.elapsed_time(e1))
    return percentile(device, 50), percentile(host, 50)


def check_logit_reduction(env: Env, results: dict, failures: list):
    import numpy as np

    from llm_otel.telemetry.logits import TorchLogitStats

    torch = env.torch
    vocab = 131072 if not env.dry else 4096
    dtype = torch.bfloat16 if not env.dry else torch.float32
    logits = (torch.randn(256, vocab, device=env.device) * 3).to(dtype)
    logits[3, 17] = float("nan")
    out = {}
    for rows in (8, 64, 256):
        index = torch.arange(rows, device=env.device)
        sampled = torch.randint(0, vocab, (rows,), device=env.device)
        reduce_only = lambda: TorchLogitStats(logits.index_select(0, index), 5)  # noqa: E731
        whole = lambda: TorchLogitStats(logits.index_select(0, index), 5).to_host(sampled)  # noqa: E731
        for _ in range(3):
            whole()
        dev_ms, _ = cuda_ms(env, reduce_only, 20)
        _, host_us = cuda_ms(env, whole, 20)
        out[rows] = {"device_us": dev_ms * 1e3, "with_transfer_host_us": host_us}
    stats, lp = TorchLogitStats(logits[:8], 5).to_host(torch.arange(8, device=env.device))
    ref = logits[:8].double().cpu().numpy()
    ref_lp = ref - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True)) - ref.max(1, keepdims=True)
    ref_ent = -(np.exp(ref_lp) * ref_lp).sum(1)
    ok = [i for i in range(8) if i != 3]
    ent_err = float(np.nanmax(np.abs(stats.entropy[ok] - ref_ent[ok])))
    top_ok = all(int(stats.top_ids[i, 0]) == int(np.argmax(ref[i])) for i in ok)
    results["logit_reduction"] = {"vocab": vocab, "dtype": str(dtype).split(".")[-1], "rows": out,
                                  "entropy_max_abs_err": ent_err, "top1_matches": top_ok,
                                  "nonfinite_row_flagged": bool(stats.nonfinite[3])}
    if not top_ok or ent_err > 1e-2 or not stats.nonfinite[3]:
        failures.append(f"logit statistics wrong on device: entropy err {ent_err:.2e}, top-1 ok {top_ok}, "
                        f"NaN row flagged {bool(stats.nonfinite[3])}")


class StandInSampler:
    """MRv2 ``vllm.v1.worker.gpu.sample.sampler.Sampler``: ``req_states`` (RequestState's
    ``req_id_to_index`` / ``index_to_req_id``), ``add_request(req_idx, sampling_params)``,
    ``__call__(logits, input_batch) -> SamplerOutput(sampled_token_ids (n, 1))``; sampling itself
    is an argmax here (vLLM's Triton kernels are not on this machine)."""

    def __init__(self):
        import types

        self.req_states = types.SimpleNamespace(req_id_to_index={}, index_to_req_id={})

    def add_request(self, req_idx, sampling_params):
        return None

    def __call__(self, logits, input_batch):
        import types

        return types.SimpleNamespace(sampled_token_ids=logits.argmax(dim=1).view(-1, 1))


def check_mrv2_hook(env: Env, results: dict, failures: list):
    import types

    import numpy as np

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llm_otel.config import Settings
    from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, CARRIER_TOPK_KEY
    from llm_otel.instrumentation.vllm.worker import WorkerAdapter
    from llm_otel.telemetry import Telemetry

    torch = env.torch
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    from opentelemetry.sdk.metrics import MeterProvider

    telemetry = Telemetry(tp, MeterProvider(), Settings.from_env({}))
    worker = WorkerAdapter(telemetry)
    sampler = StandInSampler()
    n, chosen_every, steps = 256, 8, 20
    vocab = 131072 if not env.dry else 4096
    add = worker.sampler_add_request("bench")
    for i in range(n):
        rid = f"req-{i}"
        slot = (i * 37) % 512
        sampler.req_states.req_id_to_index[rid] = slot
        sampler.req_states.index_to_req_id[slot] = rid
        extra = {CARRIER_KEY: f"00-{i + 1:032x}-{i + 1:016x}-01", CARRIER_TOPK_KEY: 5} if i % chosen_every == 0 else None
        add(sampler.add_request, sampler, (slot, types.SimpleNamespace(extra_args=extra, max_tokens=steps)), {})
    batch = types.SimpleNamespace(
        req_ids=[f"req-{i}" for i in range(n)], num_reqs=n,
        idx_mapping_np=np.array([(i * 37) % 512 for i in range(n)]), cu_num_logits_np=np.arange(n + 1),
        num_computed_tokens_np=np.full(n, 100), num_scheduled_tokens=np.ones(n, dtype=np.int64),
        prefill_len_np=np.full(n, 50))
    logits = (torch.randn(n, vocab, device=env.device) * 3).to(torch.bfloat16 if not env.dry else torch.float32)
    call = worker.sampler_call("bench")
    bare, hooked = [], []
    for _ in range(steps):
        env.sync()
        t0 = time.perf_counter_ns()
        sampler(logits, batch).sampled_token_ids.cpu()  # the engine copies its tokens to host too
        bare.append((time.perf_counter_ns() - t0) / 1e3)
        env.sync()
        t0 = time.perf_counter_ns()
        call(sampler.__call__, sampler, (logits, batch), {}).sampled_token_ids.cpu()
        hooked.append((time.perf_counter_ns() - t0) / 1e3)
    worker._logits.poll(wait=True)  # the last steps' statistics may still be on their way to host
    spans = [s for s in exporter.get_finished_spans() if s.name == "llm.logit_dist"]
    results["mrv2_hook"] = {"requests": n, "chosen": n // chosen_every, "steps": steps, "spans": len(spans),
                            "bare_sampler_us_p50": percentile(bare, 50), "hooked_us_p50": percentile(hooked, 50),
                            "errors": dict(telemetry.errors.counts)}
    if len(spans) != n // chosen_every or any(s.attributes.get("llm.logit.steps") != steps for s in spans):
        failures.append(f"MRv2 hook: {len(spans)} llm.logit_dist spans, expected {n // chosen_every} of {steps} steps")
    if telemetry.errors.counts:
        failures.append(f"MRv2 hook reported errors: {dict(telemetry.errors.counts)}")


class StandInRejectionSampler:
    """MRv2 ``vllm.v1.worker.gpu.spec_decode.rejection_sampler.RejectionSampler``: ``sampler``
    (the Sampler holding the chosen slots), ``__call__(logits, input_batch, draft_logits=None,
    invalid_drafts=None) -> SamplerOutput(sampled_token_ids (num_reqs, drafts + 1), num_sampled
    (num_reqs,))``; its outputs are given (vLLM's Triton kernels are not on this machine)."""

    def __init__(self, sampler, sampled, num_sampled):
        self.sampler = sampler
        self.sampled = sampled
        self.num_sampled = num_sampled

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        import types

        return types.SimpleNamespace(sampled_token_ids=self.sampled, num_sampled=self.num_sampled)


def _mrv2_worker(n: int, slots_chosen, max_tokens: int, drafts: int):
    """A WorkerAdapter with ``n`` requests added to a stand-in Sampler (chosen: ``slots_chosen``),
    an in-memory exporter and an MRv2 InputBatch stand-in of ``drafts + 1`` logit rows per request."""
    import types

    import numpy as np
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llm_otel.config import Settings
    from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, CARRIER_TOPK_KEY
    from llm_otel.instrumentation.vllm.worker import WorkerAdapter
    from llm_otel.telemetry import Telemetry

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(tp, MeterProvider(), Settings.from_env({}))
    worker = WorkerAdapter(telemetry)
    sampler = StandInSampler()
    add = worker.sampler_add_request("bench")
    for i in range(n):
        rid = f"req-{i}"
        sampler.req_states.req_id_to_index[rid] = i
        sampler.req_states.index_to_req_id[i] = rid
        extra = {CARRIER_KEY: f"00-{i + 1:032x}-{i + 1:016x}-01", CARRIER_TOPK_KEY: 5} if i in slots_chosen else None
        add(sampler.add_request, sampler, (i, types.SimpleNamespace(extra_args=extra, max_tokens=max_tokens)), {})
    w = drafts + 1
    batch = types.SimpleNamespace(
        req_ids=[f"req-{i}" for i in range(n)], num_reqs=n, idx_mapping_np=np.arange(n),
        cu_num_logits_np=np.arange(0, w * n + 1, w), num_computed_tokens_np=np.full(n, 100),
        num_scheduled_tokens=np.full(n, w, dtype=np.int64), prefill_len_np=np.full(n, 50))
    return worker, sampler, batch, exporter, telemetry


def check_spec_decode_and_overlap(env: Env, results: dict, failures: list):
    """MRv2 RejectionSampler hook on CUDA tensors (issue 28): every emitted token's target row is
    reported (``num_sampled`` per request), never a rejected draft, with log-probs equal to a
    reference; and the overlap figure: host time of a hooked sampler call queued behind ~2 ms of
    device work, with no chosen row vs one chosen row (a device sync on the step path would make
    the second ~2 ms), plus the wall time per pipelined step of each."""
    torch = env.torch
    n, drafts, steps = 64, 3, 10
    vocab = 131072 if not env.dry else 4096
    dtype = torch.bfloat16 if not env.dry else torch.float32
    chosen = set(range(0, n, 8))
    worker, sampler, batch, exporter, telemetry = _mrv2_worker(n, chosen, 10_000, drafts)
    gen = torch.Generator(device=env.device).manual_seed(5)
    logits = (torch.randn(n * (drafts + 1), vocab, device=env.device, generator=gen) * 3).to(dtype)
    sampled = torch.randint(0, vocab, (n, drafts + 1), device=env.device, generator=gen)
    num_sampled = torch.randint(1, drafts + 2, (n,), device=env.device, generator=gen).to(torch.int32)
    rejection = StandInRejectionSampler(sampler, sampled, num_sampled)
    call = worker.sampler_call("bench")
    for _ in range(steps):
        call(rejection.__call__, rejection, (logits, batch, None, None), {})
    worker.flush(0.0)
    spans = {s.parent.span_id - 1: s for s in exporter.get_finished_spans() if s.name == "llm.logit_dist"}
    ns = num_sampled.cpu().tolist()
    tokens = sampled.cpu()
    ref = torch.log_softmax(logits.float(), dim=1).cpu()
    wrong_counts = [i for i in chosen if i not in spans or spans[i].attributes["llm.logit.steps"] != steps * ns[i]]
    lp_err = 0.0
    for i in chosen:
        if i not in spans:
            continue
        events = [e for e in spans[i].events if e.name == "llm.logit.step"]
        for p, e in enumerate(events[: ns[i]]):
            want = float(ref[i * (drafts + 1) + p, int(tokens[i, p])])
            lp_err = max(lp_err, abs(e.attributes["llm.logit.sampled_logprob"] - want))
    # the overlap figure
    figures = {}
    for label, which in (("none", set()), ("one", {0})):
        w2, s2, b2, _, _ = _mrv2_worker(n, which, 10_000, drafts)
        rej2 = StandInRejectionSampler(s2, sampled, num_sampled)
        call2 = w2.sampler_call("bench")
        host_us = []
        env.sync()
        t0 = time.perf_counter_ns()
        for _ in range(30):
            env.busy(2.0)  # the step's forward pass, still running when the sampler is called
            t1 = time.perf_counter_ns()
            call2(rej2.__call__, rej2, (logits, b2, None, None), {})
            host_us.append((time.perf_counter_ns() - t1) / 1e3)
        env.sync()
        figures[label] = {"call_host_us_p50": percentile(host_us, 50),
                          "step_wall_us": (time.perf_counter_ns() - t0) / 1e3 / 30}
        w2.flush(0.0)
    results["spec_decode_overlap"] = {
        "requests": n, "drafts": drafts, "chosen": len(chosen), "steps": steps, "spans": len(spans),
        "wrong_step_counts": wrong_counts, "sampled_logprob_max_abs_err": lp_err, "overlap": figures,
        "errors": dict(telemetry.errors.counts)}
    if wrong_counts or len(spans) != len(chosen):
        failures.append(f"MRv2 spec decode: step counts wrong for requests {wrong_counts} ({len(spans)} spans)")
    if lp_err > 1e-3:
        failures.append(f"MRv2 spec decode: sampled log-prob error {lp_err:.2e}")
    if telemetry.errors.counts:
        failures.append(f"MRv2 spec decode hook reported errors: {dict(telemetry.errors.counts)}")
    if not env.dry and figures["one"]["call_host_us_p50"] > 1000:
        failures.append(f"a chosen row waits for the device: sampler call {figures['one']['call_host_us_p50']:.0f} us "
                        f"behind 2 ms of device work (none chosen: {figures['none']['call_host_us_p50']:.0f} us)")


NVTX_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from llm_otel.gpu.nvtx import NvtxRanges
ranges = NvtxRanges(enabled=True)
for i in range(100):
    ranges.begin_step(0x1000 + i, "decode")
    ranges.end_step(0x1000 + i)
print(ranges.active)
"""


def check_nvtx(results: dict, failures: list, tool: str | None):
    import shutil
    import subprocess
    import tempfile

    src_dir = os.path.join(HERE, "..", "..", "src")
    with tempfile.TemporaryDirectory() as tmp:
        if not tool:
            cc = shutil.which("cc") or shutil.which("gcc")
            headers = [d for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda")
                       if d and os.path.exists(os.path.join(d, "include", "nvtx3", "nvToolsExt.h"))]
            if cc is None or not headers:
                results["nvtx"] = "n/a: no C compiler or NVTX headers, and no prebuilt tool"
                return
            tool = os.path.join(tmp, "librecorder.so")
            subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", os.path.join(headers[0], "include"), "-o", tool,
                            os.path.join(HERE, "..", "..", "tests", "nvtx_tool", "recorder.c"), "-lpthread"],
                           check=True, capture_output=True, timeout=120)
        record = os.path.join(tmp, "nvtx.txt")
        env = dict(os.environ, NVTX_INJECTION64_PATH=os.path.abspath(tool), LLM_OTEL_NVTX_RECORD=record)
        env.pop("NVTX_DISABLE", None)
        proc = subprocess.run([sys.executable, "-c", NVTX_SCRIPT, src_dir], env=env, capture_output=True,
                              text=True, timeout=120)
        lines = open(record).read().splitlines() if os.path.exists(record) else []
    pushes = sum(1 for line in lines if line.startswith("push llm_otel llm.engine.step"))
    pops = sum(1 for line in lines if line.startswith("pop llm_otel"))
    results["nvtx"] = f"{pushes} step ranges pushed, {pops} popped (of 100)"
    if proc.returncode != 0 or pushes != 100 or pops != 100:
        failures.append(f"NVTX: {results['nvtx']}; {proc.stderr.strip()[-300:]}")


def check_nvml(results: dict, failures: list):
    from llm_otel.gpu.nvml import NvmlSource

    try:
        source = NvmlSource()
        util = source.read()
        devices = source.devices()
    except Exception as exc:  # noqa: BLE001
        results["nvml"] = f"n/a: {type(exc).__name__}: {exc}"
        failures.append(f"NVML: {results['nvml']}")
        return
    results["nvml"] = f"utilisation {util:.2f}, {len(devices)} device(s), first {devices[0] if devices else '-'}"


def check_graph_capture(env: Env, results: dict, failures: list, captures: int, control: bool):
    import threading

    from llm_otel.gpu import capture

    torch = env.torch
    key = "graph_capture_control" if control else "graph_capture"
    if env.dry:
        results[key] = "n/a (CPU dry run)"
        return
    ring = new_ring(False, capacity=8192)
    telemetry, tracker, _ = make_tracker(ring)
    tracker.drain_period_s = 0.0002
    tracker._start_thread = True
    capture.capture_gate.install()
    saved = capture.capture_gate.device_work
    if control:  # the unguarded poller: every drain pass may touch the device
        from contextlib import contextmanager

        @contextmanager
        def always():
            yield True

        capture.capture_gate.device_work = always
    x = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    failed, replays_ok, polls_during = 0, 0, 0
    polled = [0]
    real_poll = ring.poll

    def counting_poll():
        if capture.capture_gate.active:
            polled[0] += 1
        return real_poll()

    ring.poll = counting_poll
    try:
        with torch.cuda.stream(side):
            for i in range(captures):
                z = None
                ctx = tracker.begin([f"g{i}"], stream=side.cuda_stream)
                y = x @ x
                tracker.end(ctx, stream=side.cuda_stream)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, stream=side):
                        z = (y * 0.5 + 1.0).sum(dim=0)
                    graph.replay()
                    replays_ok += 1
                except Exception as exc:  # noqa: BLE001 - capture invalidated by another thread's CUDA call
                    failed += 1
                    results.setdefault(key + "_first_error", f"{type(exc).__name__}: {exc}"[:300])
                    try:
                        torch.cuda.synchronize()
                    except Exception:  # noqa: BLE001 - a broken context: stop here, report what we saw
                        break
                del z
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        if not control:
            raise
        results[key + "_aborted"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        capture.capture_gate.device_work = saved
        ring.poll = real_poll
        polls_during = polled[0]
        try:
            tracker.close()
        except Exception:  # noqa: BLE001 - after a broken control capture
            if not control:
                raise
    results[key] = {"captures": captures, "failed": failed, "replayed": replays_ok,
                    "polls_during_capture": polls_during, "drain_alive": threading.active_count()}
    if not control and (failed or polls_during):
        failures.append(f"CUDA-graph capture with the gate: {failed}/{captures} captures failed, "
                        f"{polls_during} polls during a capture")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "out", "device_check.md"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--captures", type=int, default=200, help="CUDA graphs captured while the drain polls")
    ap.add_argument("--no-control", action="store_true", help="skip the unguarded-capture control run")
    ap.add_argument("--nvtx-tool", default=os.environ.get("LLM_OTEL_NVTX_TOOL"),
                    help="a prebuilt tests/nvtx_tool/recorder.c (.so) when this machine cannot build it")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results: dict = {"python": platform.python_version(), "dry_run": args.cpu_dry_run}
    failures: list[str] = []
    try:
        import torch

        results["torch"] = torch.__version__
        if not args.cpu_dry_run:
            import cupy

            results["cupy"] = cupy.__version__
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            results["gpu"] = torch.cuda.get_device_name()
        env = Env(args.cpu_dry_run)
    except Exception as exc:  # noqa: BLE001
        print(f"device check cannot run here: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    for name, fn in (("order+accuracy", lambda: check_order_and_accuracy(env, args.steps, results, failures)),
                     ("never blocks", lambda: check_never_blocks(env, results, failures)),
                     ("cost", lambda: check_cost(env, max(200, args.steps), results)),
                     ("overflow", lambda: check_overflow(env, results, failures)),
                     ("logit reduction", lambda: check_logit_reduction(env, results, failures)),
                     ("MRv2 sampler hook", lambda: check_mrv2_hook(env, results, failures)),
                     ("MRv2 spec decode + overlap", lambda: check_spec_decode_and_overlap(env, results, failures)),
                     ("NVTX", lambda: check_nvtx(results, failures, args.nvtx_tool)),
                     ("NVML", lambda: (check_nvml(results, failures) if not args.cpu_dry_run
                                       else results.__setitem__("nvml", "n/a (CPU dry run)"))),
                     ("graph capture", lambda: check_graph_capture(env, results, failures, args.captures, False)),
                     ("graph capture control", lambda: (None if args.no_control else check_graph_capture(
                         env, results, failures, args.captures, True)))):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    results["seconds"] = round(time.monotonic() - t0, 1)
    results["failures"] = failures
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(args.out, "w") as f:
        f.write(report(results))
    print(report(results))
    return 1 if failures else 0


def fmt(v, nd=1):
    return "n/a" if v is None else f"{v:.{nd}f}"


def report(r: dict) -> str:
    e = r.get("duration_error_us", {})
    c = r.get("launch_bound_step_us", {})
    lines = [
        "# llm-otel GPU step timeline: device check",
        "",
        f"GPU: {r.get('gpu', 'none (CPU dry run)')} | torch {r.get('torch')} | cupy {r.get('cupy', '-')} | "
        f"python {r.get('python')} | {r.get('seconds')} s",
        "",
        "| check | result |",
        "|---|---|",
        f"| steps complete (begin+end records) | {r.get('steps_complete')}/{r.get('steps')} "
        f"(records read {r.get('records_read')}, overwritten {r.get('overwritten')}) |",
        f"| begin <= end, steps in stream order | {r.get('begin_before_end')}, {r.get('steps_in_stream_order')} |",
        f"| step spans with device times | {r.get('spans_with_device_time')}/{r.get('steps')} |",
        f"| step device time (us) min/p50/max | {fmt(r.get('step_device_us', {}).get('min'))} / "
        f"{fmt(r.get('step_device_us', {}).get('p50'))} / {fmt(r.get('step_device_us', {}).get('max'))} |",
        f"| ring duration - CUDA event (us): mean, p50/p99/max abs | {fmt(e.get('mean'), 2)}, {fmt(e.get('p50_abs'), 2)} / "
        f"{fmt(e.get('p99_abs'), 2)} / {fmt(e.get('max_abs'), 2)} |",
        f"| relative error p50 / p99 | {fmt(e.get('p50_rel'), 4)} / {fmt(e.get('p99_rel'), 4)} |",
        f"| launch -> execution queue delay (us) p50 / p99 | {fmt(r.get('queue_delay_us', {}).get('p50'))} / "
        f"{fmt(r.get('queue_delay_us', {}).get('p99'))} |",
        f"| clock ({r.get('clock')}) calibration half-window (us) | {fmt(r.get('clock_error_us'), 2)} |",
        f"| begin+end+drain while stream busy ~100 ms (us) | {fmt(r.get('begin_end_drain_while_busy_us'))} "
        f"(queue delay seen {fmt(r.get('queue_delay_while_busy_ms'))} ms) |",
        f"| launch-bound step (us) without / with tracker / added | {fmt(c.get('without'))} / {fmt(c.get('with'))} / "
        f"{fmt(c.get('added_per_step'))} |",
        f"| begin+end host cost per step (us) | {fmt(r.get('begin_plus_end_host_us'))} |",
        f"| overflow: 100 records into 32 slots, counted lost | {r.get('overflow_overwritten')} (expected 68) |",
    ]
    lr = r.get("logit_reduction") or {}
    for rows, v in sorted((lr.get("rows") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| logit stats ({rows} x {lr.get('vocab')} {lr.get('dtype')}): device us / host us with transfer | "
                     f"{fmt(v.get('device_us'))} / {fmt(v.get('with_transfer_host_us'))} |")
    if lr:
        lines.append(f"| logit stats vs float64: entropy max err, top-1, NaN row flagged | "
                     f"{lr.get('entropy_max_abs_err', 0):.2e}, {lr.get('top1_matches')}, {lr.get('nonfinite_row_flagged')} |")
    m = r.get("mrv2_hook") or {}
    if m:
        lines.append(f"| MRv2 sampler hook: spans / chosen, step us bare / hooked | {m.get('spans')}/{m.get('chosen')}, "
                     f"{fmt(m.get('bare_sampler_us_p50'))} / {fmt(m.get('hooked_us_p50'))} |")
    sd = r.get("spec_decode_overlap") or {}
    if sd:
        ov = sd.get("overlap") or {}
        lines.append(f"| MRv2 spec decode: spans / chosen, wrong step counts, sampled log-prob err | "
                     f"{sd.get('spans')}/{sd.get('chosen')}, {len(sd.get('wrong_step_counts') or [])}, "
                     f"{sd.get('sampled_logprob_max_abs_err', 0):.1e} |")
        lines.append(f"| overlap: sampler call host us behind 2 ms of device work, none / one chosen | "
                     f"{fmt((ov.get('none') or {}).get('call_host_us_p50'))} / "
                     f"{fmt((ov.get('one') or {}).get('call_host_us_p50'))} |")
        lines.append(f"| overlap: pipelined step wall us, none / one chosen | "
                     f"{fmt((ov.get('none') or {}).get('step_wall_us'))} / {fmt((ov.get('one') or {}).get('step_wall_us'))} |")
    lines.append(f"| NVTX | {r.get('nvtx', 'n/a')} |")
    lines.append(f"| NVML | {r.get('nvml', 'n/a')} |")
    for key, label in (("graph_capture", "graph capture while drain polls (gate)"),
                       ("graph_capture_control", "control: same without the gate")):
        g = r.get(key)
        if isinstance(g, dict):
            lines.append(f"| {label}: failed / captures, polls during capture | {g['failed']}/{g['captures']}, "
                         f"{g['polls_during_capture']} |")
        elif g is not None:
            lines.append(f"| {label} | {g} |")
    lines += [
        "",
        "Result: " + ("PASS" if not r.get("failures") else "FAIL"),
    ]
    lines += [f"- {f}" for f in r.get("failures", [])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
