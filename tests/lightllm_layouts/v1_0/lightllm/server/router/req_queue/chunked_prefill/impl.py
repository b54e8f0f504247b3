# Shape of lightllm/server/router/req_queue/chunked_prefill/impl.py ChunkedPrefillQueue @ v1.0.0 (2d768aac; limit_router_queue_length came in v1.0.1):
# overrides generate_new_batch without calling super().
from ..base_queue import BaseQueue


class ChunkedPrefillQueue(BaseQueue):
    def generate_new_batch(self, current_batch):
        return self._admit(current_batch, None)
