# mirrors vllm/entrypoints/openai/serving_chat.py (<= 0.11)
class OpenAIServingChat:
    async def create_chat_completion(self, request, raw_request=None):
        return None
