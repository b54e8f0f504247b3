"""Test-only plumbing of the LightLLM stand-in (no upstream counterpart): the shared-memory block of
request structs, the fake model and the pipes between processes.

Real LightLLM keeps each request in a ctypes ``Req`` struct in shared memory
(``lightllm/server/core/objs/req.py`` @ fc72ffab) that the HTTP worker, the router and the
model-infer workers all map; here it is a ``multiprocessing.RawArray`` handed to the spawned
router and worker at start. The same block holds the request-id counter that
``lightllm/server/req_id_generator.py`` reads as a numpy int64 array (LightLLM: its own named
shared-memory ``ShmArray``), so ids are ``numpy.int64`` as LightLLM's are. The fake model answers a prompt of ``L`` tokens with tokens
``100, 101, ...`` and the end-of-sequence id 2 as its ``L``-th output token (index ``L - 1``),
unless ``max_new_tokens`` stops it first; the log-prob of output token ``k`` is ``-0.1 * (k + 1)``.
"""

import ctypes
import os
import time

EOS_ID = 2
SLOTS = 32
MAX_LEN = 96
STEP_S = 0.004  # one fake forward pass

NO_FINISH, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2


class FinishStatus:
    """Shape of lightllm/server/core/objs/req.py FinishStatus @ fc72ffab (a ctypes struct there)."""

    def __init__(self, status=NO_FINISH):
        self.status = status

    def is_finished(self):
        return self.status in (FINISHED_STOP, FINISHED_LENGTH)

    def is_aborted(self):
        return False

    def get_finish_reason(self):
        return {FINISHED_STOP: "stop", FINISHED_LENGTH: "length"}.get(self.status)


def make_req(id_ctype):
    """The ``Req`` struct of lightllm/server/core/objs/req.py with LightLLM's id field type
    ``id_ctype`` (``request_id`` / ``group_req_id``: ``c_int64`` on main, ``c_int`` in v1.0.x); the
    fields the stand-in uses, with the real ones' names and types where the adapter reads them."""

    class Req(ctypes.Structure):
        _fields_ = [
            ("index_in_shm_mem", ctypes.c_int),
            ("in_use", ctypes.c_bool),
            ("request_id", id_ctype),
            ("group_req_id", id_ctype),
            ("input_len", ctypes.c_int),
            ("max_new_tokens", ctypes.c_int32),
            ("shm_cur_output_len", ctypes.c_int),
            ("shm_cur_kv_len", ctypes.c_int),
            ("prompt_cache_len", ctypes.c_int),
            ("is_aborted", ctypes.c_bool),
            ("router_aborted", ctypes.c_bool),
            ("shm_infer_released", ctypes.c_bool),
            ("_finish", ctypes.c_int32),
            ("prompt_ids", ctypes.c_int32 * MAX_LEN),
            ("out_ids", ctypes.c_int32 * MAX_LEN),
            ("logprobs", ctypes.c_float * MAX_LEN),
            ("out_finish", ctypes.c_int32 * MAX_LEN),
        ]

        @property
        def finish_status(self):
            return FinishStatus(self._finish)

        def init(self, request_id, prompt_ids, sampling_params, tokenizer=None, chunked_prefill_size=0):
            self.request_id = request_id  # LightLLM passes group_request_id + i: a numpy.int64
            self.group_req_id = request_id - request_id % 8 if request_id >= 0 else request_id
            self.input_len = len(prompt_ids)
            self.max_new_tokens = sampling_params.max_new_tokens
            self.shm_cur_output_len = self.shm_cur_kv_len = self.prompt_cache_len = 0
            self.is_aborted = self.router_aborted = self.shm_infer_released = False
            self._finish = NO_FINISH
            for i, t in enumerate(prompt_ids):
                self.prompt_ids[i] = t

        def to_router_rpc_obj(self):
            return (self.request_id, self.index_in_shm_mem, self.multimodal_params, 0)

        def get_prompt_ids(self):
            return list(self.prompt_ids[: self.input_len])

    return Req


def _req_class():
    from lightllm.server.core.objs.req import Req  # the layout's struct (id field type)

    return Req


ID_SLOTS = 2  # the id generator's int64 array lives after the request structs


class ShmReqManager:
    """Shape of lightllm/server/core/objs/shm_req_manager.py ShmReqManager @ fc72ffab."""

    def __init__(self, raw):
        self.raw = raw
        req = _req_class()
        self.reqs = [req.from_buffer(raw, i * ctypes.sizeof(req)) for i in range(SLOTS)]

    def alloc_req_index(self):
        # slots are never reused within one stand-in run (LightLLM recycles them once the router,
        # detokenization and HTTP worker have all released the request)
        for req in self.reqs:
            if not req.in_use:
                req.in_use = True
                return req.index_in_shm_mem
        return None

    async def async_alloc_req_index(self):
        return self.alloc_req_index()

    def get_req_obj_by_index(self, index):
        return self.reqs[index]

    async def async_get_req_obj_by_index(self, index):
        return self.reqs[index]

    def put_back_req_obj(self, req):
        return


