# mirrors vllm/v1/engine/llm_engine.py (LLMEngine.__init__ / add_request)
from vllm.v1.engine.output_processor import OutputProcessor


class _ModelConfig:
    served_model_name = "fake-model"
    max_logprobs = 20

    def get_vocab_size(self):
        return 100


class LLMEngine:
    def __init__(self, vllm_config=None, executor_class=None, log_stats=False):
        self.model_config = _ModelConfig()
        self.output_processor = OutputProcessor()

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if params is None:
            raise ValueError("params required")
