"""CPU seconds per 1k output tokens of every process of SGLang's server tree, per configuration,
interleaved (off, llm-otel, ..., off, llm-otel, ...) so that machine noise spreads over all of them.

SGLang 0.5.23's real server on CPU (.venv-sglang, the tiny Llama; tests/support/sglang_server.py),
exporting to an in-process OTLP receiver. Configurations: ``off`` (plain server), ``llm-otel``
(``opentelemetry-instrument``, every request sampled, the SDK's default step-span budget and export
intervals), ``llm-otel-noproc`` (the same with ``LLM_OTEL_EXPORT_PROCESS=false``: spans exported by a
thread of the process that made them), ``sglang`` (``--enable-trace``), and ``llm-otel-before`` (``llm-otel`` from ``--before-src``, another
checkout's ``src``, e.g. ``git archive <commit> src``). Per run: 4 warm-up requests,
an idle window (``--idle-s``: CPU per second of each process while no request runs), then
``--requests`` ``/generate`` calls of ``--tokens`` tokens (ignore_eos) from ``--concurrency`` client
threads. Each process of the server's session is read from ``/proc/<pid>/stat`` (utime+stime) and
named by its role: ``http`` (launcher, FastAPI + TokenizerManager), ``scheduler``, ``detokenizer``,
``exporter:<role of its parent>`` (llm-otel's exporter process), ``other``.

    python benchmarks/sglang_process_cost.py --repeats 3 --json benchmarks/results/sglang-process-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

from support import sglang_server  # noqa: E402
from support.otlp_receiver import OTLPReceiver  # noqa: E402

from llm_otel.demo.tiny_model import ensure_tiny_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
MODES = {
    "off": (False, {}, ()),
    "llm-otel": (True, {}, ()),
    "llm-otel-before": (True, {}, ()),  # llm-otel from --before-src (PYTHONPATH), e.g. the commit before a fix
    "llm-otel-noproc": (True, {"LLM_OTEL_EXPORT_PROCESS": "false"}, ()),
    "sglang": (False, {}, ("--enable-trace",)),
}


def session_procs(session: int) -> dict[int, tuple[int, float]]:
    """pid -> (ppid, utime+stime seconds) of every process in ``session``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:
            out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def roles(session: int, procs: dict[int, tuple[int, float]]) -> dict[int, str]:
    def base(pid: int) -> str:
        if pid == session:
            return "http"
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "other"
        if "llm_otel.export.offload" in cmd:
            return "exporter"
        for name in ("scheduler", "detokenizer"):
            if f"sglang::{name}" in cmd:
                return name
        return "other"

    out = {pid: base(pid) for pid in procs}
    for pid, role in out.items():
        if role == "exporter":
            out[pid] = f"exporter:{out.get(procs[pid][0], 'other')}"
    return out


def by_role(session: int, before: dict, after: dict, names: dict[int, str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for pid, (_, cpu) in after.items():
        role = names.get(pid) or roles(session, after).get(pid, "other")
        total[role] = total.get(role, 0.0) + cpu - before.get(pid, (0, 0.0))[1]
    return total


def run(mode: str, model: str, args, log_dir: pathlib.Path) -> dict:
    instrument, env_extra, extra = MODES[mode]
    rx = OTLPReceiver().start()
    if extra:
        extra = (*extra, "--otlp-traces-endpoint", rx.grpc_endpoint.replace("http://", ""))
    env = {
        "LLM_OTEL_STEP_SPANS_PER_S": "10",  # the SDK's defaults (the test server raises these)
        "LLM_OTEL_LOGIT_DIST_RATIO": "0.05",
        "LLM_OTEL_LOGIT_EVENTS": "8",
        "OTEL_BSP_SCHEDULE_DELAY": "5000",
        "OTEL_METRIC_EXPORT_INTERVAL": "60000",
        **env_extra,
    }
    if mode == "llm-otel-before":
        env["PYTHONPATH"] = args.before_src
    server = sglang_server.start(
        model, rx.grpc_endpoint, log_dir / f"{mode}.log", extra, instrument=instrument, env_overrides=env
    )
    sid = server.process.pid
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": args.tokens, "ignore_eos": True}}
    try:
        for _ in range(4):
            server.post("/generate", body)
        time.sleep(2)
        p0 = session_procs(sid)
        names = roles(sid, p0)
        time.sleep(args.idle_s)
        p1 = session_procs(sid)
        idle = by_role(sid, p0, p1, names)
        spans0 = len(rx.spans())
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(pool.map(lambda _: server.post("/generate", body), range(args.requests)))
        wall = time.perf_counter() - t0
        p2 = session_procs(sid)
        busy = by_role(sid, p1, p2, {**names, **roles(sid, p2)})
        time.sleep(7)  # the last spans' export (OTEL_BSP_SCHEDULE_DELAY 5 s)
        spans = len(rx.spans()) - spans0
    finally:
        server.stop()
        rx.stop()
    k = sum(o["meta_info"]["completion_tokens"] for o in outs) / 1000
    return {
        "mode": mode,
        "output_tokens": round(k * 1000),
        "wall_s_per_1k_tokens": round(wall / k, 3),
        "cpu_s_per_1k_tokens": {r: round(v / k, 3) for r, v in sorted(busy.items())},
        "cpu_s_per_1k_tokens_total": round(sum(busy.values()) / k, 3),
        "idle_cpu_s_per_s": {r: round(v / args.idle_s, 4) for r, v in sorted(idle.items())},
        "processes": dict(sorted((r, list(names.values()).count(r)) for r in set(names.values()))),
        "spans_per_request": round(spans / args.requests, 1),
    }


def summary(results: list[dict]) -> dict:
    out: dict = {}
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]

        def med(values: list[float]) -> dict:
            return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}

        role_names = sorted({k for r in rs for k in r["cpu_s_per_1k_tokens"]})
        out[mode] = {
            "wall_s_per_1k_tokens": med([r["wall_s_per_1k_tokens"] for r in rs]),
            "cpu_s_per_1k_tokens_total": med([r["cpu_s_per_1k_tokens_total"] for r in rs]),
            "cpu_s_per_1k_tokens": {k: med([r["cpu_s_per_1k_tokens"].get(k, 0.0) for r in rs]) for k in role_names},
            "idle_cpu_s_per_s_total": med([round(sum(r["idle_cpu_s_per_s"].values()), 4) for r in rs]),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--label", default="", help="recorded with the results")
    parser.add_argument("--before-src", help="the src/ of another llm-otel, for the mode llm-otel-before")
    args = parser.parse_args()
    model = str(ensure_tiny_model())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in args.modes.split(","):
                results.append({"repeat": rep, **run(mode, model, args, pathlib.Path(tmp))})
                print(json.dumps(results[-1]), flush=True)
    doc = {
        "label": args.label,
        "workload": f"{args.requests} x /generate {args.tokens} tokens, concurrency {args.concurrency}, "
        f"{args.repeats} interleaved repeats",
        "summary": summary(results),
        "runs": results,
    }
    print(json.dumps(doc["summary"], indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
