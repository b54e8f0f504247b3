# mirrors vllm/v1/engine/processor.py (0.7)
class Processor:
    def process_inputs(self, request_id, prompt, params, arrival_time=None):
        pass
