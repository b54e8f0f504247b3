# mirrors vllm/v1/engine/core_client.py of vLLM 0.33.0
class EngineCoreClient:
    @staticmethod
    def make_client(multiprocess_mode, asyncio_mode, vllm_config, executor_class, log_stats, renderer=None):
        return log_stats

    @staticmethod
    def make_async_mp_client(vllm_config, executor_class, log_stats, client_addresses=None, client_count=1,
                             client_index=0, renderer=None):
        return log_stats
