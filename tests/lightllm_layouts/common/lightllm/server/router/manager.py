# Shape of lightllm/server/router/manager.py RouterManager @ fc72ffab: add_req l.207,
# generate_new_batch l.279, _step, _prefill_batch l.331, _decode_batch() l.339,
# _filter_reqs_from_running_batch; start_router_process. Requests arrive pickled (GroupReqIndexes)
# from the HTTP process; the worker is a spawned child.
import asyncio
import multiprocessing
import queue

from lightllm import _standin
from lightllm.server.router.batch import Batch
from lightllm.server.router.req_queue import build_req_queue


class RouterManager:
    def __init__(self, args, recv, shm_raw):
        self.args = args
        self.recv = recv
        self.shm_req_manager = _standin.ShmReqManager(shm_raw)
        self.batch_seq = 0
        self.req_queue = build_req_queue(args, self, 1)
        self.running_batch = None
        self.schedule_new_batch = None
        ctx = multiprocessing.get_context("spawn")
        # one model-infer process per TP rank (model_rpc.start_model_process)
        self.rpcs, self.workers = _standin.start_workers(ctx, args, shm_raw)

    async def _rpc(self, *msg):
        for rpc in self.rpcs:  # every rank runs every call (LightLLM's shared-memory RPC)
            rpc.send(msg)
        return [rpc.recv() for rpc in self.rpcs][0]

    def add_req(self, group_req_indexes):
        req_group = []
        for req_index in group_req_indexes.shm_req_indexes:
            req = self.shm_req_manager.get_req_obj_by_index(req_index)
            req.multimodal_params = group_req_indexes.multimodal_params
            req.start_time = group_req_indexes.time_mark
            req_group.append(req)
        self.req_queue.extend(req_group)

    def generate_new_batch(self):
        new_batch = self.req_queue.generate_new_batch(
            Batch.merge_two_batch(self.running_batch, self.schedule_new_batch), None)
        self.schedule_new_batch = Batch.merge_two_batch(self.schedule_new_batch, new_batch)

    async def _step(self):
        if self.schedule_new_batch is not None:
            new_batch, self.schedule_new_batch = self.schedule_new_batch, None
            if self.running_batch is None:
                self.running_batch = new_batch
            else:
                self.running_batch.merge(new_batch)
            await self._prefill_batch(new_batch)
            self._filter_reqs_from_running_batch()
        if self.running_batch is not None:
            await self._decode_batch()
            self._filter_reqs_from_running_batch()

    async def _prefill_batch(self, batch):
        await self._rpc("prefill", [r.to_router_rpc_obj() for r in batch.reqs])

    async def _decode_batch(self):
        await self._rpc("decode")

    def _filter_reqs_from_running_batch(self):
        if self.running_batch is not None:
            self.running_batch.filter_out_finished_req(self.shm_req_manager)
            if self.running_batch.is_clear():
                self.running_batch = None

    def _drain(self):
        while True:
            try:
                obj = self.recv.get(timeout=0.002 if self.running_batch is None else 0)
            except queue.Empty:
                return True
            if obj is None:
                return False
            self.add_req(obj)

    def busy(self):
        return self.running_batch is not None or self.schedule_new_batch is not None \
            or self.req_queue.get_wait_req_num() > 0

    async def loop_for_fwd(self):
        stopping = False
        while not stopping or self.busy():
            if not stopping:
                stopping = not self._drain()
            self.generate_new_batch()
            await self._step()
        await self._rpc(None)
        for worker in self.workers:
            worker.join(30)


def start_router_process(args, recv, shm_raw):
    asyncio.run(RouterManager(args, recv, shm_raw).loop_for_fwd())
