"""A request through the real PyPI ``lightllm==0.0.1`` (= ModelTC/lightllm e6452fd2, 2024-05-15):
the 2024 layout. This process is the HTTP worker with LightLLM's own ``HttpServerManager`` (real
zmq sockets, real tokenizer); a spawned child plays the router with LightLLM's own
``RouterManager.add_req``, ``ContinuesBatchQueue.generate_new_batch``, ``io_struct.Req/Batch`` and
sends ``BatchStrOut`` back as its detokenization process would. Only the model (the rpyc GPU
workers) is replaced: the child emits deterministic tokens. Both processes instrument themselves
with ``LightLLMInstrumentor().instrument()`` and export over OTLP from the ``OTEL_*`` environment.

LightLLM 0.0.1 needs a CUDA device name at import time (its Triton kernels pick configurations
by GPU): ``torch.cuda.get_device_name/get_device_capability`` are answered before importing it.
argv[1]: JSON ``{"model_dir", "prompt", "max_new_tokens", "traceparent", "ports": [router, http]}``.
"""

import asyncio
import json
import multiprocessing
import sys
import time
import types


def shim_cuda():
    import torch

    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)


def instrument():
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor

    LightLLMInstrumentor().instrument()


def args_for(spec):
    return types.SimpleNamespace(
        model_dir=spec["model_dir"], tokenizer_mode="auto", trust_remote_code=False, max_total_token_num=4096,
        max_req_input_len=1024, max_req_total_len=2048, batch_max_tokens=2048, running_max_req_size=8,
        router_token_ratio=0.9, router_max_new_token_len=1024, long_truncation_mode=None, cache_capacity=8)


def router_main(spec):
    """The router process: LightLLM 0.0.1's own request objects and queue, a fake model."""
    shim_cuda()
    instrument()
    import zmq
    from lightllm.server.io_struct import BatchStrOut, FinishStatus
    from lightllm.server.router.manager import RouterManager
    from lightllm.server.router.req_queue.continues_batch.impl import ContinuesBatchQueue

    class Router(RouterManager):
        def __init__(self, args):  # no rpyc model workers: only what add_req and the queue use
            self.args = args
            self.is_splitfuse_mode = False
            self.req_queue = ContinuesBatchQueue(args, self)
            self.send_to_detokenization = types.SimpleNamespace(send_pyobj=lambda obj: None)
            self.shared_token_load = types.SimpleNamespace(set_dynamic_max_load=lambda value: None,
                                                           need_update_dynamic_max_load=lambda: False)

        def get_used_tokens(self):
            return 0

    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(f"tcp://127.0.0.1:{spec['ports'][0]}")
    send = ctx.socket(zmq.PUSH)
    send.connect(f"tcp://127.0.0.1:{spec['ports'][1]}")
    router = Router(args_for(spec))
    prompt_ids, sampling_params, multimodal_params, group_req_id = recv.recv_pyobj()  # pickled by LightLLM
    router.add_req(prompt_ids, sampling_params, multimodal_params, group_req_id)
    batch = router.req_queue.generate_new_batch(None)
    while batch.reqs:
        time.sleep(0.003)  # one fake decode step
        out = BatchStrOut()
        for req in batch.reqs:
            k = req.cur_output_len
            req.cur_output_len += 1
            token = 100 + k
            if req.cur_output_len >= req.max_output_len:
                req.finish_status = FinishStatus.FINISHED_LENGTH
            out.reqs_infs.append((req.request_id, f"<{token}>", {"id": token, "logprob": -0.1 * (k + 1)},
                                  req.finish_status.value))
        send.send_pyobj(out)
        unfinished, finished = [], []
        for req in batch.reqs:
            (finished if req.finish_status.is_finished() else unfinished).append(req.request_id)
        batch.filter_out_finished_req(unfinished, finished)
    recv.close(linger=0)
    send.close(linger=1000)
    ctx.term()


class Request:
    def __init__(self, traceparent):
        self.headers = {"traceparent": traceparent}
        self.url = types.SimpleNamespace(path="/generate")

    async def is_disconnected(self):
        return False


async def http_main(spec):
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.multimodal_params import MultimodalParams
    from lightllm.server.sampling_params import SamplingParams

    mgr = HttpServerManager(args_for(spec), spec["ports"][0], 0, spec["ports"][1], 0, False)
    loop_task = asyncio.create_task(mgr.handle_loop())
    sp = SamplingParams(best_of=1, n=1, max_new_tokens=spec["max_new_tokens"])
    seen = []
    async for sub_id, text, metadata, finish in mgr.generate(spec["prompt"], sp, 8, MultimodalParams(),
                                                             Request(spec["traceparent"])):
        seen.append([sub_id, metadata["id"], metadata.get("prompt_tokens"), finish.get_finish_reason()])
    loop_task.cancel()
    return {"tokens": seen, "prompt_ids": len(mgr.tokenizer.encode(spec["prompt"]))}


def main():
    spec = json.loads(sys.argv[1])
    shim_cuda()
    instrument()
    router = multiprocessing.get_context("spawn").Process(target=router_main, args=(spec,), name="router")
    router.start()
    result = asyncio.run(asyncio.wait_for(http_main(spec), 180))
    router.join(120)
    from opentelemetry import trace

    trace.get_tracer_provider().force_flush()
    result["router_exitcode"] = router.exitcode
    import lightllm

    result["lightllm_file"] = lightllm.__file__
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
