"""Which llm_otel modules one sampled vLLM engine step runs through: engine core (schedule, step
span), worker (device timing) and the drain, in vLLM's two layouts (worker in its own process /
in the engine core's process), with the vLLM stand-ins of tests/test_gpu_vllm.py (no engine).

    .venv/bin/python benchmarks/step_path.py

Prints each module with the functions that ran (all threads), after two warm-up steps. The counts
are the "modules one step crosses" of docs/architecture.md.
"""
import collections
import os
import pickle
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_gpu_vllm as T  # noqa: E402
from conftest import make_captured  # noqa: E402

import llm_otel  # noqa: E402
from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter  # noqa: E402
from llm_otel.instrumentation.vllm.worker import WorkerAdapter  # noqa: E402

root = os.path.dirname(llm_otel.__file__)


def run(layout: str) -> dict:
    core_cap = make_captured()
    worker_cap = core_cap if layout == "one process" else make_captured()
    core, worker = EngineCoreAdapter(core_cap.telemetry), WorkerAdapter(worker_cap.telemetry)
    sched, runner = T.Scheduler({"a": "00f067aa0ba902b7", "b": None}), T.Runner()
    ship = (lambda so: so) if layout == "one process" else (lambda so: pickle.loads(pickle.dumps(so)))
    for _ in range(2):  # warm-up: tracker and instruments created
        T.engine_step(core, worker, sched, runner, ship=ship)
    worker_cap.telemetry.steps.drain()
    seen = collections.OrderedDict()

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root):
                seen.setdefault(os.path.relpath(f, root), set()).add(frame.f_code.co_name)
    threading.setprofile(prof)
    sys.setprofile(prof)
    T.engine_step(core, worker, sched, runner, ship=ship)
    time.sleep(0.002)
    worker_cap.telemetry.steps.drain()
    sys.setprofile(None)
    threading.setprofile(None)
    worker_cap.telemetry.steps.close()
    return seen

if __name__ == "__main__":
    for layout in ("worker process", "one process"):
        seen = run(layout)
        print(f"{layout}: {len(seen)} modules")
        for m, fns in seen.items():
            print(f"  {m}: {', '.join(sorted(fns))}")
