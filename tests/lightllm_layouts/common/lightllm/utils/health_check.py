# Shape of lightllm/utils/health_check.py health_check @ fc72ffab (l.63): a probe request through the
# whole engine, with a negative group id (l.85; LightLLM takes it from a second ReqIDGenerator, here
# the manager's) and is_health_req=True (l.89), consumed to the end.
import asyncio

from lightllm.server.core.objs import SamplingParams
from lightllm.server.multimodal_params import MultimodalParams


async def health_check(args, httpserver_manager, request):
    sampling_params = SamplingParams(max_new_tokens=2, temperature=0.8)
    sampling_params.group_request_id = -httpserver_manager.id_gen.generate_id()  # health monitor ids are negative
    results_generator = httpserver_manager.generate(
        "ni hao", sampling_params, MultimodalParams(), request, is_health_req=True
    )

    async def check_timeout(results_generator):
        async for _, _, _, _ in results_generator:
            pass

    await asyncio.wait_for(check_timeout(results_generator), timeout=100)
    return True
