# Shape of lightllm/utils/health_check.py health_check @ v1.0.1 (l.47): a probe request through the
# whole engine; outside P/D mode its id is an ordinary positive one from the manager's generator and
# generate() has no is_health_req flag (l.64) - nothing in the call says it is a probe.
import asyncio

from lightllm.server.core.objs import SamplingParams
from lightllm.server.multimodal_params import MultimodalParams


async def health_check(args, httpserver_manager, request):
    sampling_params = SamplingParams(max_new_tokens=2, temperature=0.8)
    results_generator = httpserver_manager.generate("ni hao", sampling_params, MultimodalParams(), request)

    async def check_timeout(results_generator):
        async for _, _, _, _ in results_generator:
            pass

    await asyncio.wait_for(check_timeout(results_generator), timeout=100)
    return True
