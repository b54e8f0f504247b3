"""LightLLM 0.0.1 from PyPI (= ModelTC/lightllm e6452fd2) started the way its ``api_server.main``
starts it, on CPU: this process builds LightLLM's ``HttpServerManager`` (the HTTP worker), then
LightLLM's ``start_submodule_processes`` starts LightLLM's ``start_router_process`` and
``start_detokenization_process`` in processes of their own. The router runs its real
``RouterManager`` (zmq, ``loop_for_netio_req``, ``loop_for_fwd``, ``ContinuesBatchQueue``,
``Batch``/``Req``, ``abort``) and the detokenizer its real ``DeTokenizationManager`` with the tiny
model's tokenizer. Only the model is faked: the model server's backend (``ModelRpcServer.backend``,
which would load weights on a GPU, hold the KV cache and run forward and sampling) is
``FakeBackend``, which returns what ``ContinuesBatchBackend`` returns for deterministic tokens.

Processes start with ``fork`` (LightLLM 0.0.1's launcher sets ``spawn`` for CUDA, which this run
does not use): the children inherit the instrumentation and the fake backend. They leave as
multiprocessing children do (SIGINT ends their event loops; LightLLM ignores SIGTERM there), so
llm-otel's final flush runs in each.

Requests: ``complete`` (5 tokens, ``length``) and ``abort`` (the client disconnects after its first
token: LightLLM's ``generate`` sees ``is_disconnected()``, calls ``abort``, the router marks the
request aborted and releases it). argv[1]: JSON ``{"model_dir", "ports": [6 free ports],
"requests": {name: traceparent}}``; prints ``RESULT {json}``.
"""

import asyncio
import json
import multiprocessing
import os
import signal
import sys
import time
import types

MAX_TOTAL_TOKENS = 4096


def shim_cuda():
    import torch

    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def shim_event_loop():
    """LightLLM 0.0.1's detokenizer calls ``asyncio.get_event_loop()`` in a fresh process under
    uvloop's policy; uvloop 0.21+ (vLLM's, installed here) raises there instead of making one."""
    get = asyncio.get_event_loop

    def get_event_loop():
        try:
            return get()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop

    asyncio.get_event_loop = get_event_loop


class FakeBackend:
    """The model: ``ContinuesBatchBackend``'s return values for tokens 100, 101, ... (one per
    prefill or decode call per request), finishing at ``max_new_tokens``; ``SharedInt`` of free KV
    tokens kept at the total (what the real memory manager publishes for an empty cache)."""

    def init_model(self, kvargs):
        from lightllm.server.router.dynamic_prompt.shared_arr import SharedInt

        self.free = SharedInt(f"{kvargs['nccl_port']}_mem_manger_can_use_token_num")
        self.free.set_value(kvargs["max_total_token_num"])
        self.batches = {}  # batch id -> {request id: [request, output tokens]}

    def add_batch(self, batch_id, reqs):
        from lightllm.server.io_struct import FinishStatus, ReqRunStatus

        self.batches[batch_id] = {r["request_id"]: [r, 0] for r in reqs}
        return {rid: (ReqRunStatus.RUNNING, 0, 0, [], FinishStatus.NO_FINISH.value, None) for rid in self.batches[batch_id]}

    def _step(self, batch_id):
        from lightllm.server.io_struct import FinishStatus, ReqRunStatus

        time.sleep(0.003)  # one fake forward
        out = {}
        for rid, entry in self.batches[batch_id].items():
            req, produced = entry
            token = 100 + produced
            entry[1] = produced = produced + 1
            done = produced >= req["sampling_param"]["max_new_tokens"]
            status = FinishStatus.FINISHED_LENGTH if done else FinishStatus.NO_FINISH
            kv = len(req["input_id"]) + produced - 1
            metadata = {"id": token, "logprob": -0.1 * produced}
            out[rid] = (ReqRunStatus.RUNNING, kv, produced, [(token, metadata)], status.value, None)
        return out

    def prefill_batch(self, batch_id):
        return self._step(batch_id)

    def decode_batch(self, batch_id):
        return self._step(batch_id)

    def filter_batch(self, batch_id, req_id_list, finished_req_id_list):
        self.batches[batch_id] = {rid: e for rid, e in self.batches[batch_id].items() if rid in set(req_id_list)}

    def pause_reqs(self, batch_id, req_list):
        pass

    def merge_batch(self, batch_id1, batch_id2):
        self.batches[batch_id1].update(self.batches.pop(batch_id2))

    def remove_batch(self, batch_id):
        self.batches.pop(batch_id, None)


