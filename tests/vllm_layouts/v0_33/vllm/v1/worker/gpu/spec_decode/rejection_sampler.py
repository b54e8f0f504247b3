# mirrors vllm/v1/worker/gpu/spec_decode/rejection_sampler.py of vLLM 0.33.0
class RejectionSampler:
    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        return None
