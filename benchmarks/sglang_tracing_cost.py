"""Cost per 1k output tokens of tracing SGLang: llm-otel against SGLang's own ``--enable-trace``, on
SGLang 0.5.23's real server on CPU (.venv-sglang, the tiny Llama), one server per mode, each exporting
to an in-process OTLP receiver.

Modes: ``off`` (plain server), ``llm-otel`` (under ``opentelemetry-instrument``, every request
sampled), ``sglang`` (``--enable-trace``, SGLang's own spans only), ``both``. Per mode: 4 warm-up
requests, then ``--requests`` sequential ``/generate`` calls of ``--tokens`` tokens (ignore_eos).
Reported per 1k output tokens: client wall seconds and the CPU seconds of the server's whole process
tree (``/proc/<pid>/stat`` utime+stime of every process in its session, before and after), and the
spans received per request.

    python benchmarks/sglang_tracing_cost.py --requests 20 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from support import sglang_server  # noqa: E402
from support.otlp_receiver import OTLPReceiver  # noqa: E402

from llm_otel.demo.tiny_model import ensure_tiny_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(session: int) -> float:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # field 6 (session id), after the comm
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def run(mode: str, model: str, requests: int, tokens: int, log_dir: pathlib.Path, step_spans: str) -> dict:
    rx = OTLPReceiver().start()
    extra: tuple[str, ...] = ()
    if mode in ("sglang", "both"):
        extra = ("--enable-trace", "--otlp-traces-endpoint", rx.grpc_endpoint.replace("http://", ""))
    instrument = mode in ("llm-otel", "both")
    # llm-otel's defaults for the step-span budget (the tests' server raises it to span every step)
    env = {
        "LLM_OTEL_STEP_SPANS_PER_S": step_spans,
        "LLM_OTEL_LOGIT_DIST_RATIO": "0.05",
        "LLM_OTEL_LOGIT_EVENTS": "8",
        # the SDK's default export intervals (the test server shortens them to wait less)
        "OTEL_BSP_SCHEDULE_DELAY": "5000",
        "OTEL_METRIC_EXPORT_INTERVAL": "60000",
    }
    server = sglang_server.start(
        model, rx.grpc_endpoint, log_dir / f"{mode}.log", extra, instrument=instrument, env_overrides=env
    )
    try:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        for _ in range(4):
            server.post("/generate", body)
        time.sleep(2)
        spans0 = len(rx.spans())
        cpu0, t0 = tree_cpu_s(server.process.pid), time.perf_counter()
        out_tokens = 0
        for _ in range(requests):
            out_tokens += server.post("/generate", body)["meta_info"]["completion_tokens"]
        wall, cpu = time.perf_counter() - t0, tree_cpu_s(server.process.pid) - cpu0
        time.sleep(7)  # the last spans' export (OTEL_BSP_SCHEDULE_DELAY 5 s)
        spans = len(rx.spans()) - spans0
    finally:
        server.stop()
        rx.stop()
    k = out_tokens / 1000
    return {
        "mode": mode,
        "step_spans_per_s": step_spans if mode in ("llm-otel", "both") else None,
        "output_tokens": out_tokens,
        "wall_s_per_1k_tokens": round(wall / k, 3),
        "server_cpu_s_per_1k_tokens": round(cpu / k, 3),
        "spans_per_request": round(spans / requests, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--modes", default="off,llm-otel,sglang,both")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--step-spans-per-s", default="10", help="LLM_OTEL_STEP_SPANS_PER_S (llm-otel's default: 10)")
    args = parser.parse_args()
    model = str(ensure_tiny_model())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results.append(run(mode, model, args.requests, args.tokens, pathlib.Path(tmp), args.step_spans_per_s))
            print(json.dumps(results[-1]), flush=True)
    base = next((r for r in results if r["mode"] == "off"), None)
    if base:
        for r in results:
            r["extra_cpu_s_per_1k_tokens"] = round(
                r["server_cpu_s_per_1k_tokens"] - base["server_cpu_s_per_1k_tokens"], 3
            )
    print(json.dumps(results, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
