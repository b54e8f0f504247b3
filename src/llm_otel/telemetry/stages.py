"""Stage spans: one (sub-)request's passage through one engine process other than the frontend.

Some engines split a request's life over processes that each see only part of it: LightLLM's
router queues and schedules it, its model-infer worker produces the tokens, and the HTTP worker
(which holds the request span, :mod:`llm_otel.telemetry.spans`) sees neither. Each such process
keeps one :class:`StageRecord` per sub-request and hands it to
:meth:`llm_otel.telemetry.Telemetry.end_stage` when the request leaves it; the stage span is built
here then, as a child of the request span whose context crossed the processes (the adapter's
carrier), with explicit start/end times:

* ``llm.router.request`` (:data:`ROUTER`): queued -> released; events ``llm.request.queued`` and
  ``llm.request.scheduled``; queue and frontend durations; the engine's output count.
* ``llm.infer.request`` (:data:`INFER`): admitted -> released; one ``llm.token`` event per token
  (the core's token-event code, :func:`llm_otel.telemetry.spans.add_token_events`), prefill/decode
  durations, TPOT, perplexity of the sampled tokens; ``llm.logit_dist`` when logit rows were kept.

What a stage span carries follows from what its record holds (a queue stamp, token times, logit
rows), not from the stage's name. Clock: epoch nanoseconds (``time.time_ns()``, one host's clock
across the processes) for every ``*_ns`` field; ``frontend_arrival_s`` is wall-clock seconds.
"""

from __future__ import annotations

import itertools
import math
from array import array
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from llm_otel.config import Settings
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.telemetry.bounds import bounded_id
from llm_otel.telemetry.spans import add_token_events, emit_logit_dist

ROUTER = S.LLM_ROUTER_REQUEST  # the scheduler's process: queued -> released
INFER = S.LLM_INFER_REQUEST  # the model-running process: admitted -> released, per-token times
STAGES = (ROUTER, INFER)


