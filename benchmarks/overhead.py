"""What tracing costs a vLLM engine: llm-otel against vLLM's own tracing and OpenLIT, side by side.

One command runs every configuration in the same session, each in its own long-lived process (so no
instrumentation state leaks between them), alternating them round by round in a rotating order, and
reports output tokens/s (median, min, max) and the ratio to the uninstrumented engine — both the
ratio of medians and the median of the per-round paired ratios (robust to a machine whose speed
drifts during the run). All traced configurations export to the same local OTLP gRPC sink
(``_sink.py``, its own process).

Configurations:
  a  uninstrumented
  b  llm-otel defaults (``llm_otel.instrument()`` / ``opentelemetry-instrument``): the adaptive
     sampler, which follows GPU utilisation, or engine occupancy on a host without NVML, within its
     trace budget (``LLM_OTEL_TRACES_PER_S``, 10/s: a pass's 256 prompts arrive within 0.2 s, so
     about 11 are traced); ``llm.logit_dist`` for 5 % of sampled requests
  c  llm-otel, 100 % sampling and ``llm.logit_dist`` for every request (logit statistics every step)
  d  vLLM's native tracing (``otlp_traces_endpoint`` / ``--otlp-traces-endpoint``, log stats on)
  e  OpenLIT's vLLM instrumentation (needs ``openlit``: ``bash benchmarks/setup.sh`` makes
     ``.venv-bench`` with it; skipped, and said so, without it)
  f  b with ``--set f:KEY=VALUE`` (an experiment)
  g  llm-otel defaults at 100 % head sampling (``OTEL_TRACES_SAMPLER=always_on``, no trace budget;
     ``llm.logit_dist`` for the default 5 %)

Workloads (``_workload.py``): ``offline`` = ``LLM.generate`` of 256 mixed-length prompts x 64 output
tokens; ``server`` = the OpenAI server, the same requests streamed by 16 concurrent clients.

    .venv/bin/python benchmarks/overhead.py --workload offline --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _workload  # noqa: E402

CONFIGS = {
    "a": "uninstrumented",
    "b": "llm-otel defaults",
    "c": "llm-otel, 100% sampling + logit stats every step",
    "d": "vLLM native tracing (100%)",
    "e": "OpenLIT vLLM instrumentation",
    "f": "llm-otel defaults + --set f:... (an experiment, e.g. one feature off)",
    "g": "llm-otel defaults at 100% sampling",
}
BENCH_VENV = ROOT / ".venv-bench"
SERVED = "tiny"


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="ERROR",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               # this checkout's llm_otel (not whichever one the venv was installed from), and _workload
               PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{HERE}")
    return env


EXTRA_ENV: dict[str, dict[str, str]] = {}  # --set CONFIG:KEY=VALUE


def config_env(config: str, sink: str) -> dict[str, str]:
    env = base_env()
    env["OTEL_SERVICE_NAME"] = f"bench-{config}"
    if config in ("b", "c", "f", "g"):
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    if config == "g":
        env.update(OTEL_TRACES_SAMPLER="always_on")
    if config == "c":
        env.update(OTEL_TRACES_SAMPLER="always_on", LLM_OTEL_LOGIT_DIST_RATIO="1")
    if config == "e":
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    env.update(EXTRA_ENV.get(config, {}))
    return env


def interpreter(config: str) -> str | None:
    """The Python that runs ``config``; None when it cannot run here (OpenLIT not installed)."""
    if config != "e":
        return sys.executable
    py = BENCH_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import openlit"], capture_output=True).returncode == 0:
        return str(py)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, all threads) of process ``pid`` ("frontend": the API server) and
    of its descendants ("engine": engine core, workers)."""
    import psutil

    try:
        root = psutil.Process(pid)
        out = {"frontend": sum(root.cpu_times()[:2]), "engine": 0.0, "exporter": 0.0}
        children = root.children(recursive=True)
    except psutil.Error:
        return {"frontend": 0.0, "engine": 0.0, "exporter": 0.0}
    from _offline_worker import _group

    for child in children:
        try:
            out[_group(child)] += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return out


class Sink:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_sink.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.endpoints = json.loads(self.proc.stdout.readline())

    def counts(self) -> dict:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


