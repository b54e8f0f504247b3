"""Every SGLang function llm-otel wraps. One screen, one table.

SGLang (sgl-project/sglang 0.5.22, 0.5.23) serves from three kinds of process, all started with
``spawn``: the launcher/HTTP process (FastAPI + ``TokenizerManager``; one per ``--tokenizer-worker-num``
worker), ``sglang::scheduler`` (one per TP/DP rank; it runs the model) and ``sglang::detokenizer``.
The table is applied per module when that module is imported, in whichever process imports it.

Context across processes rides on SGLang's own per-request carrier: the ``APIServerReqTimeStats``
object the TokenizerManager pickles into every ``TokenizedGenerateReqInput`` (its ``__getstate__``
gets one more key, which the scheduler's ``__setstate__`` puts back as an attribute). The scheduler
keeps a table keyed by request id (see scheduler.py), freed on finish and abort.
"""

from llm_otel.instrumentation._hooks import Hook

RELEASES = "0.5.22, 0.5.23"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
SCHEDULER = "sglang.srt.managers.scheduler"
TIME_STATS = "sglang.srt.observability.req_time_stats"
SAMPLER = "sglang.srt.layers.sampler"

HOOKS: list[Hook] = [
    # --- HTTP process (TokenizerManager): the request spans and the GenAI metrics -----------------
    Hook(
        TOKENIZER,
        "TokenizerManager._init_req_state",
        "tokenizer.init_req_state",
        RELEASES,
        "request arrival: one record per request id (n>1: one per choice), the inbound traceparent "
        "from request.headers, sampling params; with --enable-trace, SGLang's root nests under ours",
    ),
    Hook(
        TOKENIZER,
        "TokenizerManager.generate_request",
        "tokenizer.generate_request",
        RELEASES,
        "the request's life in the HTTP process: a client disconnect or an error ends its records",
    ),
    Hook(
        TOKENIZER,
        "TokenizerManager._handle_batch_output",
        "tokenizer.batch_output",
        RELEASES,
        "each output batch from the detokenizer: BatchStrOutput.{rids, output_ids, finished_reasons, "
        "prompt_tokens, completion_tokens, cached_tokens} - token timing, counts, finish",
    ),
    Hook(TOKENIZER, "TokenizerManager.abort_request", "tokenizer.abort", RELEASES, "aborted requests end as aborted"),
    Hook(
        TIME_STATS,
        "APIServerReqTimeStats.__getstate__",
        "carrier_getstate",
        RELEASES,
        "the request span's traceparent travels with the request to the scheduler",
    ),
    # --- scheduler process: llm.engine.step --------------------------------------------------
    Hook(
        SCHEDULER,
        "Scheduler.__init__",
        "scheduler.init",
        RELEASES,
        "process identity: engine_core with its tp/pp/dp rank (run_scheduler_process, the spawn "
        "target, cannot be wrapped: spawn pickles it)",
    ),
    Hook(
        SCHEDULER,
        "Scheduler.handle_generate_request",
        "scheduler.handle_generate_request",
        RELEASES,
        "a request arrives in the scheduler: its carrier goes into the table keyed by rid",
    ),
    Hook(
        SCHEDULER,
        "Scheduler.run_batch",
        "scheduler.run_batch",
        RELEASES,
        "one engine step: ScheduleBatch.{reqs, forward_mode, extend_num_tokens} -> llm.engine.step "
        "linked to the sampled requests in the batch",
    ),
    Hook(
        SCHEDULER,
        "Scheduler.process_batch_result",
        "scheduler.batch_result",
        RELEASES,
        "after a step's results: the requests it finished (Req.finished()) leave the table",
    ),
    Hook(SCHEDULER, "Scheduler.abort_request", "scheduler.abort", RELEASES, "aborted requests leave the table"),
    Hook(
        SCHEDULER,
        "Scheduler.send_abort_output",
        "scheduler.abort_output",
        "0.5.23",  # 0.5.22 sends such outputs inline: its entries stay until the table's cap
        "a request the scheduler ends outside the output stream (rejected: queue full, priority "
        "disabled; aborted while queued; retracted) leaves the table, its llm.infer.request ends aborted",
    ),
    Hook(
        SAMPLER,
        "Sampler.forward",
        "scheduler.logits.sampler",
        RELEASES,
        "llm.logit_dist: LogitsProcessorOutput.next_token_logits rows of the chosen requests (row i = "
        "request i of the batch run_batch runs) before sampling, the sampled ids after",
    ),
]

MODULES = sorted({h.module for h in HOOKS})

TRACE = "sglang.srt.observability.trace"
MULTI_TOKENIZER = "sglang.srt.managers.multi_tokenizer_mixin"

SERVING: list[tuple[str, str]] = [
    (TOKENIZER, "TokenizerManager.__init__"),
    (SCHEDULER, "Scheduler.__init__"),
    (MULTI_TOKENIZER, "MultiTokenizerRouter.__init__"),
    (TRACE, "process_tracing_init"),
]
"""The calls that make a process one llm-otel serves (module, ``Class.__init__`` or function): the
HTTP process and each tokenizer worker build a ``TokenizerManager``; each scheduler a ``Scheduler``;
with several tokenizer workers the launcher runs the ``MultiTokenizerRouter``, which unpickles and
re-pickles every request on its way to the scheduler (the carrier's ``__getstate__`` hook must be
there); ``process_tracing_init`` (``--enable-trace``) installs SGLang's tracer provider - in the
scheduler before its ``Scheduler`` exists - so llm-otel's providers must come first to stay global.
Every SGLang child process imports these modules (``spawn`` re-imports ``sglang.launch_server`` as
``__mp_main__``), so importing them decides nothing: the ``sglang::detokenizer`` imports them and
calls none, and gets no providers, no exporter process and no hooks."""

GATE_MODULES = sorted({module for module, _ in SERVING} - set(MODULES))
"""Modules imported only for a gate (no hook of HOOKS lives there)."""
