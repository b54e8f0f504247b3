# mirrors vllm/entrypoints/llm.py (class LLM: generate, chat)
class LLM:
    def __init__(self, model, **kwargs):
        self.model = model

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        return []

    def chat(self, messages, sampling_params=None, use_tqdm=True):
        return self.generate(messages, sampling_params)
