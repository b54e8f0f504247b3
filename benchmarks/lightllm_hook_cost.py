"""Per-call cost of llm-otel's LightLLM hooks on the hot path, against the `main` stand-in tree
(tests/lightllm_layouts/): ``InferReq.set_next_gen_token_id`` (once per generated token in the
worker) for a traced request and for one llm-otel does not track, and the HTTP side per yielded
token (``HttpServerManager.generate`` through the wrapper vs. unwrapped).

    .venv/bin/python benchmarks/lightllm_hook_cost.py [--n 200000]

Runs itself in a fresh interpreter where the stand-in tree is ``lightllm``; best of 5 rounds;
prints ns per call. The stand-in methods are nearly empty, so the numbers are the hooks' own cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

INNER = r'''
import asyncio, sys, time
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from llm_otel.config import Settings
from llm_otel.instrumentation.lightllm import LightLLMInstrumentor
from llm_otel.instrumentation.lightllm.adapter import _InferReq
n = int(sys.argv[1])
inst = LightLLMInstrumentor()
inst.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider(), settings=Settings())
from lightllm.server.router.model_infer import infer_batch

class Shm:
    input_len = 8

def make(rid):
    r = infer_batch.InferReq(rid, 0, 0)
    r.shm_req = Shm(); r.cur_output_len = 0
    return r

def best(fn):
    out = []
    for _ in range(5):
        t = time.perf_counter_ns(); fn(); out.append((time.perf_counter_ns() - t) / n)
    return min(out)

traced, untracked = make(8), make(16)
inst.adapter.worker.reqs[8] = _InferReq(None, 8, 0, time.time_ns())
raw = vars(infer_batch.InferReq)["set_next_gen_token_id"].__wrapped__
def loop(req, f):
    for i in range(n):
        f(req, 100, -0.5)
def run_traced():
    st = inst.adapter.worker.reqs[8]
    st.ids.clear(); st.times = type(st.times)("q")
    loop(traced, infer_batch.InferReq.set_next_gen_token_id)
print(f"set_next_gen_token_id unwrapped            {best(lambda: loop(untracked, raw)):7.0f} ns/call")
print(f"set_next_gen_token_id, request not traced  {best(lambda: loop(untracked, infer_batch.InferReq.set_next_gen_token_id)):7.0f} ns/call")
print(f"set_next_gen_token_id, traced request      {best(run_traced):7.0f} ns/call")

from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.core.objs import FinishStatus, SamplingParams
from lightllm.server.multimodal_params import MultimodalParams

class Mgr(HttpServerManager):
    def __init__(self): pass

async def tokens(self, prompt, sampling_params, multimodal_params, request, is_health_req=False):
    md = {"id": 100, "logprob": -0.5, "count_output_tokens": 1, "prompt_tokens": 4}
    for i in range(n):
        yield 8, "x", md, FinishStatus(0)

async def consume(gen):
    async for _ in gen:
        pass

def per_token(wrapped):
    def run():
        asyncio.run(consume(wrapped(Mgr(), "a", SamplingParams(), MultimodalParams(), None)))
    return best(run)

hook = inst.adapter.http.generate("bench")
def traced_gen(self, *a):
    return hook(lambda *x: tokens(self, *x), self, a, {})
print(f"generate per yielded token, unwrapped      {per_token(tokens):7.0f} ns/token")
print(f"generate per yielded token, traced         {per_token(traced_gen):7.0f} ns/token")
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    layouts = os.path.join(here, "..", "tests", "lightllm_layouts")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(layouts, "common"), tmp, dirs_exist_ok=True)
        shutil.copytree(os.path.join(layouts, "main"), tmp, dirs_exist_ok=True)
        env = dict(os.environ, PYTHONPATH=tmp, LLM_OTEL_ADAPTIVE_SAMPLING="off")
        subprocess.run([sys.executable, "-c", INNER, str(args.n)], env=env, check=True)


if __name__ == "__main__":
    main()
