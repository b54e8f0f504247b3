# mirrors vllm/entrypoints/openai/completion/serving.py
class OpenAIServingCompletion:
    async def create_completion(self, request, raw_request=None):
        return None
