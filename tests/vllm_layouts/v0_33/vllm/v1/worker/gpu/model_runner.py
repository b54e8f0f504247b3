# mirrors vllm/v1/worker/gpu/model_runner.py (Model Runner V2)
class GPUModelRunner:
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        return None

    def sample_tokens(self, grammar_output):
        return None
