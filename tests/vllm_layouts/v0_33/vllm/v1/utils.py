# mirrors vllm/v1/utils.py: shutdown(procs, timeout) - SIGTERM, then SIGKILL after `timeout` (API servers)
def shutdown(procs, timeout=None):
    pass
