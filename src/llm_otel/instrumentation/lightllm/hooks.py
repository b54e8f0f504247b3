"""Every LightLLM function llm-otel wraps, with the LightLLM layout it targets. One screen, one table.

LightLLM runs each stage in its own fresh interpreter (gunicorn HTTP workers, router, one
model-infer worker per TP rank, detokenization). The table is applied per module, when that module
is imported in whichever process imports it (post-import hooks), so a process only pays for the
stages it runs and LightLLM is never imported by llm-otel itself.

Layouts (ModelTC/lightllm; detected from the code, never from the version string):

* ``main``: main @ fc72ffab (2025-07-11): shared-memory ``Req``s, router-driven steps
  (``RouterManager._prefill_batch`` / ``_decode_batch()``).
* ``v1.0``: tags v1.0.0 (2d768aac) / v1.0.1 (b418bdf0): as main, ``_decode_batch(batch)``.
* ``pr965``: the router refactor, PR #965 @ 746bf849: ``_add_req``, no router step methods
  (workers loop on their own), ``set_next_gen_token_id(..., output_len)``.
* ``2024``: PyPI lightllm 0.0.1 = e6452fd2 (2024-05-15): ``generate(prompt, sampling_params,
  group_request_id, multimodal_params, request=None)``, ``io_struct`` objects, rpyc workers.
  HTTP-side spans and router queueing; no worker spans (there is no ``InferenceContext``).
"""

from llm_otel.instrumentation._hooks import Hook

ALL = "main, v1.0, pr965, 2024"
SHM = "main, v1.0, pr965 (shared-memory requests, v1.0.0+)"
HTTP = "lightllm.server.httpserver.manager"
ROUTER = "lightllm.server.router.manager"
QUEUE = "lightllm.server.router.req_queue"
INFER = "lightllm.server.router.model_infer.infer_batch"
MULTIMODAL = "lightllm.server.multimodal_params"
PD_MASTER = "lightllm.server.httpserver_for_pd_master.manager"
PD_IO = "lightllm.server.pd_io_struct"
_PD = "lightllm.server.router.model_infer.mode_backend.continues_batch.pd_mode"
P_TRANS = f"{_PD}.prefill_node_impl.prefill_trans_obj"
D_TRANS = f"{_PD}.decode_node_impl.decode_trans_obj"
P_MOVE = f"{_PD}.prefill_node_impl.prefill_kv_move_manager"
D_MOVE = f"{_PD}.decode_node_impl.decode_kv_move_manager"

# not a wrapper: a __setstate__ added to the class (it has none), see carrier.py
SETSTATE = Hook(
    MULTIMODAL,
    "MultimodalParams.__setstate__",
    "carrier_setstate",
    ALL,
    "the trace carrier arrives in this process (every hop pickles MultimodalParams by value)",
)

