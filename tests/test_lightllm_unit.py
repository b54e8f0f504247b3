"""LightLLM adapter behaviour inside one process, against the `main` stand-in tree
(tests/lightllm_layouts/), in a fresh interpreter where that tree is `lightllm`: the carrier's
__setstate__, master-rank-only worker spans, exceptions passing through unchanged, health probes,
and uninstrument() restoring every patched attribute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from lightllm_layouts.layers import build_tree

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import asyncio, json, pickle, sys
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor, carrier
    out = {}
    exporter = InMemorySpanExporter()
    tp = TracerProvider(); tp.add_span_processor(SimpleSpanProcessor(exporter))
    inst = LightLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(), settings=Settings())
    from lightllm.server.multimodal_params import MultimodalParams
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.router.model_infer import infer_batch
    from lightllm.server.core.objs import SamplingParams
    out["layouts"] = inst.layouts

    # carrier: pickled by value, registered where it is unpickled, state restored exactly
    mm = MultimodalParams(images=[{"type": "url"}])
    mm._llm_otel_carrier = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "group_req_id": 24, "choices": []}
    back = pickle.loads(pickle.dumps(mm))
    out["state_restored"] = back.images == [{"type": "url"}] and back._llm_otel_carrier == mm._llm_otel_carrier
    out["registered"] = carrier.TABLE.get(24) == mm._llm_otel_carrier
    plain = pickle.loads(pickle.dumps(MultimodalParams()))
    out["plain_ok"] = plain.images == [] and not hasattr(plain, "_llm_otel_carrier")
    bad = MultimodalParams(); bad._llm_otel_carrier = "garbage"
    out["bad_carrier_ok"] = pickle.loads(pickle.dumps(bad))._llm_otel_carrier == "garbage"

    # worker spans on the master rank of the DP group only
    import os
    class Shm:
        input_len, prompt_cache_len, router_aborted, is_aborted = 3, 0, False, False
        def get_prompt_ids(self): return [1, 2, 3]
    def worker_life(rid):
        ctx = infer_batch.InferenceContext()
        class Mgr:
            def get_req_obj_by_index(self, i): return Shm()
            def put_back_req_obj(self, r): pass
        ctx.register(Mgr()); infer_batch.g_infer_context.__dict__.update(ctx.__dict__)
        m = MultimodalParams(); m._llm_otel_carrier = dict(mm._llm_otel_carrier, group_req_id=rid)
        infer_batch.g_infer_context.add_reqs([(rid, 0, m, 0)], init_req_obj=True)
        req = infer_batch.g_infer_context.requests_mapping[rid]
        req.set_next_gen_token_id(5, -0.5)
        infer_batch.g_infer_context.filter([rid])
    inst.adapter.worker._master = None
    os.environ["STANDIN_RANK_IN_DP"] = "1"
    worker_life(32)
    out["rank1_spans"] = len(exporter.get_finished_spans())
    inst.adapter.worker._master = None
    os.environ["STANDIN_RANK_IN_DP"] = "0"
    worker_life(40)
    out["rank0_spans"] = [s.name for s in exporter.get_finished_spans()]
    exporter.clear()

    # an exception inside generate reaches the caller unchanged; the request span records it
    class Boom(Exception):
        pass
    from lightllm.server.req_id_generator import ReqIDGenerator
    class Manager(HttpServerManager):
        def __init__(self): self.req_id_to_out_inf = {}
    class DeadRouter:
        def put(self, obj): raise Boom("router down")
    from lightllm import _standin
    import multiprocessing
    raw = _standin.new_shm(multiprocessing.get_context("spawn"))
    m = Manager(); m.shm_req_manager = _standin.ShmReqManager(raw); m.id_gen = ReqIDGenerator(raw)
    m.send_to_router = DeadRouter()
    async def consume(**kw):
        return [x async for x in m.generate("a b", SamplingParams(), MultimodalParams(), None, **kw)]
    try:
        asyncio.run(consume())
        out["raised"] = None
    except Boom as e:
        out["raised"] = str(e)
    out["error_spans"] = sorted((s.name, s.attributes.get("error.type")) for s in exporter.get_finished_spans())
    exporter.clear()
    # refused before it reached the router (tokenizer error): one rejected span (C03)
    async def bad_encode(*a): raise ValueError("prompt too long")
    m._encode = bad_encode
    try:
        asyncio.run(consume())
    except ValueError:
        pass
    out["rejected"] = [(s.name, s.attributes.get("error.type"), [e.name for e in s.events]) for s in exporter.get_finished_spans()]
    exporter.clear()
    # a P/D node's generate(request=None) continues under the carrier its MultimodalParams brought
    m.send_to_router = type("Q", (), {"put": lambda self, obj: None})()
    async def one_token(self, *a, **k):
        from lightllm.server.core.objs import FinishStatus
        yield 48, "x", {"id": 7, "count_output_tokens": 1}, FinishStatus(2)
    m._wait_to_token_package = one_token.__get__(m)
    m._encode = Manager._encode.__get__(m)
    pd_mm = MultimodalParams()
    pd_mm._llm_otel_carrier = {"traceparent": "00-" + "12" * 16 + "-" + "34" * 8 + "-01", "group_req_id": 1000}
    sp = SamplingParams(); m.id_gen.current_id[:] = (48, 1 << 62)
    async def run_pd():
        return [x async for x in m.generate("a b", sp, pd_mm, None)]
    asyncio.run(run_pd())
    pd = [s for s in exporter.get_finished_spans() if s.name == "text_completion unknown"]
    out["pd_parent"] = [(format(s.parent.trace_id, "032x"), format(s.parent.span_id, "016x"), s.kind.name) for s in pd]
    out["pd_carrier_is_ours"] = pd_mm._llm_otel_carrier["traceparent"].split("-")[2] == format(pd[0].context.span_id, "016x")
    exporter.clear()
    # the model name is the one the HTTP worker's manager is built with, not the environment's at
    # instrument time (there was none then)
    late = HttpServerManager({"model_name": "late-model"}, m.send_to_router, raw)
    late._wait_to_token_package = one_token.__get__(late)
    late.id_gen.current_id[:] = (48, 1 << 62)
    async def run_late():
        return [x async for x in late.generate("a b", SamplingParams(), MultimodalParams(), None)]
    asyncio.run(run_late())
    out["late_model"] = sorted({s.name for s in exporter.get_finished_spans() if s.name.startswith("text_")})
    exporter.clear()
    # health probes (negative ids) are not traced
    try:
        sp = SamplingParams(); sp.group_request_id = -8
        asyncio.run(m.generate("a", sp, MultimodalParams(), None, is_health_req=True).__anext__())
    except ValueError:  # the probe fails in the tokenizer too: still no span
        pass
    out["health_spans"] = len(exporter.get_finished_spans())

    # uninstrument restores every attribute; instrument again works
    inst.uninstrument()
    out["setstate_removed"] = "__setstate__" not in vars(MultimodalParams)
    out["unwrapped"] = not hasattr(vars(HttpServerManager)["generate"], "__wrapped__") \\
        and not hasattr(vars(infer_batch.InferReq)["set_next_gen_token_id"], "__wrapped__")
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(), settings=Settings())
    out["rewrapped"] = hasattr(vars(HttpServerManager)["generate"], "__wrapped__") and "__setstate__" in vars(MultimodalParams)
    inst.uninstrument()
    print("RESULT " + json.dumps(out))
""")


