"""Memory soak: requests through llm-otel must leave nothing behind.

``core``: ``--requests`` (100k) synthetic requests through the telemetry core (sampled, 32 tokens
each, an error every 50th, an abort every 97th), spans into a BatchSpanProcessor whose exporter drops
them. ``engine``: ``--engine-requests`` (10k) requests through a real instrumented vLLM engine on the
tiny model, in batches. Resident memory (``/proc/self/statm``) is read every 5 % of the run after a
warm-up tenth; the report gives the least-squares slope in KiB per 1,000 requests and the first/last
readings. A flat run has a slope near 0 (allocator noise is a few KiB).

    .venv/bin/python benchmarks/soak.py --mode core|engine|all [--json out.json]
    .venv/bin/python benchmarks/soak.py --mode engine --uninstrumented   # vLLM's own slope, the baseline
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

PAGE = resource.getpagesize()


def rss_kib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1024


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares KiB per 1,000 requests."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return 1000 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0


def providers():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        exported = 0

        def export(self, spans):
            Drop.exported += len(spans)
            return SpanExportResult.SUCCESS

    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=1 << 15))
    reader = InMemoryMetricReader()
    return tp, MeterProvider(metric_readers=[reader]), reader, Drop


def soak_core(n: int) -> dict:
    from llm_otel.telemetry import Telemetry

    tp, mp, reader, drop = providers()
    tel = Telemetry(tp, mp)
    points = []
    warm = n // 10
    every = max(1, n // 20)
    t0 = time.perf_counter()
    for i in range(n):
        mono = time.monotonic()
        rec = tel.start_request(f"req-{i}", operation="chat", provider="vllm", model="tiny",
                                arrival_s=time.time(), input_tokens=16 + i % 64)
        rec.on_event("queued", mono)
        rec.on_event("scheduled", mono + 1e-4)
        for k in range(32 if i % 97 else 5):
            rec.on_tokens([k], mono + 2e-4 + k * 1e-4)
        if i % 50 == 0:
            rec.error_type = "EngineDeadError"
        elif i % 97 == 0:
            rec.error_type = "aborted"
        else:
            rec.finish_reason = "length"
        tel.finish(rec)
        if i % 5000 == 0:
            reader.get_metrics_data()  # what a periodic exporter does; keeps cumulative state honest
        if i >= warm and (i - warm) % every == 0:
            gc.collect()
            points.append((i, rss_kib()))
    tp.force_flush()
    return {"requests": n, "seconds": time.perf_counter() - t0, "spans_exported": drop.exported,
            "rss_first_kib": points[0][1], "rss_last_kib": points[-1][1],
            "slope_kib_per_1k_requests": slope(points)}


def top_growth(first, last, limit: int = 15) -> list[dict]:
    """The allocation sites (file:line) whose live Python memory grew most between two tracemalloc
    snapshots: bytes and block counts, largest growth first."""
    stats = last.compare_to(first, "lineno")
    return [{"site": str(st.traceback[0]), "size_diff_b": st.size_diff, "count_diff": st.count_diff,
             "size_b": st.size} for st in stats[:limit]]


def soak_engine(n: int, batch: int, instrumented: bool = True, trace_malloc: bool = False) -> dict:
    """``instrumented=False``: the same engine and workload without llm-otel, the baseline for the
    slope (vLLM's own caches grow too). ``trace_malloc``: also trace Python allocations of this
    process (the one ``LLM`` runs in) from the first reading to the end and report the sites that
    grew (slower: tracemalloc records every allocation)."""
    import tracemalloc

    from vllm import LLM, SamplingParams

    import llm_otel
    from llm_otel.demo.tiny_model import ensure_tiny_model

    tp, mp, reader, drop = providers()
    if instrumented:
        llm_otel.instrument(tp, mp, engines=["vllm"])
    llm = LLM(model=str(ensure_tiny_model()), dtype="float32", max_model_len=512, seed=0, block_size=32)
    params = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)
    words = open(os.__file__).read().split()
    points = []
    t0 = time.perf_counter()
    done = 0
    while done < n:
        prompts = [" ".join(words[(done + j) % 500:(done + j) % 500 + 8 + j % 24]) for j in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)
        done += batch
        reader.get_metrics_data()
        if done > n // 10:
            gc.collect()
            points.append((done, rss_kib()))
            if trace_malloc and len(points) == 1:
                tracemalloc.start(1)
                first = tracemalloc.take_snapshot()
                first_done = done
    tp.force_flush()
    growth = None
    if trace_malloc:
        gc.collect()
        last = tracemalloc.take_snapshot()
        traced = sum(st.size for st in last.statistics("filename")) - sum(
            st.size for st in first.statistics("filename"))
        growth = {"requests": done - first_done, "traced_growth_b": traced,
                  "bytes_per_request": traced / max(1, done - first_done), "top": top_growth(first, last)}
        tracemalloc.stop()
    if instrumented:
        llm_otel.uninstrument()
    out = {"instrumented": instrumented, "requests": done, "seconds": time.perf_counter() - t0,
           "spans_exported": drop.exported, "rss_first_kib": points[0][1], "rss_last_kib": points[-1][1],
           "slope_kib_per_1k_requests": slope(points),
           # bounded windows fill early in a run (the health score's 4,096 samples): the second half
           # shows what keeps growing
           "slope_second_half_kib_per_1k_requests": slope(points[len(points) // 2:]),
           "points": points}
    if growth:
        out["tracemalloc"] = growth
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["core", "engine", "all"], default="core")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--engine-requests", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--uninstrumented", action="store_true",
                        help="engine mode without llm-otel: the baseline slope of vLLM itself")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="engine mode: Python allocation sites that grew from the first reading to the end")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {}
    if args.mode in ("core", "all"):
        out["core"] = soak_core(args.requests)
        print("core  ", json.dumps(out["core"]), flush=True)
    if args.mode in ("engine", "all"):
        out["engine"] = soak_engine(args.engine_requests, args.batch, instrumented=not args.uninstrumented,
                                    trace_malloc=args.tracemalloc)
        print("engine", json.dumps(out["engine"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
