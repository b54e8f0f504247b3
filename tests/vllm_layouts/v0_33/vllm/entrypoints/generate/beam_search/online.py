# mirrors vllm/entrypoints/generate/beam_search/online.py (the OpenAI server's beam search)
class BeamSearchOnlineMixin:
    async def beam_search(self, prompt, request_id, params, lora_request=None, trace_headers=None, session_id=None,
                          priority=0):
        yield None
