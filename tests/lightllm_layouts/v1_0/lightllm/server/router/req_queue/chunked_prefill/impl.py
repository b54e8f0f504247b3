# Shape of lightllm/server/router/req_queue/chunked_prefill/impl.py ChunkedPrefillQueue @ v1.0.1 (b418bdf0).
from ..base_queue import BaseQueue


class ChunkedPrefillQueue(BaseQueue):
    def generate_new_batch(self, current_batch, limit_router_queue_length: int = None):
        return self._admit(current_batch, limit_router_queue_length)
