"""Every vLLM function llm-otel wraps, with the vLLM layout it targets. One screen, one table.

Process legend: all hooks here run in the frontend process (offline ``LLM`` / ``LLMEngine``);
engine-core and worker hooks arrive with the served-vLLM adapter.
"""

from llm_otel.instrumentation._hooks import Hook

V1 = "vLLM V1 engine, 0.30 - 0.32 (vllm.v1.engine.*, vllm.entrypoints.llm)"

HOOKS: list[Hook] = [
    Hook("vllm.entrypoints.llm", "LLM.generate", "traced_operation", V1,
         "operation name text_completion for the requests it adds"),
    Hook("vllm.entrypoints.llm", "LLM.chat", "traced_operation", V1,
         "operation name chat for the requests it adds"),
    Hook("vllm.v1.engine.core_client", "EngineCoreClient.make_client", "engine_core_client", V1,
         "asks the engine core for per-request QUEUED/SCHEDULED/PREEMPTED events (log_stats) "
         "when LLM_OTEL_VLLM_ENGINE_EVENTS is on"),
    Hook("vllm.v1.engine.llm_engine", "LLMEngine.__init__", "engine_init", V1,
         "model name (model_config.served_model_name), max_logprobs, engine version"),
    Hook("vllm.v1.engine.llm_engine", "LLMEngine.add_request", "engine_add_request", V1,
         "requests the engine rejects before scheduling (error span + duration metric)"),
    Hook("vllm.v1.engine.output_processor", "OutputProcessor.add_request", "output_add_request", V1,
         "request arrival: EngineCoreRequest.arrival_time, prompt_token_ids, sampling_params; starts the request span"),
    Hook("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs", "process_outputs", V1,
         "per step: EngineCoreOutputs.timestamp, new_token_ids, events, prefill_stats, new_logprobs, finish"),
    Hook("vllm.v1.engine.output_processor", "OutputProcessor.abort_requests", "abort_requests", V1,
         "aborted requests end their spans with error.type=aborted"),
]
