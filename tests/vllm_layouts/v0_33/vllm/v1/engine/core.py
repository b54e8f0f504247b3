# mirrors vllm/v1/engine/core.py (step_with_batch_queue removed)
class EngineCore:
    def step(self):
        return {}, False
