"""Which ``llm_otel`` modules one vLLM request's path and one engine step's path cross, and how often.

Issue 21 (one core owns the span model) is judged partly by how many modules a request and a step
pass through; this counts them on a real engine instead of by reading code. It runs vLLM's offline
``LLM`` on the tiny local model (``llm_otel.demo.tiny_model.ensure_tiny_model``) with the engine
core and the worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``UniProcExecutor``), so
one profiler sees the frontend, engine-core and worker hooks; llm-otel is instrumented the way a
user does it (``llm_otel.instrument()``, providers from ``OTEL_*`` exporting OTLP gRPC to the local
sink ``_sink.py``), at 100 % sampling: ``always_on`` head sampler, no trace budget, a step span for
every step, ``llm.logit_dist`` for every request (so the worker's logit-statistics hooks run).

After one unprofiled warm-up request (first-use creation - instruments, the step tracker, the
exporter process - is not the per-request path), ``sys.setprofile`` (this thread) and
``threading.setprofile`` (every thread started after the script starts: the exporter writer, the
signals thread...) record every Python call into a function of an ``llm_otel.*`` module during one
``LLM.generate`` of one prompt, plus ``--settle`` seconds for the background threads to export it.

Each call is attributed to the innermost llm-otel hook wrapper on its thread's stack (the wrapt
wrappers of the vLLM hook table ``llm_otel.instrumentation.vllm.hooks.HOOKS``): hooks whose factory
starts with ``core.`` or ``worker.`` are the **step** path (engine core: schedule, step, stats;
worker: model execution, sampling), all others the **request** path (``LLM.generate``,
``OutputProcessor.add_request`` = start, ``process_outputs`` = tokens and finish). Inside the
request path, calls under ``Telemetry.finish`` are also counted as the ``finish`` phase. Calls on
other threads are listed per thread name (``llm-otel-offload`` is the export of the request's spans
to the exporter process; periodic threads may add their own ticks). Python calls only (C functions
are not counted); a generator's resumption counts as a call, as the interpreter reports it.

    flock /tmp/llm-otel-heavy.lock .venv/bin/python benchmarks/module_paths.py \
        --json benchmarks/results/module-paths-before.json

Prints a table: per path, modules crossed and calls (for the step path per step: median and
maximum over the request's steps), then calls per module.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# The engine and llm-otel read these at import/instrument time: set before either is imported.
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core + worker in this process: one profiler
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OTEL_SERVICE_NAME": "llm-otel-module-paths",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    "OTEL_METRICS_EXPORTER": "none",  # the periodic metric export is not part of a request's path
    "OTEL_TRACES_SAMPLER": "always_on",  # 100 % sampling
    "LLM_OTEL_TRACES_PER_S": "inf",
    "LLM_OTEL_STEP_SPANS_PER_S": "inf",
    "LLM_OTEL_LOGIT_DIST_RATIO": "1",
    "LLM_OTEL_ITL_SAMPLE_EVERY": "1",
}
STEP_PREFIXES = ("core.", "worker.")
PROMPT = "The quick brown fox jumps over the lazy dog and"


class Recorder:
    """The profile function: counts calls into ``llm_otel.*`` by (path, module) while ``on``.

    ``hook_codes`` maps the code object of each hook wrapper to its factory name; a per-thread
    stack of the hook frames entered says which path a call belongs to.
    """

    def __init__(self, hook_codes: dict, finish_code) -> None:
        self.on = False
        self.hook_codes = hook_codes
        self.finish_code = finish_code
        self.local = threading.local()
        self.modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.functions: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.order: dict[str, list[str]] = collections.defaultdict(list)
        self.hooks: collections.Counter = collections.Counter()
        self.steps: list[collections.Counter] = []  # per outermost step hook: calls per module
        self.lock = threading.Lock()

    def _stack(self) -> list:
        st = getattr(self.local, "stack", None)
        if st is None:
            st = self.local.stack = []
        return st

    def profile(self, frame, event, arg) -> None:
        if not self.on:
            return
        if event == "return":
            st = getattr(self.local, "stack", None)
            if st and st[-1][0] is frame:
                st.pop()
            return
        if event != "call":
            return
        code = frame.f_code
        st = self._stack()
        factory = self.hook_codes.get(code)
        if factory is not None:
            step = factory.startswith(STEP_PREFIXES)
            outer_step = step and not any(kind == "step" for _, kind, _ in st)
            st.append((frame, "step" if step else "request", factory))
            with self.lock:
                self.hooks[factory] += 1
                if outer_step:
                    self.steps.append(collections.Counter())
        elif code is self.finish_code:
            st.append((frame, "finish", None))
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("llm_otel"):
            return
        labels = self._labels(st)
        func = f"{module}.{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"
        with self.lock:
            for label in labels:
                if module not in self.modules[label]:
                    self.order[label].append(module)
                self.modules[label][module] += 1
                self.functions[label][func] += 1
            if labels and labels[0] == "step" and self.steps:
                self.steps[-1][module] += 1

    def _labels(self, st: list) -> list[str]:
        """The path of the innermost hook on the stack (plus ``finish`` inside ``Telemetry.finish``
        of the request path); a call under no hook is its thread's."""
        finish = False
        for _, kind, _ in reversed(st):
            if kind == "finish":
                finish = True
                continue
            return [kind, "finish"] if (kind == "request" and finish) else [kind]
        return ["thread:" + threading.current_thread().name]


