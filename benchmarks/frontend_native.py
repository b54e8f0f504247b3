"""Where the offline vLLM frontend's CPU goes, with native frames: py-spy samples the frontend
process of ``overhead.py``'s offline workload (``_offline_worker.py``: 256 prompts x 64 tokens, the
engine core in its own process, OTLP to a sink in another process) for configurations side by side,
and every on-CPU sample is charged to whoever asked for the work:

* ``llm-otel``: the innermost ``llm_otel`` or ``vllm`` Python frame of the stack is llm-otel's
  (its hooks' own code and everything they call: the OpenTelemetry SDK, pickling, NumPy, the
  allocator and the garbage collector when they ran it);
* ``vllm``: that frame is vLLM's (including vLLM code that runs under an llm-otel wrapper: the
  wrapped original);
* ``other``: neither (the interpreter's start of a thread, gRPC's and torch's own threads, ...).

Samples of a thread waiting (for the GIL, a lock, a socket: the leaf is a libc wait) are
left out; ``gc`` counts the samples inside the cyclic garbage collector, whoever ran it. py-spy
pauses the process for each sample: read the shares and the differences between configurations,
not the seconds. Needs ``py-spy`` (``pip install py-spy``; not a dependency of llm-otel) and root or
ptrace rights; about 1.5 minutes per configuration; under ``flock /tmp/llm-otel-heavy.lock``.

    .venv/bin/python benchmarks/frontend_native.py --configs ag --passes 3 --json OUT.json

Output: per configuration, samples per pass (at ``--rate`` Hz) by charge and by thread, and the
llm-otel functions (innermost llm-otel frame) with the most samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# the innermost named native frame of a thread that is blocked, not running: lock and condition
# waits (the GIL's included), sleeps, child waits, polls (libc's own frames below them are unnamed)
BLOCKING = frozenset({
    "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock", "pthread_cond_timedwait", "pthread_cond_wait",
    "take_gil", "sem_clockwait", "sem_timedwait", "sem_wait", "do_futex_wait", "__futex_abstimed_wait_common",
    "epoll_wait", "poll", "ppoll", "select", "pselect", "os_waitpid", "wait4", "waitpid", "pysleep", "time_sleep",
    "clock_nanosleep", "nanosleep", "accept", "accept4", "recv", "recvfrom", "recvmsg", "zmq_poll",
    "read"})  # read(2) under Python code: a pipe or socket (the exporter process's status frames)


def _python_frame(frame: str) -> str | None:
    """``func (path.py:line)`` -> ``path.py``; None for a native frame."""
    if not frame.endswith(")") or ".py:" not in frame:
        return None
    return frame[frame.rfind("(") + 1:frame.rfind(":")]


def charge(stack: list[str]) -> str:
    """``llm-otel``, ``vllm`` or ``other`` for one sample's frames (outermost first)."""
    for frame in reversed(stack):
        path = _python_frame(frame)
        if path is None:
            continue
        if "llm_otel/" in path:
            return "llm-otel"
        if path.startswith("vllm/") or "/vllm/" in path:
            return "vllm"
    return "other"


def waiting(stack: list[str]) -> bool:
    """The sample's innermost named frame is a blocking call (:data:`BLOCKING`): the thread waits."""
    for frame in reversed(stack):
        if frame.startswith("0x"):  # an unnamed libc frame below the call
            continue
        return frame.split(" (", 1)[0] in BLOCKING
    return False


def summarise(raw: Path, passes: int) -> dict:
    by_charge: collections.Counter = collections.Counter()
    by_thread: collections.Counter = collections.Counter()
    ours: collections.Counter = collections.Counter()
    theirs: collections.Counter = collections.Counter()
    gc = waited = total = 0
    for line in raw.read_text().splitlines():
        head, _, count = line.rpartition(" ")
        if not head:
            continue
        n = int(count)
        frames = head.split(";")
        if frames[0].startswith("thread ("):  # "thread (TID): NAME" with --threads
            thread, stack = frames[0].partition(": ")[2] or "?", frames[1:]
        else:
            thread, stack = "?", frames
        if waiting(stack):
            waited += n
            continue
        total += n
        who = charge(stack)
        by_charge[who] += n
        by_thread[thread if not thread.startswith("Thread-") else "Thread-N"] += n
        if any("gc_collect" in f or "gc_collect_main" in f for f in stack):
            gc += n
        if who != "other":  # the innermost frame of whoever is charged
            mark = "llm_otel/" if who == "llm-otel" else "vllm/"
            inner = next(f for f in reversed(stack) if mark in (_python_frame(f) or ""))
            (ours if who == "llm-otel" else theirs)[
                inner.split(" (")[0] + " (" + mark + _python_frame(inner).split(mark)[-1] + ")"] += n
    per = 1.0 / passes
    return {"samples_per_pass": round(total * per, 1), "waiting_per_pass": round(waited * per, 1),
            "by_charge_per_pass": {k: round(v * per, 1) for k, v in by_charge.most_common()},
            "gc_per_pass": round(gc * per, 1),
            "by_thread_per_pass": {k: round(v * per, 1) for k, v in by_thread.most_common(8)},
            "llm_otel_functions_per_pass": {k: round(v * per, 1) for k, v in ours.most_common(15)},
            "vllm_functions_per_pass": {k: round(v * per, 1) for k, v in theirs.most_common(40)}}


def profile(config: str, args, sink: str, model: str, out_dir: Path) -> dict:
    from overhead import OfflineRunner

    runner = OfflineRunner(config, sys.executable, model, sink, args)
    runner.wait_ready()
    runner.run()  # warm-up pass, not sampled
    raw = out_dir / f"{config}.txt"
    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(runner.proc.pid), "--native", "--threads",
                            "--rate", str(args.rate), "--format", "raw", "--output", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # py-spy attached
    tokens = seconds = 0.0
    for _ in range(args.passes):
        runner.run()
        tokens += runner.last["output_tokens"]
        seconds += runner.last["seconds"]
    spy.send_signal(signal.SIGINT)
    err = spy.communicate(timeout=120)[1]
    runner.close()
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err[-500:]}")
    out = summarise(raw, args.passes)
    out.update(tokens_per_pass=tokens / args.passes, seconds_per_pass=round(seconds / args.passes, 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="ag", help="overhead.py's configuration letters")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))
    parser.add_argument("--keep", help="directory for py-spy's raw files")
    parser.add_argument("--json")
    args = parser.parse_args()

    from overhead import Sink

    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    out_dir = Path(args.keep or tempfile.mkdtemp(prefix="frontend-native-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = Sink()
    results = {}
    try:
        for config in args.configs:
            results[config] = profile(config, args, sink.endpoints["grpc"], model, out_dir)
            print(config, json.dumps(results[config], indent=1), flush=True)
    finally:
        sink.close()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rate_hz": args.rate,
              "passes": args.passes, "workload": f"{args.prompts} prompts x {args.tokens} tokens",
              "configs": results}
    base = results.get("a")
    if base:
        for config, r in results.items():
            if config != "a":
                r["minus_a_per_pass"] = {k: round(r["by_charge_per_pass"].get(k, 0) - base["by_charge_per_pass"].get(k, 0), 1)
                                         for k in ("llm-otel", "vllm", "other")}
                r["minus_a_per_pass"]["total"] = round(r["samples_per_pass"] - base["samples_per_pass"], 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({c: r.get("minus_a_per_pass") for c, r in results.items()}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
