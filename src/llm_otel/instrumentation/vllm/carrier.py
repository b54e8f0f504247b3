"""vLLM's trace carrier and what a step's ``SchedulerOutput`` says about its batch: the one place
the adapter's three processes (frontend, engine core, worker) read them.

Carrier: the frontend writes the request span's W3C context into the engine-bound
``SamplingParams.extra_args`` (vLLM copies it to every process that holds the request: the
scheduler's ``Request.sampling_params``, ``NewRequestData.sampling_params`` in the step's
``SchedulerOutput``, the worker's ``CachedRequestState.sampling_params`` and MRv2's
``Sampler.add_request``); the engine core writes the step span's ids onto the ``SchedulerOutput``
it hands to the worker (:data:`STEP_CARRIER_ATTR`).

Step phase (vLLM 0.32 ``vllm/v1/core/sched/output.py``): ``SchedulerOutput.num_scheduled_tokens``
{req_id: tokens}, ``total_num_scheduled_tokens``, ``scheduled_new_reqs`` (first step of a
request: all its scheduled tokens are prompt tokens), ``scheduled_cached_reqs.req_ids`` /
``.num_output_tokens`` (0 = the prompt is still being prefilled in chunks),
``scheduled_spec_decode_tokens`` {req_id: draft token ids}.
"""

from __future__ import annotations

from typing import Any

from llm_otel.propagation import parse_traceparent

CARRIER_KEY = "llm_otel.traceparent"  # key in vLLM SamplingParams.extra_args
CARRIER_STATE_KEY = "llm_otel.tracestate"  # the request span's tracestate (ot=th:, vendors), if any
CARRIER_TOPK_KEY = "llm_otel.logit_top_k"  # present: the worker computes llm.logit_dist (k)
STEP_CARRIER_ATTR = "llm_otel_step"  # on vLLM's SchedulerOutput: (trace_id, span_id, sampled) of the step span


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


def step_ids(scheduler_output: Any) -> tuple[int, int, bool] | None:
    """The step span's ids the engine core put on the ``SchedulerOutput`` (None: no step span)."""
    return getattr(scheduler_output, STEP_CARRIER_ATTR, None)


def step_tokens(scheduler_output: Any) -> tuple[int, int]:
    """``(prefill tokens, decode tokens)`` the step computes: new requests' scheduled tokens plus
    those of cached requests with no output token yet (a chunked prefill continuing); the rest of
    ``total_num_scheduled_tokens`` is decode (speculative tokens included). O(batch): for steps
    that get a span."""
    scheduled = scheduler_output.num_scheduled_tokens
    prefill = sum(scheduled.get(r.req_id, 0) for r in scheduler_output.scheduled_new_reqs)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, n_out in zip(cached.req_ids, cached.num_output_tokens, strict=False):
        if n_out == 0:  # chunked prefill continuing
            prefill += scheduled.get(req_id, 0)
    return prefill, int(scheduler_output.total_num_scheduled_tokens) - prefill


def step_phase(prefill_tokens: int, decode_tokens: int) -> str:
    """``prefill`` | ``decode`` | ``mixed`` from :func:`step_tokens`."""
    return "decode" if prefill_tokens == 0 else "prefill" if decode_tokens == 0 else "mixed"


def step_has_prefill(scheduler_output: Any) -> bool:
    """Whether a step schedules prompt tokens, in O(1) for every step (sampled or not): new
    requests, or more tokens than one per request plus speculative tokens (chunked or resumed
    prefill). Speculative decoding makes it O(requests with drafts)."""
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return True
    total = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
    per_req = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    spec_tokens = sum(len(v) for v in spec.values()) if spec else 0
    return total > len(per_req) + spec_tokens
