# Shape of lightllm/server/router/model_infer/model_rpc.py @ fc72ffab: the router starts one worker
# process per TP rank (start_model_process -> mp.Process(target=_init_env, args=(args, rank,
# rank_in_node, node_world_size, ...)); v1.0.0: (args, tp_rank, ...)) and calls ModelRpcServer.prefill
# / decode on every rank; here over a pipe instead of LightLLM's shared-memory RPC. Every rank samples
# and sets its tokens; only the master of the DP group writes the shared-memory results. The decode step follows ContinuesBatchBackend
# normal_decode + ModeBackend._post_handle: one token per running request, set_next_gen_token_id,
# shared-memory counters, then g_infer_context.filter(finished). The forward pass and sampling are
# in mode_backend/continues_batch/impl.py.
from lightllm import _standin
from lightllm.server.router.model_infer.infer_batch import g_infer_context


class ModelRpcServer:
    def __init__(self, shm_raw, master=True):
        self.master = master
        from lightllm.server.router.model_infer.mode_backend.continues_batch.impl import ContinuesBatchBackend

        g_infer_context.register(_standin.ShmReqManager(shm_raw))
        self.backend = ContinuesBatchBackend()

    def prefill(self, reqs):
        g_infer_context.add_reqs(reqs, init_req_obj=False)

    def decode(self):
        finished, run_reqs = [], []
        for rid in list(g_infer_context.infer_req_ids):
            req = g_infer_context.requests_mapping[rid]
            if not req.initialized or req.paused:
                req.init_all()
            if req.shm_req.router_aborted:
                finished.append(rid)
            else:
                run_reqs.append(req)
        if run_reqs:
            ids, logprobs = self.backend.normal_decode(run_reqs)
            for req, token, logprob in zip(run_reqs, ids, logprobs):
                shm = req.shm_req
                k = req.cur_output_len
                req.set_next_gen_token_id(token, logprob)
                req.cur_output_len += 1
                finish = _standin.finish_for(shm, k, token)
                req.finish_status.status = finish
                if self.master:  # main: is_master_in_dp; v1.0.0: tp_rank < dp_size
                    _standin.write_token(shm, k, token, logprob, finish)
                if finish:
                    finished.append(req.req_id)
            _standin.step_pause()
        g_infer_context.filter(finished)


def _init_env(args, rank, *rest):
    # main / v1.0.1: (args, rank, rank_in_node, node_world_size, ..., conn, shm_raw);
    # v1.0.0: (args, tp_rank, ..., conn, shm_raw) - see _standin.worker_args
    conn, shm_raw = rest[-2:]
    master = _standin.init_worker_rank(args, rank, len(rest) > 2)
    server = ModelRpcServer(shm_raw, master)
    while True:
        msg = conn.recv()
        if msg == (None,):
            conn.send("bye")
            return
        getattr(server, msg[0])(*msg[1:])
        conn.send("ok")
