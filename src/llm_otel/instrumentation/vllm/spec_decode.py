"""Per-request speculative-decoding figures (issue 28, case C24): drafted and accepted tokens,
acceptance rate, verify steps and the histogram of accepted draft lengths of one request, on its
request span.

vLLM 0.32 counts them itself, per engine ``Request``, in ``Scheduler.update_from_output``
(``vllm/v1/core/sched/scheduler.py``): for each verify step ``RequestSpecDecodeMetrics.observe(
num_draft_tokens, num_accepted)`` (``vllm/v1/metrics/stats.py``; drafts net of grammar-invalidated
ones, accepted = emitted tokens - 1), the same rule its ``vllm:spec_decode_num_*`` counters use.
It does so only for requests whose ``Request.spec_decode_metrics`` is set, which
``Scheduler.add_request`` does when the operator turned on
``--per-request-spec-decode-metrics`` (``observability_config.per_request_spec_decode_metrics``),
and it hands the object to the frontend on the request's final ``EngineCoreOutput.spec_decode_metrics``;
the ``OutputProcessor`` then puts it in the response (``CompletionOutput.spec_decode_metrics``,
the OpenAI server's ``metrics.speculative_decoding``).

llm-otel uses that path for its own sampled requests without changing any response:

* engine core (:meth:`SpecDecodeAdapter.scheduler_add_request`): when speculative decoding is on
  and the operator left per-request metrics off, a request carrying llm-otel's trace carrier
  (sampled: ``SamplingParams.extra_args``) gets a fresh ``RequestSpecDecodeMetrics`` from vLLM's
  own class, which vLLM's scheduler then fills and frees with the request;
* frontend (:func:`take_figures`, called by the adapter before vLLM processes a step's outputs):
  the final output's ``spec_decode_metrics`` is read into the request span and, when the operator
  did not ask for it, removed from the output before the ``OutputProcessor`` sees it, so the
  response is what it is without llm-otel. When the operator asked for it, vLLM's object is read
  and left in place.

Nothing is kept per request on our side: the engine core's object lives and dies with vLLM's
``Request``; the frontend keeps at most one dict entry per live sampled request (the adapter's
:class:`~llm_otel.instrumentation.vllm.requests.EngineState`, freed on finish and abort).
"""

from __future__ import annotations

import logging
from typing import Any

from llm_otel.errors import guard
from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import Telemetry

logger = logging.getLogger("llm_otel")


def figures(metrics: Any) -> dict[str, Any]:
    """Request-span attributes from a vLLM ``RequestSpecDecodeMetrics`` (``histogram``: verify
    steps indexed by accepted drafts ``j``, length ``num_spec_tokens + 1``; ``num_draft_tokens``):
    ``llm.request.spec_decode.{draft_tokens, accepted_tokens, acceptance_rate, steps,
    accepted_histogram}`` - the figures vLLM's ``to_dict`` puts in the response as
    ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``draft_acceptance_rate``,
    ``num_spec_steps`` and ``acceptance_histogram``. Raises on an object without those fields."""
    histogram = [int(c) for c in metrics.histogram]
    drafted = int(metrics.num_draft_tokens)
    accepted = sum(j * c for j, c in enumerate(histogram))
    return {
        A.LLM_REQUEST_SPEC_DECODE_DRAFT_TOKENS: drafted,
        A.LLM_REQUEST_SPEC_DECODE_ACCEPTED_TOKENS: accepted,
        A.LLM_REQUEST_SPEC_DECODE_ACCEPTANCE_RATE: accepted / drafted if drafted else 0.0,
        A.LLM_REQUEST_SPEC_DECODE_STEPS: sum(histogram),
        A.LLM_REQUEST_SPEC_DECODE_ACCEPTED_HISTOGRAM: histogram,
    }


def engine_spec_config(vllm_config: Any) -> tuple[int, bool]:
    """``(num_speculative_tokens, operator_enabled)`` of an engine's ``VllmConfig``:
    ``speculative_config.num_speculative_tokens`` (0 without speculative decoding) and whether
    ``observability_config.per_request_spec_decode_metrics`` is not ``"none"`` (vLLM then puts
    the figures in every response itself)."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    level = getattr(getattr(vllm_config, "observability_config", None), "per_request_spec_decode_metrics", "none")
    return (int(k) if isinstance(k, int) and k > 0 else 0), (level not in (None, "none"))


def take_figures(outputs: list, live: dict, keep_in_response: bool) -> None:
    """Frontend, before vLLM's ``OutputProcessor.process_outputs``: for each ``EngineCoreOutput``
    in ``outputs`` with ``spec_decode_metrics`` set (a request's final output), set
    :func:`figures` on the request span of the live record in ``live`` {request id: record} and
    drop the entry; unless ``keep_in_response`` (the operator enabled vLLM's per-request metrics),
    set the output's ``spec_decode_metrics`` to None so no response carries what only llm-otel
    asked for. O(outputs) per step, only while a sampled speculative request is live."""
    for out in outputs:
        metrics = out.spec_decode_metrics
        if metrics is None:
            continue
        rec = live.pop(out.request_id, None)
        if not keep_in_response:
            out.spec_decode_metrics = None
        if rec is not None:
            rec.annotate(figures(metrics))


class SpecDecodeAdapter:
    """Engine-core wrapper factory: ``Scheduler.add_request`` (see the module docstring)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._metrics_class: Any = None  # vllm.v1.metrics.stats.RequestSpecDecodeMetrics, imported on first use

    def scheduler_add_request(self, hook: str):
        """``Scheduler.add_request(request)``: after vLLM's own, a sampled new request of a
        speculative engine whose operator left per-request metrics off gets a
        ``RequestSpecDecodeMetrics.new(scheduler.num_spec_tokens)`` on ``Request.spec_decode_metrics``.
        Fields read: ``Scheduler.spec_decode_metrics_level``, ``.num_spec_tokens``, ``.requests``;
        ``Request.request_id``, ``.sampling_params.extra_args``, ``.spec_decode_metrics``."""

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                k = getattr(instance, "num_spec_tokens", 0)
                if k and getattr(instance, "spec_decode_metrics_level", None) == "none":
                    request = args[0] if args else kwargs["request"]
                    extra = getattr(request.sampling_params, "extra_args", None) if request.sampling_params else None
                    if (
                        extra
                        and CARRIER_KEY in extra
                        and request.spec_decode_metrics is None
                        and instance.requests.get(request.request_id) is request  # a new request, not a streamed update
                    ):
                        cls = self._metrics_class
                        if cls is None:
                            from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

                            cls = self._metrics_class = RequestSpecDecodeMetrics
                        request.spec_decode_metrics = cls.new(int(k))
            return result

        return wrapper