def ids_offset():
    """Byte offset of the id generator's counters in the shared block (8-byte aligned)."""
    return -(-SLOTS * ctypes.sizeof(_req_class()) // 8) * 8


def new_shm(ctx):
    raw = ctx.RawArray(ctypes.c_char, ids_offset() + 8 * ID_SLOTS)
    for i, req in enumerate(ShmReqManager(raw).reqs):
        req.index_in_shm_mem = i
    return raw


class FakeModel:
    """Deterministic next tokens and a prefix cache, standing in for the GPU forward pass."""

    def __init__(self):
        self.seen = []

    def cached_prefix(self, prompt):
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n)
        self.seen.append(list(prompt))
        return min(best, len(prompt) - 1)

    @staticmethod
    def next_token(input_len, k):
        return (EOS_ID if k == input_len - 1 else 100 + k), -0.1 * (k + 1)


def write_token(shm_req, k, token, logprob, finish):
    """What the worker's post-processing writes to shared memory for output token ``k``."""
    shm_req.out_ids[k] = token
    shm_req.logprobs[k] = logprob
    shm_req.out_finish[k] = finish
    if finish:
        shm_req._finish = finish
    shm_req.shm_cur_output_len = k + 1


def finish_for(shm_req, k, token):
    if token == EOS_ID:
        return FINISHED_STOP
    if k + 1 >= shm_req.max_new_tokens:
        return FINISHED_LENGTH
    return NO_FINISH


def step_pause():
    time.sleep(STEP_S)


VOCAB = 128


def fake_logits(run_reqs):
    """``(batch, VOCAB)`` logits whose greedy token and its log-prob are the fake model's: every
    other token at c, the target at 0, so the log-softmax of the target is exactly its log-prob."""
    import math

    import torch

    logits = torch.empty((len(run_reqs), VOCAB), dtype=torch.float32)
    for i, req in enumerate(run_reqs):
        token, logprob = FakeModel.next_token(req.shm_req.input_len, req.cur_output_len)
        logits[i].fill_(math.log((math.exp(-logprob) - 1.0) / (VOCAB - 1)))
        logits[i, token] = 0.0
    return logits


def worker_args(args, rank, conn, shm_raw):
    """The arguments the router gives the model-infer process of ``rank``, shaped as LightLLM's
    ``model_rpc.start_model_process`` passes them to ``_init_env``: main / v1.0.1 ``(args, rank,
    rank_in_node, node_world_size, ...)``, v1.0.0 ``(args, tp_rank, ...)`` - the tree is v1.0.0's
    when its ``dist_utils`` has no ``get_current_rank_in_dp`` (as the real v1.0.0). The pipe and
    the shared-memory block stand for the queues and events that follow."""
    from lightllm.utils import dist_utils

    if not hasattr(dist_utils, "get_current_rank_in_dp"):
        return (args, rank, conn, shm_raw)
    world = int(args.get("tp", 1))
    return (args, rank, rank, world, conn, shm_raw)


def start_workers(ctx, args, shm_raw):
    """Start one model-infer process per TP rank as LightLLM's ``start_model_process`` does: an
    unnamed ``Process(target=model_rpc._init_env, args=worker_args(...))``; returns (pipes, processes)."""
    from lightllm.server.router.model_infer.model_rpc import _init_env

    rpcs, workers = [], []
    for rank in range(int(args.get("tp", 1))):
        rpc, child = ctx.Pipe()
        worker = ctx.Process(target=_init_env, args=worker_args(args, rank, child, shm_raw))
        worker.start()
        rpcs.append(rpc)
        workers.append(worker)
    return rpcs, workers


def init_worker_rank(args, rank, ranks_in_dp):
    """What LightLLM's ``init_distributed_env`` settles for this rank (main / v1.0.1: ``rank_in_dp =
    rank % (world // dp)``, read back by ``dist_utils.get_current_rank_in_dp``); returns whether
    this rank writes the shared-memory results (main: master of its DP group; v1.0.0: ``tp_rank <
    dp_size``)."""
    dp = int(args.get("dp", 1))
    if not ranks_in_dp:
        return rank < dp
    rank_in_dp = rank % (int(args.get("tp", 1)) // dp)
    os.environ["STANDIN_RANK_IN_DP"] = str(rank_in_dp)
    return rank_in_dp == 0
