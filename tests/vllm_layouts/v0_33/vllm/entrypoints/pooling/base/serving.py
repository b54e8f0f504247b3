# mirrors vllm/entrypoints/pooling/base/serving.py (the OpenAI pooling handlers' base)
class PoolingBaseServing:
    async def __call__(self, request, raw_request=None):
        return None

    async def _init_ctx(self, io_processor, request, raw_request=None):
        return None
