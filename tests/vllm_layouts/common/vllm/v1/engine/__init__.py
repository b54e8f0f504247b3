# mirrors vllm/v1/engine/__init__.py (EngineCoreRequest/EngineCoreOutput fields the adapter reads)
class EngineCoreRequest:
    def __init__(self, request_id, prompt_token_ids, sampling_params, arrival_time):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time


class EngineCoreOutput:
    def __init__(self, request_id, new_token_ids, finish_reason=None, events=None):
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason
        self.events = events
        self.prefill_stats = None
        self.new_logprobs = None


class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, n=1):
        self.max_tokens, self.temperature, self.top_p, self.top_k, self.n = max_tokens, temperature, top_p, top_k, n
        self.seed = None
        self.logprobs = None
        self.extra_args = None
        self.frequency_penalty = self.presence_penalty = 0.0
