# Shape of the PR #965 (746bf849) worker: ModeBackend.infer_loop() reads new requests itself
# (_try_read_new_reqs -> g_infer_context.add_reqs) and runs prefill/decode without the router;
# InferReqUpdatePack.handle advances cur_output_len, then set_next_gen_token_id(id, logprob, output_len).
from lightllm import _standin
from lightllm.server.router.model_infer.infer_batch import g_infer_context


def infer_loop(conn):
    stopping = False
    while not stopping or g_infer_context.infer_req_ids:
        while not stopping and conn.poll(0 if g_infer_context.infer_req_ids else 0.002):
            msg = conn.recv()
            if msg is None:
                stopping = True
            else:
                g_infer_context.add_reqs(msg[1])
        finished = []
        for rid in list(g_infer_context.infer_req_ids):
            req = g_infer_context.requests_mapping[rid]
            shm = req.shm_req
            if shm.router_aborted:
                finished.append(rid)
                continue
            k = req.cur_output_len
            token, logprob = g_infer_context.model.next_token(shm.input_len, k)
            req.cur_output_len += 1
            req.set_next_gen_token_id(token, logprob, req.cur_output_len)
            finish = _standin.finish_for(shm, k, token)
            req.finish_status.status = finish
            _standin.write_token(shm, k, token, logprob, finish)
            if finish:
                finished.append(rid)
        if g_infer_context.infer_req_ids:
            _standin.step_pause()
        g_infer_context.filter(finished)


def _init_env(args, rank, rank_in_node, node_world_size, conn, shm_raw):
    _standin.init_worker_rank(args, rank, True)
    g_infer_context.register(_standin.ShmReqManager(shm_raw))
    infer_loop(conn)
