# mirrors vllm/entrypoints/pooling/offline.py (LLM's pooling methods)
class PoolingOfflineMixin:
    def score(self, data_1, data_2, /, *, use_tqdm=True, pooling_params=None, lora_request=None,
              tokenization_kwargs=None, chat_template=None):
        return []
