# mirrors vllm/v1/worker/gpu/model_runner.py of vLLM 0.33.0 (Model Runner V2)
class GPUModelRunner:
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False,
                      skip_attn_for_dummy_run=False, is_profile=False, context_len=0,
                      valid_dummy_state_slots=False, randomize_inputs=False):
        return None

    def sample_tokens(self, grammar_output):
        return None
