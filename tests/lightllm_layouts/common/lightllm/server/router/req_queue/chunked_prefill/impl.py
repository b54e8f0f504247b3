# Shape of lightllm/server/router/req_queue/chunked_prefill/impl.py ChunkedPrefillQueue @ fc72ffab:
# overrides generate_new_batch without calling super().
from ..base_queue import BaseQueue


class ChunkedPrefillQueue(BaseQueue):
    def generate_new_batch(self, current_batch, limit_router_queue_length: int = None):
        return self._admit(current_batch, limit_router_queue_length)
