# mirrors vllm/v1/engine/async_llm.py
class AsyncLLM:
    def __init__(self, vllm_config=None, executor_class=None, log_stats=False):
        pass

    async def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None,
                          tokenization_kwargs=None, trace_headers=None, priority=0):
        return None
