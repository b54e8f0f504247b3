# Shape of lightllm/server/httpserver/manager.py HttpServerManager @ fc72ffab: alloc_req_id l.225,
# generate l.248 (async generator), transfer_to_next_module_or_node l.409,
# transfer_to_next_module l.446, _wait_to_token_package, abort l.587. The router is a spawned
# process fed with pickled GroupReqIndexes (zmq PUSH there, a multiprocessing queue here); tokens
# come back through the shared-memory Req (LightLLM: detokenization process -> shm queue).
import asyncio
import time

from lightllm import _standin
from lightllm.server.core.objs import FinishStatus
from lightllm.server.core.objs.io_objs import GroupReqObjs
from lightllm.server.req_id_generator import ReqIDGenerator


class ReqStatus:
    def __init__(self, group_request_id, multimodal_params, req_objs, start_time):
        self.group_req_objs = GroupReqObjs(group_request_id, multimodal_params, req_objs, start_time)


class HttpServerManager:
    def __init__(self, args, send_to_router, shm_raw):
        self.args = args
        self.send_to_router = send_to_router
        self.shm_req_manager = _standin.ShmReqManager(shm_raw)
        self.id_gen = ReqIDGenerator(shm_raw)  # numpy.int64 ids from shared memory, as LightLLM's
        self.req_id_to_out_inf = {}

    def alloc_req_id(self, sampling_params, is_health_req: bool = False):
        if is_health_req:
            return sampling_params.group_request_id
        group_request_id = self.id_gen.generate_id()
        sampling_params.group_request_id = group_request_id
        return group_request_id

    async def _encode(self, prompt, multimodal_params, sampling_params):
        return [10 + (sum(map(ord, w)) % 50) for w in prompt.split()]

    async def generate(self, prompt, sampling_params, multimodal_params, request, is_health_req: bool = False):
        start_time = time.time()
        group_request_id = self.alloc_req_id(sampling_params, is_health_req)
        try:
            prompt_ids = await self._encode(prompt, multimodal_params, sampling_params)
            req_objs = []
            for i in range(sampling_params.n):
                req_obj = await self.shm_req_manager.async_get_req_obj_by_index(
                    await self.shm_req_manager.async_alloc_req_index())
                req_obj.init(group_request_id + i, prompt_ids, sampling_params)
                req_objs.append(req_obj)
            req_status = ReqStatus(group_request_id, multimodal_params, req_objs, start_time)
            self.req_id_to_out_inf[group_request_id] = req_status
            await self.transfer_to_next_module_or_node(prompt, sampling_params, None, req_status.group_req_objs)
            results_generator = self._wait_to_token_package(
                start_time, prompt_ids, group_request_id, sampling_params, req_status, request)
            async for sub_req_id, request_output, metadata, finish_status in results_generator:
                yield sub_req_id, request_output, metadata, finish_status
        except Exception as e:
            await self.abort(group_request_id)
            raise e

    async def transfer_to_next_module_or_node(self, prompt, sampling_params, original_multimodal_params,
                                              group_req_objs=None):
        await self.transfer_to_next_module(group_req_objs)

    async def transfer_to_next_module(self, group_req_objs=None):
        self.send_to_router.put(group_req_objs.to_group_req_index())

    async def _wait_to_token_package(self, start_time, prompt_ids, group_request_id, sampling_params, req_status,
                                     request):
        reqs = req_status.group_req_objs.shm_req_objs
        sent = [0] * len(reqs)
        unfinished_count = len(reqs)
        while True:
            await asyncio.sleep(0.001)
            if request is not None and await request.is_disconnected():
                await self.abort(group_request_id)
                raise Exception(f"req_id {group_request_id} disconnected")
            for i, req in enumerate(reqs):
                ready = req.shm_cur_output_len
                while sent[i] < ready:
                    k = sent[i]
                    sent[i] += 1
                    finish = req.out_finish[k]
                    last = finish != _standin.NO_FINISH
                    metadata = {"id": int(req.out_ids[k]), "logprob": float(req.logprobs[k]),
                                "count_output_tokens": k + 1, "prompt_tokens": len(prompt_ids)}
                    yield req.request_id, f"<{req.out_ids[k]}>", metadata, FinishStatus(finish)
                    if last:
                        unfinished_count -= 1
                if unfinished_count == 0:
                    self.req_id_to_out_inf.pop(group_request_id, None)
                    return

    async def abort(self, group_req_id: int):
        req_status = self.req_id_to_out_inf.pop(group_req_id, None)
        if req_status is not None:
            for req in req_status.group_req_objs.shm_req_objs:
                req.is_aborted = True
