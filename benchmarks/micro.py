"""Microbenchmarks of llm-otel's hot paths (not part of the test run).

Each case is timed with ``timeit`` (best of ``--rounds`` repeats, so background load inflates less)
and printed per operation:

* ``token``: ``RequestRecord.on_tokens`` for one decoded token (what the engine hook adds per token);
* ``request``: a whole sampled request through the core - ``start_request`` + 64 tokens + ``finish``
  (span tree of request, ``llm.prompt`` and ``llm.token_stream`` spans, GenAI metrics), into an SDK
  provider whose exporter drops the spans; also unsampled (metrics only);
* ``sampler``: one root decision of the adaptive sampler vs the SDK's ``ParentBased(TraceIdRatio)``;
* ``logits``: full-vocabulary logit statistics (log-sum-exp, entropy, top-5) for batch 64/256 x vocab
  32k/128k, NumPy float32 and torch CPU float32 (torch only if installed); and the vLLM worker's
  chosen-rows path: 1 or 8 rows of a 256-row step, vocab 2,048 (the tiny benchmark model), 32k, 128k;
* ``ring``: device ring buffer record + drain on the NumPy backend (when ``llm_otel.gpu.ring`` exists).

    .venv/bin/python benchmarks/micro.py [--only token,request,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit

import numpy as np


def best_per_op(stmt, number: int, rounds: int) -> float:
    """Seconds per call of ``stmt`` (best round)."""
    return min(timeit.repeat(stmt, number=number, repeat=rounds)) / number


def bench_token(rounds: int) -> dict:
    from llm_otel.telemetry.record import RequestRecord

    rec = RequestRecord("r", operation="text_completion", provider="vllm", model="m", arrival_s=time.time(),
                        input_tokens=10)
    ids = [17]
    t = time.monotonic()
    per = best_per_op(lambda: rec.on_tokens(ids, t), 200_000, rounds)
    return {"on_tokens_1_token_ns": per * 1e9}


def _telemetry(sampled: bool):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from llm_otel.telemetry import Telemetry

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tp = TracerProvider(sampler=ALWAYS_ON if sampled else ALWAYS_OFF)
    tp.add_span_processor(SimpleSpanProcessor(Drop()))
    return Telemetry(tp, MeterProvider(metric_readers=[InMemoryMetricReader()]))


def one_request(tel, tokens: int = 64) -> None:
    now = time.time()
    mono = time.monotonic()
    rec = tel.start_request("req", operation="text_completion", provider="vllm", model="tiny",
                            arrival_s=now, input_tokens=32)
    rec.on_event("queued", mono)
    rec.on_event("scheduled", mono + 0.001)
    for i in range(tokens):
        rec.on_tokens([i], mono + 0.002 + i * 1e-3)
    rec.finish_reason = "length"
    tel.finish(rec)


def bench_request(rounds: int) -> dict:
    out = {}
    for sampled in (True, False):
        tel = _telemetry(sampled)
        per = best_per_op(lambda: one_request(tel), 2_000, rounds)
        out[f"request_64_tokens_{'sampled' if sampled else 'unsampled'}_us"] = per * 1e6
    return out


def bench_sampler(rounds: int) -> dict:
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    from llm_otel.gpu.nvml import UtilizationPoller
    from llm_otel.sampling import UtilizationPolicy, adaptive_sampler

    class Fixed:
        def read(self) -> float:
            return 0.8

    poller = UtilizationPoller(Fixed(), alpha=1.0)
    poller.sample()
    samplers = {"sdk_parentbased_ratio_ns": ParentBasedTraceIdRatio(0.25),
                "llm_otel_adaptive_ns": adaptive_sampler(UtilizationPolicy(floor=0.25, ceiling=0.25),
                                                         poller=poller)}
    ids = [random.getrandbits(128) for _ in range(20_000)]
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}
    out = {}
    for name, s in samplers.items():
        def run(s=s):
            for tid in ids:
                s.should_sample(None, tid, "chat m", None, attrs)
        out[name] = best_per_op(run, 1, rounds) / len(ids) * 1e9
    return out


def bench_logits(rounds: int) -> dict:
    from llm_otel.telemetry.logits import TorchLogitStats, logit_stats

    out = {}
    rng = np.random.default_rng(0)
    try:
        import torch
    except ImportError:
        torch = None
    for batch in (64, 256):
        for vocab in (32_000, 128_000):
            x = rng.standard_normal((batch, vocab), dtype=np.float32)
            out[f"numpy_b{batch}_v{vocab // 1000}k_ms"] = best_per_op(lambda: logit_stats(x, 5), 3, rounds) * 1e3
            if torch is not None:
                tx = torch.from_numpy(x)
                out[f"torch_b{batch}_v{vocab // 1000}k_ms"] = best_per_op(
                    lambda: TorchLogitStats(tx, 5).to_host(), 3, rounds) * 1e3
    if torch is not None:
        # the vLLM worker's path: only the rows of requests chosen for llm.logit_dist
        # (LLM_OTEL_LOGIT_DIST_RATIO) are gathered from a 256-row step and reduced
        for vocab in (2048, 32_000, 128_000):
            tx = torch.from_numpy(rng.standard_normal((256, vocab), dtype=np.float32))
            for rows in (1, 8):
                pick = list(range(rows))
                ids = torch.zeros(rows, dtype=torch.long)
                out[f"torch_chosen{rows}_of256_v{vocab}_ms"] = best_per_op(
                    lambda: TorchLogitStats(tx[pick], 5).to_host(ids), 20, rounds) * 1e3
    return out


def bench_ring(rounds: int) -> dict:
    """The NumPy ring (host clock) through the StepTracker, as an engine adapter drives it: begin and
    end around each step (engine thread), then the drain that emits each step's device span
    (``llm.engine.step.device`` under the step span whose ids came from the engine core)."""
    import itertools

    from llm_otel.telemetry.steps import StepTracker, step_parent

    tel = _telemetry(True)
    tracker = StepTracker(tel, backend="numpy", capacity=1 << 16, nvtx=False)
    tracker.wait_ready(10)
    ids = [f"req-{i}" for i in range(64)]
    tracker.drain()

    span_ids = itertools.count(1)

    def step():
        tracker.end(tracker.begin(ids, parent=step_parent(1, next(span_ids)), phase="decode"))

    n = 2_000
    per_step = best_per_op(step, n, rounds) / 1
    t = time.perf_counter()
    for _ in range(n):
        step()
    launched = time.perf_counter() - t
    t = time.perf_counter()
    tracker.drain()
    drained = time.perf_counter() - t
    tracker.close()
    return {"begin_end_per_step_batch64_us": per_step * 1e6, "drain_per_step_us": drained / n * 1e6,
            "launch_loop_per_step_us": launched / n * 1e6}


CASES = {"token": bench_token, "request": bench_request, "sampler": bench_sampler, "logits": bench_logits,
         "ring": bench_ring}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for name in args.only.split(","):
        results[name] = CASES[name](args.rounds)
        for k, v in results[name].items():
            print(f"{name:8s} {k:45s} {v:12.3f}" if isinstance(v, float) else f"{name:8s} {k:45s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
