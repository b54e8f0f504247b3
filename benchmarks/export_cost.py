"""Serving-process CPU per traced request: spans exported in process (SDK batch span processor,
OTLP encoding in its thread) vs by the exporter process (``LLM_OTEL_EXPORT_PROCESS``, default).

Each mode runs in a fresh interpreter (``--mode`` internal) with providers built exactly as
``llm_otel.instrument()`` builds them (:func:`llm_otel.process.providers.build_providers`, 100 %
sampling), exporting over OTLP/gRPC to a real receiver in another process (its decoding is not
counted). A request is ``start_request`` + 64 tokens + ``finish``: request span, ``llm.prompt``,
``llm.token_stream`` with events, and the GenAI metrics (recorded here in both modes; ``--no-metrics``
shows the span part alone). Measured: this process's CPU time
(``time.process_time``: every thread, so the batch processor's encoding counts) over N requests
plus the final flush, divided by N; the exporter process's CPU is reported separately
(``resource.getrusage(RUSAGE_CHILDREN)`` after it exited).

    .venv/bin/python benchmarks/export_cost.py [--requests 3000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _receiver() -> tuple[subprocess.Popen, str]:
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from support.otlp_receiver import OTLPReceiver\n"
            "rx = OTLPReceiver().start(); print(rx.grpc_endpoint, flush=True)\n"
            "sys.stdin.read()\n") % os.path.join(HERE, "..", "tests")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def run_mode(mode: str, requests: int) -> dict:
    os.environ["LLM_OTEL_EXPORT_PROCESS"] = "true" if mode == "process" else "false"
    os.environ["OTEL_TRACES_SAMPLER"] = "parentbased_always_on"
    # metrics are recorded in the serving process in both modes (exported over OTLP every 60 s)
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "60000")
    sys.path.insert(0, HERE)
    from micro import one_request

    from llm_otel.config import Settings
    from llm_otel.export.offload import request_outlets
    from llm_otel.process.providers import build_providers
    from llm_otel.telemetry import Telemetry

    tp, mp = build_providers(Settings.from_env(), shutdown_on_exit=False)
    tel = Telemetry(tp, mp, outlets=request_outlets(tp, mp))  # as instrument() wires it
    for _ in range(200):  # warm-up: imports, exporter process start, first gRPC connection
        one_request(tel)
    tp.force_flush(30_000)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(requests):
        one_request(tel)
    tp.force_flush(60_000)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    tp.shutdown()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"mode": mode, "cpu_ms_per_request": cpu / requests * 1e3, "wall_ms_per_request": wall / requests * 1e3,
            "exporter_process_cpu_s_total": children.ru_utime + children.ru_stime}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-metrics", action="store_true", help="OTEL_METRICS_EXPORTER=none")
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.requests)))
        return
    receiver, endpoint = _receiver()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    if args.no_metrics:
        env["OTEL_METRICS_EXPORTER"] = "none"
    results: dict[str, list] = {"inprocess": [], "process": []}
    try:
        for _ in range(args.rounds):  # alternate, so drift in background load hits both alike
            for mode in results:
                out = subprocess.run([sys.executable, __file__, "--mode", mode, "--requests", str(args.requests)],
                                     env=env, capture_output=True, text=True, check=True)
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        receiver.stdin.close()
        receiver.wait(10)
    summary = {}
    for mode, runs in results.items():
        best = min(r["cpu_ms_per_request"] for r in runs)
        summary[mode] = {"cpu_ms_per_request_best": best,
                         "cpu_ms_per_request_all": [round(r["cpu_ms_per_request"], 4) for r in runs],
                         "exporter_process_cpu_ms_per_request": min(
                             r["exporter_process_cpu_s_total"] for r in runs) / (args.requests + 200) * 1e3}
        print(f"{mode:10s} serving-process CPU per traced request: {best:.3f} ms (runs: "
              f"{summary[mode]['cpu_ms_per_request_all']}); exporter process: "
              f"{summary[mode]['exporter_process_cpu_ms_per_request']:.3f} ms")
    summary["ratio_inprocess_over_process"] = (summary["inprocess"]["cpu_ms_per_request_best"]
                                               / summary["process"]["cpu_ms_per_request_best"])
    print(f"ratio in-process / exporter process: {summary['ratio_inprocess_over_process']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)


if __name__ == "__main__":
    main()
