# Shape of lightllm/server/router/model_infer/infer_batch.py @ PR #965 (746bf849): add_reqs(requests)
# l.56 (no init_req_obj), filter l.119, set_next_gen_token_id(next_token_id, logprob, output_len) l.349
# (cur_output_len is advanced before the call).
from lightllm._standin import FinishStatus, FakeModel


class InferenceContext:
    shm_req_manager = None
    requests_mapping = None

    def register(self, shm_req_manager):
        self.shm_req_manager = shm_req_manager
        self.requests_mapping = {}
        self.infer_req_ids = []
        self.model = FakeModel()

    def add_reqs(self, requests):
        for r in requests:
            r_id, r_index, multimodal_params, _ = r
            if r_id not in self.requests_mapping:
                self.requests_mapping[r_id] = InferReq(r_id, len(self.requests_mapping), r_index, multimodal_params)
            else:
                assert self.requests_mapping[r_id].paused
            self.infer_req_ids.append(r_id)
            self.requests_mapping[r_id].init_all()

    def filter(self, finished_request_ids):
        for request_id in finished_request_ids:
            req = self.requests_mapping.pop(request_id)
            req.shm_req.shm_infer_released = True
            self.shm_req_manager.put_back_req_obj(req.shm_req)
        done = set(finished_request_ids)
        self.infer_req_ids = [i for i in self.infer_req_ids if i not in done]


g_infer_context = InferenceContext()


class InferReq:
    def __init__(self, req_id, req_idx, shm_index, multimodal_params=None, vocab_size=-1):
        self.req_id = req_id
        self.req_idx = req_idx
        self.shm_index = shm_index
        self.multimodal_params = multimodal_params
        self.vocab_size = vocab_size
        self.initialized = False
        self.paused = False

    def init_all(self):
        if not self.initialized:
            self.shm_req = g_infer_context.shm_req_manager.get_req_obj_by_index(self.shm_index)
            self.multimodal_params = self.multimodal_params.to_dict()
            self.cur_kv_len = 0
            self.cur_output_len = 0
            self.finish_status = FinishStatus()
            self.shm_req.prompt_cache_len = g_infer_context.model.cached_prefix(self.shm_req.get_prompt_ids())
        self.initialized = True
        self.paused = False

    def get_cur_total_len(self):
        return self.shm_req.input_len + self.cur_output_len

    def set_next_gen_token_id(self, next_token_id: int, logprob: float, output_len: int):
        index = self.shm_req.input_len + output_len - 1
        self.last = (index, next_token_id, logprob)
