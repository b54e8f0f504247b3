"""What speculative-decoding telemetry costs: CPU seconds per 1,000 output tokens of a vLLM engine
with ngram speculative decoding, uninstrumented against llm-otel, side by side in one run.

Configurations (each its own long-lived process, all started before measuring, rounds in a
rotating order, one warm-up pass each discarded - the method of ``overhead.py``):
  off  uninstrumented
  on0  llm-otel, 100 % head sampling, no ``llm.logit_dist`` (``LLM_OTEL_LOGIT_DIST_RATIO=0``)
  on1  llm-otel, 100 % head sampling, ``llm.logit_dist`` for every request (ratio 1.0): every
       step reduces each request's draft and bonus rows and stages them to host

Engine: the tiny local model, ``speculative_config={"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 3, "prompt_lookup_min": 1}``, vLLM's statistics on (its drafted/accepted
counters are reported, so the run shows drafts were made and accepted). Workload: 16 repetitive
prompts x 64 greedy output tokens (``ignore_eos``). All traced configurations export to the same
local OTLP gRPC sink (``_sink.py``).

    PYTHONPATH=src .venv/bin/python benchmarks/spec_decode_cost.py --reps 3 \\
        --json benchmarks/results/spec-decode-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIGS = {"off": "uninstrumented", "on0": "llm-otel 100% sampling, logit_dist ratio 0",
           "on1": "llm-otel 100% sampling, logit_dist ratio 1.0"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BASES = ["a b c a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2 3 4", "x y x y x y x y", "def f(): return f() def f():"]


def workload(n: int, tokens: int):
    from vllm import SamplingParams

    prompts = [f"{BASES[i % len(BASES)]} {i}" for i in range(n)]
    return prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def spec_counts(llm) -> dict[str, float]:
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {"drafted": 0.0, "accepted": 0.0}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += m.value
    return out


def child(args) -> None:
    """One configuration: build the engine, answer each ``run`` line with one JSON line."""
    from _offline_worker import cpu_seconds
    from vllm import LLM

    from llm_otel.demo.tiny_model import ensure_tiny_model

    if args.child != "off":
        import llm_otel

        llm_otel.instrument()
    llm = LLM(model=str(ensure_tiny_model()), dtype="float32", max_model_len=512, seed=0, block_size=32,
              speculative_config=dict(SPEC), disable_log_stats=False)
    prompts, params = workload(args.prompts, args.tokens)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        cpu0, spec0 = cpu_seconds(), spec_counts(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds().items()}
        spec = {k: v - spec0[k] for k, v in spec_counts(llm).items()}
        print(json.dumps({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt,
                          "cpu_s": cpu, "spec": spec}), flush=True)
    print(json.dumps({"done": True}), flush=True)


class Runner:
    def __init__(self, config: str, args, sink: str) -> None:
        from overhead import base_env

        env = base_env()
        env["OTEL_SERVICE_NAME"] = f"bench-spec-{config}"
        if config != "off":
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                       OTEL_TRACES_SAMPLER="always_on", LLM_OTEL_TRACES_PER_S="inf",
                       LLM_OTEL_LOGIT_DIST_RATIO="1" if config == "on1" else "0")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", config, "--prompts", str(args.prompts), "--tokens", str(args.tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def line(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"benchmark child exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.line()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from overhead import Sink

    sink = Sink()
    runners = {c: Runner(c, args, sink.endpoints["grpc"]) for c in CONFIGS}
    try:
        for r in runners.values():
            r.line()  # ready
        for r in runners.values():
            r.run()  # warm-up, discarded
        rows: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        order = list(CONFIGS)
        for rep in range(args.reps):
            for c in order[rep % len(order):] + order[: rep % len(order)]:
                rows[c].append(runners[c].run())
    finally:
        for r in runners.values():
            try:
                r.close()
            except Exception:  # noqa: BLE001
                r.proc.kill()
        counts = sink.counts()
        sink.close()
    summary = {}
    for c, runs in rows.items():
        per_1k = [1000 * (r["cpu_s"]["frontend"] + r["cpu_s"]["engine"]) / r["output_tokens"] for r in runs]
        summary[c] = {
            "label": CONFIGS[c],
            "cpu_s_per_1k_tokens_median": statistics.median(per_1k),
            "cpu_s_per_1k_tokens": per_1k,
            "frontend_cpu_s_per_1k": statistics.median(1000 * r["cpu_s"]["frontend"] / r["output_tokens"] for r in runs),
            "engine_cpu_s_per_1k": statistics.median(1000 * r["cpu_s"]["engine"] / r["output_tokens"] for r in runs),
            "tokens_per_s_median": statistics.median(r["output_tokens"] / r["seconds"] for r in runs),
            "output_tokens": runs[0]["output_tokens"],
            "drafted": [r["spec"]["drafted"] for r in runs],
            "accepted": [r["spec"]["accepted"] for r in runs],
        }
    base = summary["off"]["cpu_s_per_1k_tokens_median"]
    print("| config | CPU s / 1k output tokens (frontend + engine) | vs off | tokens/s | drafted / accepted per pass |")
    print("|---|---|---|---|---|")
    for c, s in summary.items():
        print(f"| {c}: {s['label']} | {s['cpu_s_per_1k_tokens_median']:.3f} | "
              f"{s['cpu_s_per_1k_tokens_median'] / base:.3f} | {s['tokens_per_s_median']:.0f} | "
              f"{s['drafted'][0]:.0f} / {s['accepted'][0]:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": summary, "sink": counts, "reps": args.reps, "prompts": args.prompts,
                       "tokens": args.tokens, "spec": SPEC}, f, indent=2)


if __name__ == "__main__":
    main()
