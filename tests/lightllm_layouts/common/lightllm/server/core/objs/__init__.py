# lightllm/server/core/objs/__init__.py @ fc72ffab exports Req, FinishStatus, SamplingParams, ShmReqManager
from lightllm._standin import ShmReqManager  # noqa: F401
from lightllm.server.core.objs.req import FinishStatus, Req  # noqa: F401


class SamplingParams:
    """Fields of lightllm/server/core/objs/sampling_params.py SamplingParams @ fc72ffab used here."""

    def __init__(self, n=1, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, group_request_id=-1):
        self.n = self.best_of = n
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.group_request_id = group_request_id