HOOKS: list[Hook] = [
    # --- HTTP worker (gunicorn): the request span ----------------------------------------------
    Hook(
        HTTP,
        "HttpServerManager.__init__",
        "http.init",
        ALL,
        "the served model name, from the start args the HTTP worker's manager is built with",
    ),
    Hook(
        "lightllm.utils.health_check",
        "health_check",
        "http.health_check",
        "main, v1.0, pr965",
        "generate() calls made by LightLLM's own health check are probes, not requests (v1.0.x "
        "probes have no is_health_req flag and a positive id)",
    ),
    Hook(
        HTTP,
        "HttpServerManager.generate",
        "http.generate",
        ALL,
        "request span (SERVER when a Request is given): headers, sampling params, every yielded "
        "(sub_req_id, text, metadata, finish_status); client disconnect; health probes skipped",
    ),
    Hook(
        HTTP,
        "HttpServerManager.transfer_to_next_module",
        "http.transfer",
        SHM,
        "group id, final prompt length (shm Req.input_len); puts the carrier on MultimodalParams "
        "before GroupReqIndexes is pickled to the router",
    ),
    Hook(HTTP, "HttpServerManager.abort", "http.abort", ALL, "aborted requests end with error.type=aborted"),
    # --- router: queueing, admission, engine steps, release -------------------------------------
    Hook(
        ROUTER,
        "RouterManager.add_req",
        "router.add_req",
        "main, v1.0, 2024",
        "queued: GroupReqIndexes.{group_req_id, time_mark, shm_req_indexes, multimodal_params}",
        group="router.add_req",
    ),
    Hook(ROUTER, "RouterManager._add_req", "router.add_req", "pr965", "the same, renamed", group="router.add_req"),
    Hook(
        ROUTER,
        "RouterManager._decode_batch",
        "router.decode_batch",
        "main, v1.0, 2024",
        "one engine step (chunked prefill + one decode token per running request): llm.engine.step",
    ),
    Hook(
        f"{QUEUE}.chunked_prefill.impl",
        "ChunkedPrefillQueue.generate_new_batch",
        "router.admit",
        SHM,
        "requests leaving the wait queue (default queue)",
    ),
    Hook(
        f"{QUEUE}.continues_batch.impl",
        "ContinuesBatchQueue.generate_new_batch",
        "router.admit",
        ALL,
        "the same, --disable_chunked_prefill",
    ),
    Hook(
        f"{QUEUE}.chunked_prefill.beam_impl",
        "ChunkedBeamContinuesBatchQueue.generate_new_batch",
        "router.admit",
        "main, pr965",
        "the same, diverse (beam) mode",
    ),
    Hook(
        f"{QUEUE}.continues_batch.beam_impl",
        "BeamContinuesBatchQueue.generate_new_batch",
        "router.admit",
        "v1.0",
        "the same, diverse (beam) mode",
    ),
    Hook(
        f"{QUEUE}.continues_batch.pd_decode_impl",
        "ContinuesBatchQueueForPDDecode.generate_new_batch",
        "router.admit",
        "v1.0",
        "the same, P/D decode node",
    ),
    Hook(
        f"{QUEUE}.chunked_prefill.impl_for_pd_prefill",
        "QueueForPDChunkedPrefill.generate_new_batch",
        "router.admit",
        "main, pr965",
        "the same, P/D prefill node",
    ),
    Hook(
        f"{QUEUE}.continues_batch.impl_for_pd_decode",
        "QueueForPDDecode.generate_new_batch",
        "router.admit",
        "main, pr965",
        "the same, P/D decode node",
    ),
    Hook(
        "lightllm.server.router.batch",
        "Batch.filter_out_finished_req",
        "router.filter_finished",
        SHM,
        "released requests: shm_cur_output_len, prompt_cache_len, is_aborted, finish_status",
        group="router.filter",
    ),
    Hook(
        "lightllm.server.io_struct",
        "Batch.filter_out_finished_req",
        "router.filter_finished",
        "2024",
        "the same in the 2024 layout (Req.cur_output_len, FinishStatus enum)",
        group="router.filter",
    ),
    # --- model-infer worker (master rank of each DP group only) ---------------------------------
    Hook(
        INFER,
        "InferenceContext.add_reqs",
        "worker.add_reqs",
        SHM,
        "request tuples (request_id, shm_index, multimodal_params, dp_index): the carrier",
    ),
    Hook(
        INFER,
        "InferReq.set_next_gen_token_id",
        "worker.token",
        SHM,
        "every generated token: id and sampled log-prob; the first one ends prefill",
    ),
    Hook(
        INFER,
        "InferenceContext.filter",
        "worker.filter",
        SHM,
        "finished requests: finish_status, shm_req.{input_len, prompt_cache_len, router_aborted}",
    ),
    Hook(
        f"{INFER.rsplit('.', 1)[0]}.mode_backend.generic_post_process",
        "sample",
        "worker.sample",
        "main, pr965",
        "(batch, vocab) logits before sampling (modified in place by it) -> llm.logit_dist "
        "for chosen requests; wrapped when the module is imported, before the backends import it by name",
        group="worker.sample",
    ),
    Hook(
        f"{INFER.rsplit('.', 1)[0]}.mode_backend.continues_batch.post_process",
        "sample",
        "worker.sample",
        "v1.0",
        "the same in v1.0.x (every backend imports it from here)",
        group="worker.sample",
    ),
    # --- P/D mode (kv.py): PD master, prefill/decode nodes' kv-move managers --------------------
    Hook(
        PD_MASTER,
        "HttpServerManagerForPDMaster.generate",
        "kv.pd_generate",
        SHM,
        "the PD master's request span (SERVER; child of request.headers' W3C context, else a root): "
        "sampling params, self.args (model), every yielded (sub_req_id, text, metadata, "
        "finish_status), the exception that ends the stream",
    ),
    Hook(
        PD_MASTER,
        "HttpServerManagerForPDMaster.fetch_stream",
        "kv.pd_master",
        SHM,
        "the master span's W3C context (sampled or not; else request.headers') and "
        "sampling_params.group_request_id -> the carrier on the multimodal_params pickled to the "
        "prefill and decode nodes",
    ),
    Hook(
        PD_IO,
        "KVMoveTask.__post_init__",
        "kv.task",
        SHM,
        "prefill worker builds the move task (a dataclass: its generated __init__ ends with this "
        "call, group_request_id set): this process's carrier goes on it, "
        "pickled with it to the kv-move manager and the decode node",
    ),
    Hook(
        P_TRANS,
        "KVTransConnectObj._transfer_kv",
        "kv.send",
        "main, pr965",
        "prefill kv-move manager: one group of KVMoveTask sent to one decode node (returns on the "
        "transfer process's 'ok'; raises on another answer or a 60 s timeout): "
        "task.{group_request_id, move_kv_len, decode_node.node_id}",
        group="kv.send",
    ),
    Hook(P_MOVE, "TransProcessObj._transfer_kv", "kv.send", "v1.0", "the same in v1.0.x", group="kv.send"),
    Hook(
        D_TRANS,
        "KVTransConnectObj._transfer_kv",
        "kv.receive",
        "main, pr965",
        "decode kv-move manager: the same group received: task.{group_request_id, move_kv_len, prefill_node_id}",
        group="kv.receive",
    ),
    Hook(D_MOVE, "TransProcessObj._transfer_kv", "kv.receive", "v1.0", "the same in v1.0.x", group="kv.receive"),
]

