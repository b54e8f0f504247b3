# mirrors vllm/v1/worker/gpu/model_runner.py (Model Runner V2)
class GPUModelRunner:
    def sample_tokens(self, grammar_output):
        return None