def hook_wrapper_codes() -> dict:
    """Code object of each applied wrapt wrapper of the vLLM hook table -> its factory name."""
    import importlib

    from llm_otel.instrumentation.vllm.hooks import HOOKS

    codes: dict = {}
    for hook in HOOKS:
        try:
            owner = importlib.import_module(hook.module)
            for part in hook.target.split("."):
                owner = getattr(owner, part)
        except (ImportError, AttributeError):
            continue
        wrapper = getattr(owner, "_self_wrapper", None)
        wrapper = getattr(wrapper, "__func__", wrapper)
        code = getattr(wrapper, "__code__", None)
        if code is not None:
            codes.setdefault(code, hook.factory)
    return codes


def finish_code():
    """``Telemetry.finish``'s code object (the finish phase of the request path), None if absent."""
    from llm_otel.telemetry import Telemetry

    fn = getattr(Telemetry, "finish", None)
    return getattr(fn, "__code__", None)


def summarize(rec: Recorder, steps_seen: int, tokens: int) -> dict:
    paths = {}
    for label in sorted(rec.modules, key=lambda k: (k.startswith("thread:"), k)):
        mods = rec.modules[label]
        paths[label] = {
            "modules": len(mods),
            "calls": sum(mods.values()),
            "calls_per_module": dict(mods.most_common()),
            "module_order": rec.order[label],
            "top_functions": dict(rec.functions[label].most_common(25)),
        }
    per_step = [{"modules": len(c), "calls": sum(c.values())} for c in rec.steps if c]
    if per_step and "step" in paths:
        paths["step"]["per_step"] = {
            "steps": len(per_step),
            "modules_median": statistics.median(p["modules"] for p in per_step),
            "modules_max": max(p["modules"] for p in per_step),
            "calls_median": statistics.median(p["calls"] for p in per_step),
            "calls_max": max(p["calls"] for p in per_step),
        }
    return {"paths": paths, "hook_invocations": dict(rec.hooks.most_common()),
            "engine_steps_profiled": steps_seen, "output_tokens": tokens}


def print_table(result: dict) -> None:
    paths = result["paths"]
    print(f"one request ({result['output_tokens']} output tokens, {result['engine_steps_profiled']} engine steps)")
    print(f"{'path':34} {'modules':>8} {'calls':>8}")
    for label, p in paths.items():
        print(f"{label:34} {p['modules']:>8} {p['calls']:>8}")
        if "per_step" in p:
            s = p["per_step"]
            print(f"{'  one step (median / max)':34} {s['modules_median']:>4g}/{s['modules_max']:<3} "
                  f"{s['calls_median']:>4g}/{s['calls_max']}")
    print("\nhook invocations: " + ", ".join(f"{k} {v}" for k, v in result["hook_invocations"].items()))
    for label in ("request", "finish", "step"):
        if label in paths:
            print(f"\n{label} path, calls per module (in order of first entry):")
            for mod in paths[label]["module_order"]:
                print(f"  {mod:52} {paths[label]['calls_per_module'][mod]:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens of the profiled request")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds to keep recording after the request for the export threads")
    args = parser.parse_args()

    for k, v in ENV.items():
        os.environ[k] = v
    sink = subprocess.Popen([sys.executable, str(HERE / "_sink.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = json.loads(sink.stdout.readline())["grpc"]
        result = run(args)
    finally:
        sink.stdin.close()
        sink.wait(timeout=10)
    result["environment"] = ENV
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result["commit"] = git.stdout.strip()  # the checkout whose llm_otel was measured
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {args.json}")


def run(args) -> dict:
    rec_holder: list[Recorder] = []

    def thread_profile(frame, event, arg):  # threads started from now on; a no-op until recording
        if rec_holder:
            rec_holder[0].profile(frame, event, arg)

    threading.setprofile(thread_profile)
    import llm_otel
    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    llm_otel.instrument()
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=256, seed=0, block_size=32)
    params = SamplingParams(max_tokens=args.tokens, min_tokens=args.tokens, temperature=0.0)
    llm.generate([PROMPT], params, use_tqdm=False)  # warm-up: first-use creation is not the path
    time.sleep(args.settle)

    rec = Recorder(hook_wrapper_codes(), finish_code())
    if not rec.hook_codes:
        raise SystemExit("no llm-otel hook wrapper found on vLLM: is llm-otel instrumented?")
    rec_holder.append(rec)
    rec.on = True
    sys.setprofile(rec.profile)
    try:
        out = llm.generate([PROMPT], params, use_tqdm=False)
        deadline = time.monotonic() + args.settle
        while time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sys.setprofile(None)
        rec.on = False
        threading.setprofile(None)
    tokens = len(out[0].outputs[0].token_ids)
    steps = len(rec.steps)  # outermost step hooks entered: one per engine step (EngineCore.step)
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush:
        flush()
    return summarize(rec, steps, tokens)


if __name__ == "__main__":
    main()