def run(tmp_path) -> dict:
    tree = build_tree("main", tmp_path / "main")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
    )
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1][7:]) | {
        "stderr": done.stderr
    }


def test_lightllm_adapter_in_one_process(tmp_path):
    out = run(tmp_path)
    assert out["layouts"]["lightllm.server.httpserver.manager"] == "main"
    assert out["layouts"]["lightllm.server.router.model_infer.infer_batch"] == "main"
    # carrier: state restored exactly, registered in the per-process table, bad input ignored
    assert out["state_restored"] and out["registered"] and out["plain_ok"] and out["bad_carrier_ok"]
    # master rank only
    assert out["rank1_spans"] == 0
    assert out["rank0_spans"] == ["llm.infer.request"]
    # the user's exception is LightLLM's, unchanged; the span says what happened
    assert out["raised"] == "router down"
    assert out["error_spans"] == [["llm.prompt", "Boom"], ["text_completion unknown", "Boom"]]
    assert out["rejected"] == [["text_completion unknown", "ValueError", ["llm.request.rejected"]]]
    assert out["health_spans"] == 0
    assert out["pd_parent"] == [["12" * 16, "34" * 8, "INTERNAL"]]
    assert out["pd_carrier_is_ours"]
    assert out["late_model"] == ["text_completion late-model"]
    assert out["setstate_removed"] and out["unwrapped"] and out["rewrapped"]
    assert "Traceback" not in out["stderr"]
