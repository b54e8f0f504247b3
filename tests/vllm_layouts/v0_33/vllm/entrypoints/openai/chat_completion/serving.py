# mirrors vllm/entrypoints/openai/chat_completion/serving.py
class OpenAIServingChat:
    async def create_chat_completion(self, request, raw_request=None):
        return None
