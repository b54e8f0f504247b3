# mirrors vllm/v1/worker/gpu_model_runner.py of vLLM 0.33.0 (the V1 runner, still shipped)
class GPUModelRunner:
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return None

    def sample_tokens(self, grammar_output):
        return None

    def _sample(self, logits, spec_decode_metadata):
        return None
