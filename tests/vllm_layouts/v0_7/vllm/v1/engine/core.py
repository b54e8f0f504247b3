# mirrors vllm/v1/engine/core.py (0.7: step only)
class EngineCore:
    def step(self):
        return []