MODULES = sorted({h.module for h in HOOKS} | {MULTIMODAL})


def _params(cls, name: str) -> list[str]:
    import inspect

    try:
        return list(inspect.signature(getattr(cls, name)).parameters)
    except (AttributeError, TypeError, ValueError):
        return []


def detect_layout(module_name: str, module) -> str | None:
    """The known layout an imported LightLLM module has (``main``, ``v1.0``, ``pr965``, ``2024``),
    read from its classes and signatures; None when it matches none of them."""
    if module_name == HTTP:
        cls = getattr(module, "HttpServerManager", None)
        if cls is None:
            return None
        if "group_request_id" in _params(cls, "generate"):
            return "2024"
        return "main" if hasattr(cls, "transfer_to_next_module") else None
    if module_name == ROUTER:
        cls = getattr(module, "RouterManager", None)
        if cls is None:
            return None
        if hasattr(cls, "_add_req"):
            return "pr965"
        params = _params(cls, "add_req")
        if "group_req_indexes" in params:
            return "v1.0" if "batch" in _params(cls, "_decode_batch") else "main"
        return "2024" if "prompt_ids" in params else None
    if module_name in (P_MOVE, D_MOVE):  # v1.0.x: the transfer object lives here
        return "v1.0" if hasattr(module, "TransProcessObj") else "main"
    if module_name in (P_TRANS, D_TRANS):  # main / PR #965 only
        return "main" if hasattr(module, "KVTransConnectObj") else None
    if module_name == INFER:
        cls = getattr(module, "InferReq", None)
        if not hasattr(module, "InferenceContext"):
            return "2024" if hasattr(module, "InferBatch") else None  # 2024: rpyc workers, InferBatch
        if cls is None:
            return None
        return "pr965" if "output_len" in _params(cls, "set_next_gen_token_id") else "main"
    return None


def expected(hook: Hook, layout: str | None) -> bool:
    """Whether ``hook`` should resolve in a module of ``layout`` (unknown layout: every hook)."""
    return layout is None or layout in hook.layout
