# mirrors vllm/v1/engine/core_client.py
class EngineCoreClient:
    @staticmethod
    def make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats, renderer=None):
        return log_stats

    @staticmethod
    def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None):
        return log_stats
