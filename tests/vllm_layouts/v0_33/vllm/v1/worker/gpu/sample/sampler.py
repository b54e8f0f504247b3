# mirrors vllm/v1/worker/gpu/sample/sampler.py of vLLM 0.33.0
class Sampler:
    def add_request(self, req_idx, sampling_params):
        return None

    def __call__(self, logits, input_batch):
        return None
