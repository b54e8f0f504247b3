"""vLLM's trace carrier and what a step's ``SchedulerOutput`` says about its batch: the one place
the adapter's three processes (frontend, engine core, worker) read them.

Carrier: the frontend writes the request span's W3C context into the engine-bound
``SamplingParams.extra_args`` (vLLM copies it to every process that holds the request: the
scheduler's ``Request.sampling_params``, ``NewRequestData.sampling_params`` in the step's
``SchedulerOutput``, the worker's ``CachedRequestState.sampling_params`` and MRv2's
``Sampler.add_request``); the engine core writes the step span's ids onto the ``SchedulerOutput``
it hands to the worker (:data:`STEP_CARRIER_ATTR`), and the worker writes its KV-connector time
of the step onto the ``ModelRunnerOutput`` it returns (:data:`STEP_KV_ATTR`).

Step phase (vLLM 0.32 ``vllm/v1/core/sched/output.py``): ``SchedulerOutput.num_scheduled_tokens``
{req_id: tokens}, ``total_num_scheduled_tokens``, ``scheduled_new_reqs`` (``NewRequestData``:
``num_computed_tokens``, ``prompt_token_ids``, and under Model Runner V2 ``prefill_token_ids``,
prompt + outputs of a request resumed after a preemption), ``scheduled_cached_reqs.req_ids`` /
``.num_computed_tokens`` (before this step) / ``.num_output_tokens`` (outputs + async-scheduling
placeholders; 0 = the prompt is still being prefilled in chunks) / ``.resumed_req_ids`` (back
after a preemption: they recompute prompt and outputs, possibly in chunks),
``scheduled_spec_decode_tokens`` {req_id: draft token ids}. The prompt length comes from the
scheduler's ``Request.num_prompt_tokens`` (``vllm/v1/request.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from llm_otel.propagation import parse_traceparent

CARRIER_KEY = "llm_otel.traceparent"  # key in vLLM SamplingParams.extra_args
CARRIER_STATE_KEY = "llm_otel.tracestate"  # the request span's tracestate (ot=th:, vendors), if any
CARRIER_TOPK_KEY = "llm_otel.logit_top_k"  # present: the worker computes llm.logit_dist (k)
STEP_CARRIER_ATTR = "llm_otel_step"  # on vLLM's SchedulerOutput: (trace_id, span_id, sampled) of the step span
# on the worker's ModelRunnerOutput: the step's KV-connector time (load_ns, first load start ns,
# save_ns, first save start ns), back to the engine core (instrumentation/vllm/kv_transfer.py)
STEP_KV_ATTR = "llm_otel_kv"


def request_span_context(sampling_params: Any) -> Any:
    """The request span's SpanContext from a request's ``SamplingParams.extra_args``
    (:data:`CARRIER_KEY`); None when the request carries none (unsampled, or not ours)."""
    extra = getattr(sampling_params, "extra_args", None)
    return parse_traceparent(extra.get(CARRIER_KEY)) if extra else None


def set_step_ids(scheduler_output: Any, ids: tuple[int, int, bool]) -> None:
    """Put the step span's ``(trace_id, span_id, sampled)`` on the ``SchedulerOutput`` for the
    worker; one that takes no attributes simply carries none (no device timing for that step)."""
    try:
        setattr(scheduler_output, STEP_CARRIER_ATTR, ids)
    except Exception:  # noqa: BLE001 - silent: a step that takes no attributes carries none (documented above)
        pass


def set_step_kv_time(model_runner_output: Any, figures: tuple[int, int, int, int]) -> None:
    """Put the worker's KV-connector time of the step, ``(load_ns, load_first_ns, save_ns,
    save_first_ns)`` (epoch ns), on the step's ``ModelRunnerOutput`` for the engine core; an
    output that takes no attributes carries none."""
    try:
        setattr(model_runner_output, STEP_KV_ATTR, figures)
    except Exception:  # noqa: BLE001 - silent: an output without attributes carries none (documented above)
        pass


def step_kv_time(model_runner_output: Any) -> tuple[int, int, int, int] | None:
    """What :func:`set_step_kv_time` put on a ``ModelRunnerOutput`` (None: no connector time)."""
    return getattr(model_runner_output, STEP_KV_ATTR, None)


def step_ids(scheduler_output: Any) -> tuple[int, int, bool] | None:
    """The step span's ids the engine core put on the ``SchedulerOutput`` (None: no step span)."""
    return getattr(scheduler_output, STEP_CARRIER_ATTR, None)


