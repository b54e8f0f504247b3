# mirrors vllm/v1/worker/gpu_model_runner.py (0.7: sampling inside execute_model)
class GPUModelRunner:
    def execute_model(self, scheduler_output):
        return None
