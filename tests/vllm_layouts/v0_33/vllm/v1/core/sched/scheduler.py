# mirrors vllm/v1/core/sched/scheduler.py
class Scheduler:
    def schedule(self, throttle_prefills=False):
        return None