class StepTokens(NamedTuple):
    """What one step computes, in tokens (see :func:`step_tokens`).

    Attributes:
        prefill: tokens at positions whose next token is already known: prompt tokens, and a
            resumed request's output tokens computed again (``recompute``).
        decode: tokens that produce a new token: each running request's last token plus its
            scheduled draft tokens (rejected drafts included: the step's output tells those).
        recompute: the part of ``prefill`` that requests resumed after a preemption compute again
            (prompt and earlier output tokens of a request that already produced output: vLLM
            dropped their KV cache).
        first: requests whose prompt prefill completes in the step (each emits its first token,
            which belongs to the prefill).
    """

    prefill: int
    decode: int
    recompute: int
    first: int = 0


def request_step_tokens(computed: int, scheduled: int, prompt: int | None, outputs: int, drafts: int) -> StepTokens:
    """One request's :class:`StepTokens`: it computes positions ``[computed, computed + scheduled)``
    of its ``prompt + outputs`` tokens (then ``drafts`` draft tokens). Positions before the last
    known token are prefill, the rest decode; a request with outputs prefills only because a
    preemption dropped its KV cache, so all its prefill is recompute. ``outputs`` 0: all prefill
    (a prompt, possibly in chunks; ``first`` 1 when it reaches ``prompt``). ``prompt`` None
    (unknown): the request's last ``1 + drafts`` scheduled tokens are decode, the rest recompute."""
    if outputs <= 0:
        return StepTokens(scheduled, 0, 0, int(prompt is not None and computed + scheduled >= prompt))
    if prompt is None:
        decode = min(scheduled, 1 + drafts)
    else:
        decode = scheduled - max(0, min(computed + scheduled, prompt + outputs - 1) - computed)
    return StepTokens(scheduled - decode, decode, scheduled - decode)


def step_tokens(scheduler_output: Any, requests: Mapping[str, Any] | None = None) -> StepTokens:
    """The step's :class:`StepTokens` (prefill + decode = ``total_num_scheduled_tokens``), summed
    over :func:`request_step_tokens` of its requests: new requests (``scheduled_new_reqs``; under
    Model Runner V2 also resumed ones, whose ``prefill_token_ids`` hold prompt + outputs) and
    cached ones (``scheduled_cached_reqs``: a chunked prefill continuing, a running request
    decoding, a resumed request recomputing). ``requests``: the scheduler's ``{req_id: Request}``
    (``num_prompt_tokens``) - without it (the worker), a cached request with outputs is decode
    for its last ``1 + drafts`` tokens and ``first`` counts new requests only. O(batch): for
    steps that get a span."""
    scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens or {}
    prefill = recompute = first = 0
    for r in scheduler_output.scheduled_new_reqs:
        tokens = getattr(r, "prefill_token_ids", None)
        prompt = len(r.prompt_token_ids) if r.prompt_token_ids is not None else None
        outputs = len(tokens) - prompt if tokens is not None and prompt is not None else 0
        t = request_step_tokens(
            r.num_computed_tokens, scheduled.get(r.req_id, 0), prompt, outputs, len(spec.get(r.req_id, ()))
        )
        prefill += t.prefill
        recompute += t.recompute
        first += t.first
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed, n_out in zip(
        cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, strict=False
    ):
        req = requests.get(req_id) if requests is not None else None
        prompt = getattr(req, "num_prompt_tokens", None)
        t = request_step_tokens(computed, scheduled.get(req_id, 0), prompt, n_out, len(spec.get(req_id, ())))
        prefill += t.prefill
        recompute += t.recompute
        first += t.first
    return StepTokens(prefill, int(scheduler_output.total_num_scheduled_tokens) - prefill, recompute, first)


def step_phase(prefill_tokens: int, decode_tokens: int) -> str:
    """``prefill`` | ``decode`` | ``mixed`` from :func:`step_tokens` (its first two fields)."""
    return "decode" if prefill_tokens == 0 else "prefill" if decode_tokens == 0 else "mixed"


def step_has_prefill(scheduler_output: Any) -> bool:
    """Whether a step schedules prefill tokens, in O(1) for every step (sampled or not): new
    requests, or more tokens than one per request plus speculative tokens (a chunked prefill, or
    a request resumed after a preemption recomputing its prompt and outputs: :func:`step_tokens`
    counts both as prefill). Speculative decoding makes it O(requests with drafts)."""
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return True
    total = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    per_req = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    spec_tokens = sum(len(v) for v in spec.values()) if spec else 0
    return total > len(per_req) + spec_tokens