class OfflineRunner:
    """Drives one ``_offline_worker.py`` process."""

    def __init__(self, config: str, python: str, model: str, sink: str, args) -> None:
        self.proc = subprocess.Popen(
            [python, str(HERE / "_offline_worker.py"), "--config", config, "--model", model, "--sink", sink,
             "--prompts", str(args.prompts), "--tokens", str(args.tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=config_env(config, sink))

    def _line(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"benchmark worker exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def wait_ready(self) -> None:
        self._line()

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        r = self.last = self._line()
        return r["output_tokens"] / r["seconds"]

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self._line()
        self.proc.wait(timeout=120)


def server_command(config: str, python: str, model: str, sink: str, port: int) -> list[str]:
    """The command line that starts vLLM's OpenAI server on ``port`` instrumented as ``config`` says
    (zero-code ``opentelemetry-instrument`` for llm-otel, ``--otlp-traces-endpoint`` for vLLM's own
    tracing, ``openlit-instrument`` for OpenLIT); its environment is ``config_env(config, sink)``."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(_workload.MAX_MODEL_LEN), "--block-size", "32",
           "--seed", "0"]
    bindir = Path(python).parent
    if config in ("b", "c", "f", "g"):
        cmd = [str(bindir / "opentelemetry-instrument")] + cmd
    elif config == "d":
        cmd += ["--otlp-traces-endpoint", sink]
    elif config == "e":
        cmd = [str(bindir / "openlit-instrument"), "--otlp_endpoint", sink] + cmd
    return cmd


def wait_ready(proc: subprocess.Popen, port: int, log_name: str, timeout_s: float = 600) -> None:
    """Until vLLM's OpenAI server on ``port`` answers ``/health`` with 200; RuntimeError (naming
    ``log_name``) when ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready in {timeout_s:.0f} s; see {log_name}")


class ServerRunner:
    """One OpenAI server per configuration, loaded by concurrent streaming clients."""

    def __init__(self, config: str, python: str, model: str, sink: str, args) -> None:
        self.port = free_port()
        self.args = args
        cmd = server_command(config, python, model, sink, self.port)
        self.log = open(Path(args.log_dir) / f"server-{config}.log", "w")
        self.proc = subprocess.Popen(cmd, env=config_env(config, sink), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.prompts = _workload.prompts(args.prompts)

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.port, self.log.name)

    def run(self) -> float:
        cpu0 = process_cpu(self.proc.pid)
        total, seconds = asyncio.run(self._run())
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in process_cpu(self.proc.pid).items()}
        self.last = {"output_tokens": total, "seconds": seconds, "cpu_s": cpu}
        return total / seconds

    async def _run(self) -> float:
        import httpx

        sem = asyncio.Semaphore(self.args.clients)
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        total = 0

        retried = 0

        async def one(client, prompt):
            nonlocal total, retried
            async with sem:
                for attempt in range(3):
                    try:
                        async with client.stream("POST", url, json=_workload.completion_body(
                                prompt, self.args.tokens, SERVED)) as r:
                            r.raise_for_status()
                            async for line in r.aiter_lines():
                                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                                    usage = json.loads(line[6:]).get("usage")
                                    if usage:
                                        total += usage["completion_tokens"]
                        return
                    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                        # a pooled connection the server closed under us (2 loaded cores): once more
                        retried += 1
                        if attempt == 2:
                            raise

        # keep-alive shorter than uvicorn's 5 s, so a pooled connection is not reused as it closes
        limits = httpx.Limits(max_connections=self.args.clients, keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t = time.perf_counter()
            await asyncio.gather(*(one(client, p) for p in self.prompts))
            dt = time.perf_counter() - t
        if retried:
            print(f"[server] {retried} request(s) retried after a dropped connection", file=sys.stderr, flush=True)
        return total, dt

    def close(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def measure(workload: str, configs: list[str], model: str, sink: Sink, args) -> dict:
    runner_cls = OfflineRunner if workload == "offline" else ServerRunner
    runners, skipped = {}, {}
    try:
        for c in configs:
            py = interpreter(c)
            if py is None:
                skipped[c] = "openlit not installed (bash benchmarks/setup.sh)"
                continue
            # one at a time: engines starting together on 2 cores take longer than in turn
            runners[c] = runner_cls(c, py, model, sink.endpoints["grpc"], args)
            try:
                runners[c].wait_ready()
            except Exception as exc:  # noqa: BLE001 - one configuration that cannot start is reported
                print(f"[{workload}] {c} did not start: {exc}", file=sys.stderr, flush=True)
                skipped[c] = f"did not start ({exc})"
                try:
                    runners.pop(c).close()
                except Exception:  # noqa: BLE001 - it is already gone
                    pass
        for r in runners.values():
            r.run()  # warm-up, discarded
        spans_before = sink.counts()["spans"]
        results: dict[str, list[float]] = {c: [] for c in runners}
        cpu: dict[str, list[dict]] = {c: [] for c in runners}  # offline: CPU s per process group
        head_p: dict[str, list[list]] = {c: [] for c in runners}  # offline: sampling p at start, end of each pass
        order = list(runners)
        for rep in range(args.reps):
            rot = order[rep % len(order):] + order[:rep % len(order)]
            for c in rot:
                results[c].append(runners[c].run())
                last = getattr(runners[c], "last", None)
                if last and "cpu_s" in last:
                    cpu[c].append({k: 1e6 * v / last["output_tokens"] for k, v in last["cpu_s"].items()})
                if last and last.get("head_p") and None not in last["head_p"]:
                    head_p[c].append(last["head_p"])
            print(f"[{workload}] round {rep + 1}/{args.reps}: "
                  + ", ".join(f"{c}={results[c][-1]:.0f}" for c in order), file=sys.stderr, flush=True)
    finally:
        for r in runners.values():
            r.close()
    time.sleep(2)
    report = {"configs": {}, "skipped": skipped, "spans_exported": sink.counts()["spans"] - spans_before}
    base = results.get("a")
    for c, vals in results.items():
        entry = {"name": CONFIGS[c], "tokens_per_s": vals, "median": statistics.median(vals),
                 "min": min(vals), "max": max(vals)}
        if cpu.get(c):  # CPU ms per 1,000 output tokens (frontend process; engine core + workers)
            entry["cpu_ms_per_1k_tokens"] = {k: statistics.median(x[k] for x in cpu[c]) for k in cpu[c][0]}
        if head_p.get(c):
            entry["head_sampling_p"] = {"start": [p for p, _ in head_p[c]], "end": [p for _, p in head_p[c]]}
        if base:
            entry["ratio_of_medians"] = entry["median"] / statistics.median(base)
            entry["median_paired_ratio"] = statistics.median(v / b for v, b in zip(vals, base))
        report["configs"][c] = entry
    return report


def _cpu_cell(cpu: dict) -> str:
    """``frontend, engine`` CPU ms per 1k tokens, and llm-otel's exporter process when it ran."""
    exporter = cpu.get("exporter", 0.0)
    return (f"{cpu['frontend']:.0f}, {cpu['engine']:.0f}" + (f" (+{exporter:.0f} exporter)" if exporter >= 0.5 else "")
            + " |")


def markdown(reports: dict, args) -> str:
    lines = [f"Workload: {args.prompts} prompts (mixed lengths) x {args.tokens} output tokens, "
             f"{args.reps} rounds; server: {args.clients} concurrent streaming clients.", "",
             "| workload | config | tok/s median | min | max | ratio of medians | median paired ratio "
             "| CPU ms / 1k tokens: frontend, engine | head-sampling p per round: start→end of the pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for wl, rep in reports.items():
        for c, e in rep["configs"].items():
            lines.append(f"| {wl} | {c}: {e['name']} | {e['median']:.0f} | {e['min']:.0f} | {e['max']:.0f} | "
                         f"{e.get('ratio_of_medians', float('nan')):.3f} | "
                         f"{e.get('median_paired_ratio', float('nan')):.3f} | "
                         + (_cpu_cell(e["cpu_ms_per_1k_tokens"]) if "cpu_ms_per_1k_tokens" in e else "n/a |")
                         + (" " + ", ".join(f"{p0:.2g}→{p1:.2g}" for p0, p1 in zip(e["head_sampling_p"]["start"],
                                                                                 e["head_sampling_p"]["end"])) + " |"
                            if "head_sampling_p" in e else " |"))
        for c, why in rep["skipped"].items():
            lines.append(f"| {wl} | {c}: {CONFIGS[c]} | skipped: {why} | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["offline", "server", "all"], default="all")
    parser.add_argument("--configs", default="abcde")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--json", default=None)
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--set", action="append", default=[], metavar="CONFIG:KEY=VALUE",
                        help="extra environment for one configuration, e.g. f:LLM_OTEL_GPU_STEPS=off")
    args = parser.parse_args()
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown configuration(s) {''.join(unknown)!r}; known: {''.join(CONFIGS)}")
    for item in args.set:
        config, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        EXTRA_ENV.setdefault(config, {})[key] = value

    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    sink = Sink()
    reports = {}
    try:
        for wl in (["offline", "server"] if args.workload == "all" else [args.workload]):
            reports[wl] = measure(wl, [c for c in args.configs if c in CONFIGS], model, sink, args)
            # each workload's table as soon as it is done (the next one takes as long again)
            print(markdown({wl: reports[wl]}, args), flush=True)
            if args.json:
                out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs",
                       "args": vars(args), "reports": reports}
                Path(args.json).write_text(json.dumps(out, indent=2))
    finally:
        sink.close()


if __name__ == "__main__":
    main()
