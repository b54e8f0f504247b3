# mirrors vllm/v1/engine/core.py of vLLM 0.33.0 (parameters checked against tests/contracts/vllm-0.33.0.json)
class EngineCore:
    def step(self):
        return {}, False

    def step_with_batch_queue(self):
        return None, False

    def shutdown(self):
        pass