def install_fake_model():
    from lightllm.server.router.model_infer import model_rpc

    def exposed_init_model(self, kvargs):
        self.world_size = kvargs["world_size"]
        self.backend = FakeBackend()
        self.backend.init_model(kvargs)

    model_rpc.ModelRpcServer.exposed_init_model = exposed_init_model


def args_for(spec):
    """The launcher's parsed arguments (api_server.main's defaults) that these stages read."""
    return types.SimpleNamespace(
        model_dir=spec["model_dir"], tokenizer_mode="auto", trust_remote_code=False, tp=1, load_way="HF", mode=[],
        max_total_token_num=MAX_TOTAL_TOKENS, batch_max_tokens=2048, running_max_req_size=8, max_req_input_len=1024,
        max_req_total_len=2048, eos_id=[2], nccl_port=spec["ports"][5], use_dynamic_prompt_cache=False,
        router_token_ratio=0.0, router_max_new_token_len=1024, router_max_wait_tokens=6, splitfuse_mode=False,
        splitfuse_block_size=256, disable_log_stats=True, log_stats_interval=10, token_healing_mode=False,
        return_all_prompt_logprobs=False, data_type="float16", beam_mode=False, diverse_mode=False,
        long_truncation_mode=None, cache_capacity=8, enable_multimodal=False, health_monitor=False)


class Request:
    """Starlette's Request as LightLLM reads it: headers and the disconnect check."""

    def __init__(self, traceparent, disconnect_after_first_token):
        self.headers = {"traceparent": traceparent}
        self.url = types.SimpleNamespace(path="/generate")
        self.disconnect = disconnect_after_first_token
        self.seen = 0

    async def is_disconnected(self):
        return self.disconnect and self.seen >= 1


async def http_main(spec, mgr):
    from lightllm.server.multimodal_params import MultimodalParams
    from lightllm.server.sampling_params import SamplingParams

    loop_task = asyncio.create_task(mgr.handle_loop())
    out = {}
    for group_id, (name, traceparent) in zip((8, 16), spec["requests"].items()):
        request = Request(traceparent, disconnect_after_first_token=name == "abort")
        sp = SamplingParams(best_of=1, n=1, max_new_tokens=5 if name == "complete" else 400)
        seen, error = [], None
        try:
            async for sub_id, text, metadata, finish in mgr.generate("def main(): return 42", sp, group_id,
                                                                     MultimodalParams(), request):
                request.seen += 1
                seen.append([sub_id, metadata["id"], finish.get_finish_reason()])
        except Exception as exc:  # LightLLM raises "req_id ... disconnected" to the HTTP handler
            error = str(exc)
        out[name] = {"group_id": group_id, "tokens": seen, "error": error}
    loop_task.cancel()
    return out


def main():
    spec = json.loads(sys.argv[1])
    shim_cuda()
    shim_event_loop()
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor

    LightLLMInstrumentor().instrument()
    install_fake_model()
    from lightllm.server.detokenization.manager import start_detokenization_process
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.router.manager import start_router_process
    from lightllm.utils.start_utils import start_submodule_processes

    multiprocessing.set_start_method("fork")
    args = args_for(spec)
    router_port, detok_port, http_port, visual_port, cache_port, _ = spec["ports"]
    mgr = HttpServerManager(args, router_port=router_port, cache_port=cache_port, httpserver_port=http_port,
                            visual_port=visual_port, enable_multimodal=False)
    start_submodule_processes(
        start_funcs=[start_router_process, start_detokenization_process],
        start_args=[(args, router_port, detok_port, [spec["ports"][5] + 1]), (args, detok_port, http_port)],
    )
    children = multiprocessing.active_children()
    result = asyncio.run(asyncio.wait_for(http_main(spec, mgr), 120))
    time.sleep(0.5)  # the router releases the aborted request at its next step
    for child in children:  # as a multiprocessing child ends: its finalizers (llm-otel's flush) run
        os.kill(child.pid, signal.SIGINT)
    for child in children:
        child.join(30)
    from opentelemetry import trace

    trace.get_tracer_provider().force_flush()
    result["children"] = {str(c.pid): c.exitcode for c in children}
    result["pid"] = os.getpid()
    import lightllm

    result["lightllm_file"] = lightllm.__file__
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
