# mirrors vllm/v1/engine/core_client.py (0.7: make_client only)
class EngineCoreClient:
    @staticmethod
    def make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats):
        return log_stats