class StageRecord:
    """Everything one process stage knows about one sub-request (one choice of a request).

    Filled by the adapter: ``scheduled_ns``, ``input_tokens``, ``output_tokens``,
    ``cached_tokens``, ``finish_reason``, ``aborted`` as it reads them; tokens with
    :meth:`on_token` (hot path: a few appends); logit statistics rows into ``logit_rows``.

    Attributes:
        stage: the span name, one of :data:`STAGES`.
        request_id: the engine's sub-request id (an int; LightLLM ``Req.request_id``).
        choice_index: index of the choice within its request (LightLLM: ``request_id - group_id``).
        group_id: id of the request the choice belongs to (LightLLM ``group_req_id``).
        parent: Context of the choice's request span (from the carrier); the stage span's parent.
        span_context: that request span's SpanContext (step spans that served the request link to it).
        start_ns: epoch ns the request entered this stage (queued, or admitted to the worker).
        queued_ns: epoch ns it was queued (``llm.request.queued`` event), or None.
        scheduled_ns: epoch ns the scheduler admitted it to a batch, or None.
        frontend_arrival_s: wall s the frontend received it (LightLLM ``GroupReqIndexes.time_mark``),
            or None; gives ``llm.request.frontend.duration`` up to ``start_ns``.
        input_tokens / cached_tokens: the engine's prompt length / prefix-cache hits, or None.
        output_tokens: the engine's output count (None: none read); :meth:`on_token` counts up
            from it, so a stage that counts its own tokens starts it at 0.
        token_times: epoch ns of each token (array of int64); ``token_ids``: the first
            ``token_id_cap`` token ids (their count is the number of ``llm.token`` events).
        logprob_sum: sum of the sampled tokens' log-probs (nats).
        resumed: times the request was paused and resumed (preemptions).
        logit_top_k: k of the logit statistics asked for this request (0: none); ``logit_rows``:
            per sampled step ``(time_ns, top_ids (k,), top_logprobs (k,), entropy, margin,
            nonfinite, sampled_logprob)``.
    """

    __slots__ = (
        "stage",
        "request_id",
        "choice_index",
        "group_id",
        "parent",
        "span_context",
        "start_ns",
        "queued_ns",
        "scheduled_ns",
        "frontend_arrival_s",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
        "token_times",
        "token_ids",
        "token_id_cap",
        "logprob_sum",
        "resumed",
        "logit_top_k",
        "logit_rows",
        "finish_reason",
        "aborted",
    )

    def __init__(
        self,
        stage: str,
        request_id: int,
        parent: Context,
        *,
        group_id: int,
        choice_index: int,
        start_ns: int,
        token_id_cap: int,
        queued_ns: int | None = None,
        frontend_arrival_s: Any = None,
        output_tokens: int | None = None,
        logit_top_k: int = 0,
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
        self.stage = stage
        self.request_id = request_id
        self.choice_index = choice_index
        self.group_id = group_id
        self.parent = parent
        self.span_context = trace.get_current_span(parent).get_span_context()
        self.start_ns = start_ns
        self.queued_ns = queued_ns
        self.scheduled_ns: int | None = None
        self.frontend_arrival_s = frontend_arrival_s
        self.input_tokens: int | None = None
        self.output_tokens = output_tokens
        self.cached_tokens: int | None = None
        self.token_times = array("q")
        self.token_ids: list[int] = []
        self.token_id_cap = token_id_cap
        self.logprob_sum = 0.0
        self.resumed = 0
        self.logit_top_k = logit_top_k
        self.logit_rows: list[tuple[Any, ...]] = []  # logit_capture.stage_row rows
        self.finish_reason: str | None = None
        self.aborted = False

    def on_token(self, token_id: Any, logprob: Any, now_ns: int) -> None:
        """One token the engine produced at ``now_ns`` (epoch ns), with its sampled log-prob (nats).

        Raises ValueError/TypeError (and records nothing) when the log-prob, or an id that is kept
        (the first ``token_id_cap``), is not a number.
        """
        logprob = float(logprob)
        ids = self.token_ids
        if len(ids) < self.token_id_cap:
            ids.append(int(token_id))
        self.token_times.append(now_ns)
        self.logprob_sum += logprob
        self.output_tokens = (self.output_tokens or 0) + 1


def emit_stage(tracer: Tracer, settings: Settings, rec: StageRecord, end_ns: int) -> None:
    """The stage span of ``rec`` (ended at ``end_ns`` epoch ns, or at its last token if later) and,
    when it kept logit rows, its ``llm.logit_dist`` span; both children of ``rec.parent``."""
    attrs: dict[str, Any] = {
        A.LLM_REQUEST_ID: bounded_id(str(rec.request_id)),
        A.LLM_REQUEST_CHOICE_INDEX: rec.choice_index,
    }
    if isinstance(rec.input_tokens, int):
        attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = rec.input_tokens
    if isinstance(rec.output_tokens, int):
        attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = rec.output_tokens
    if isinstance(rec.cached_tokens, int):
        attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = rec.cached_tokens
    if rec.resumed:
        attrs[A.LLM_REQUEST_PREEMPTIONS] = rec.resumed
    if isinstance(rec.frontend_arrival_s, (int, float)):
        attrs[A.LLM_REQUEST_FRONTEND_DURATION] = max(0.0, rec.start_ns / 1e9 - rec.frontend_arrival_s)
    if rec.queued_ns is not None and rec.scheduled_ns is not None:
        attrs[A.LLM_REQUEST_QUEUE_DURATION] = (rec.scheduled_ns - rec.queued_ns) / 1e9
    times = rec.token_times
    if times:
        count = len(times)
        attrs[A.LLM_REQUEST_PREFILL_DURATION] = max(0, times[0] - rec.start_ns) / 1e9
        attrs[A.LLM_REQUEST_DECODE_DURATION] = (times[-1] - times[0]) / 1e9
        attrs[A.LLM_LOGIT_PERPLEXITY] = math.exp(min(700.0, -rec.logprob_sum / count))
        if count > 1:
            attrs[A.LLM_TIME_PER_OUTPUT_TOKEN] = (times[-1] - times[0]) / 1e9 / (count - 1)
    if rec.finish_reason:
        attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [rec.finish_reason]
    if rec.aborted:
        attrs[A.ERROR_TYPE] = "aborted"
    span = tracer.start_span(
        rec.stage, context=rec.parent, kind=SpanKind.INTERNAL, attributes=attrs, start_time=rec.start_ns
    )
    if rec.queued_ns is not None:
        span.add_event(S.EVENT_LLM_REQUEST_QUEUED, timestamp=rec.queued_ns)
    if rec.scheduled_ns is not None:
        span.add_event(S.EVENT_LLM_REQUEST_SCHEDULED, timestamp=rec.scheduled_ns)
    # token ids decode back to the text: only with content capture on
    add_token_events(
        span,
        itertools.islice(times, len(rec.token_ids)),
        rec.start_ns,
        rec.token_ids,
        with_ids=settings.capture_content,
        per_second=1e9,
        stamp=int,
    )
    if rec.aborted:
        span.set_status(Status(StatusCode.ERROR, "aborted"))
    span.end(end_time=max(end_ns, times[-1] if times else end_ns))
    if rec.logit_rows:
        _emit_logits(tracer, settings, rec)


def _emit_logits(tracer: Tracer, settings: Settings, rec: StageRecord) -> None:
    """``llm.logit_dist`` from the worker's full-vocabulary logit rows (freed from the record)."""
    rows = rec.logit_rows
    rec.logit_rows = []
    emit_logit_dist(
        tracer,
        settings,
        rec.parent,
        source="full_vocab_logits",
        start_ns=rows[0][0],
        end_ns=rows[-1][0],
        times_ns=[r[0] for r in rows],
        top_ids=np.stack([r[1] for r in rows]),
        top_logprobs=np.stack([r[2] for r in rows]),
        sampled_logprobs=np.asarray([r[6] for r in rows]),
        entropy=np.asarray([r[3] for r in rows]),
        margin=np.asarray([r[4] for r in rows]),
        nonfinite=np.asarray([r[5] for r in rows]),
    )
