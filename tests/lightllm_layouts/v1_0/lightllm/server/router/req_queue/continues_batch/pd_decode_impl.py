# Shape of lightllm/server/router/req_queue/continues_batch/pd_decode_impl.py ContinuesBatchQueueForPDDecode @ v1.0.1 (b418bdf0).
from ..base_queue import BaseQueue


class ContinuesBatchQueueForPDDecode(BaseQueue):
    def generate_new_batch(self, current_batch, limit_router_queue_length: int = None):
        return self._admit(current_batch, limit_router_queue_length)
