# mirrors vllm/v1/engine/output_processor.py (OutputProcessor.add_request / process_outputs / abort_requests /
# propagate_error, which AsyncLLM's output handler calls when the engine core dies)
class OutputProcessor:
    def __init__(self, tokenizer=None, log_stats=False):
        self.request_states = {}

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
        self.request_states[request.request_id] = request

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
        for out in engine_core_outputs:
            if out.finish_reason is not None:
                self.request_states.pop(out.request_id, None)
        return []

    def abort_requests(self, request_ids, internal=False):
        return [r for r in request_ids if self.request_states.pop(r, None) is not None]

    def propagate_error(self, e):
        for state in self.request_states.values():
            getattr(state, "queue", None) and state.queue.put(e)
