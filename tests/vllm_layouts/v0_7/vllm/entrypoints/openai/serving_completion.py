# mirrors vllm/entrypoints/openai/serving_completion.py (<= 0.11)
class OpenAIServingCompletion:
    async def create_completion(self, request, raw_request=None):
        return None
