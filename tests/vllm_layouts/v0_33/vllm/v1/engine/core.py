# mirrors vllm/v1/engine/core.py (step_with_batch_queue removed; shutdown as in 0.32)
class EngineCore:
    def step(self):
        return {}, False

    def shutdown(self):
        pass
