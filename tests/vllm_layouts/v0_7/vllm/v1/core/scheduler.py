# mirrors vllm/v1/core/scheduler.py (0.7, before the sched/ package)
class Scheduler:
    def schedule(self):
        return None
