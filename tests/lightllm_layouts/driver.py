"""Drives whole request lives through a LightLLM stand-in tree (tests/lightllm_layouts/README.md):
this process is the HTTP worker, the router and the model-infer worker are spawned children, as in
LightLLM. Run under ``opentelemetry-instrument`` with the tree first on ``PYTHONPATH``; prints
``RESULT <json>`` with what each request yielded.

argv[1]: JSON ``{"requests": [<req> | [<req>, ...] (run concurrently)], "disable_chunked_prefill": bool,
"args": {LightLLM start args, e.g. "tp": 2}}``;
``<req>``: ``{"name", "prompt", "max_new_tokens", "n", "traceparent", "disconnect_after", "health",
"path", "close_after"}``.
"""

import asyncio
import json
import multiprocessing
import sys


class Headers(dict):
    def get(self, key, default=None):
        for k, v in self.items():
            if k.lower() == key.lower():
                return v
        return default


class URL:
    def __init__(self, path):
        self.path = path


class Request:
    """The parts of a Starlette Request that LightLLM's generate uses."""

    def __init__(self, spec, seen):
        self.headers = Headers({"traceparent": spec["traceparent"]} if spec.get("traceparent") else {})
        self.url = URL(spec.get("path", "/generate"))
        self.spec = spec
        self.seen = seen

    async def is_disconnected(self):
        limit = self.spec.get("disconnect_after")
        return limit is not None and len(self.seen) >= limit


async def one(mgr, spec):
    from lightllm.server.core.objs import SamplingParams
    from lightllm.server.multimodal_params import MultimodalParams

    if spec.get("health"):  # LightLLM's own probe (GET /health -> health_check(args, manager, None))
        from lightllm.utils.health_check import health_check

        return {"name": spec["name"], "tokens": [], "error": None, "healthy": await health_check(mgr.args, mgr, None)}
    sp = SamplingParams(n=spec.get("n", 1), max_new_tokens=spec.get("max_new_tokens", 16),
                        temperature=0.5, top_p=0.9, top_k=20)
    seen, error = [], None
    gen = mgr.generate(spec["prompt"], sp, MultimodalParams(), Request(spec, seen))
    try:
        async for sub_id, text, metadata, finish in gen:
            seen.append([sub_id, metadata["id"], metadata["count_output_tokens"], finish.get_finish_reason()])
            if spec.get("close_after") is not None and len(seen) >= spec["close_after"]:
                await gen.aclose()  # the consumer goes away mid-stream
                break
    except Exception as exc:  # noqa: BLE001
        error = str(exc)
    return {"name": spec["name"], "tokens": seen, "error": error}


async def run_all(mgr, requests):
    results = []
    for item in requests:
        if isinstance(item, list):
            results.extend(await asyncio.gather(*(one(mgr, spec) for spec in item)))
        else:
            results.append(await one(mgr, item))
    return results


def main():
    scenario = json.loads(sys.argv[1])
    ctx = multiprocessing.get_context("spawn")
    from lightllm import _standin
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.router.manager import start_router_process

    raw = _standin.new_shm(ctx)
    to_router = ctx.Queue()
    args = {"disable_chunked_prefill": scenario.get("disable_chunked_prefill", False), "running_max_req_size": 8,
            "tp": 1, "dp": 1,  # StartArgs defaults
            **scenario.get("args", {})}  # e.g. {"tp": 2}: one model-infer process per rank
    router = ctx.Process(target=start_router_process, args=(args, to_router, raw), name="router")
    router.start()
    mgr = HttpServerManager(args, to_router, raw)
    results = asyncio.run(run_all(mgr, scenario["requests"]))
    to_router.put(None)
    router.join(120)
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()
    print("RESULT " + json.dumps({"results": results, "router_exitcode": router.exitcode}), flush=True)


if __name__ == "__main__":
    main()
