# mirrors vllm/v1/executor/multiproc_executor.py (WorkerProc.shutdown, called when the worker leaves its loop)
class WorkerProc:
    def shutdown(self):
        pass
