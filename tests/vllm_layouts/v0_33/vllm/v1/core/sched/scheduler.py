# mirrors vllm/v1/core/sched/scheduler.py
class Scheduler:
    def add_request(self, request):
        return None

    def schedule(self, throttle_prefills=False):
        return None

    def make_stats(self, spec_decoding_stats=None, kv_connector_stats=None, cudagraph_stats=None,
                   perf_stats=None, ec_connector_stats=None):
        return None  # SchedulerStats | None (None when log_stats is off)

    def update_from_output(self, scheduler_output, model_runner_output):
        return {}  # dict[int, EngineCoreOutputs]
