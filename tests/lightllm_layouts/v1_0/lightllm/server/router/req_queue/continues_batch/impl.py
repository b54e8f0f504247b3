# Shape of lightllm/server/router/req_queue/continues_batch/impl.py ContinuesBatchQueue @ v1.0.0 (2d768aac; limit_router_queue_length came in v1.0.1).
from ..base_queue import BaseQueue


class ContinuesBatchQueue(BaseQueue):
    def generate_new_batch(self, current_batch):
        return self._admit(current_batch, None)
