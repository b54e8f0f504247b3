"""Builds a request's span tree from its :class:`RequestRecord` once the request has finished.

The request span itself is started live at arrival (so anything created during the request can
be its child); ``llm.prompt``, ``llm.token_stream`` and ``llm.logit_dist`` are created here with
explicit start/end times taken from the engine's own stamps. Children are clamped into their
parent's interval so no span starts before, or ends after, its parent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from llm_otel.config import Settings
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.telemetry import logits
from llm_otel.telemetry.outlets import SpanTreeOutlet
from llm_otel.telemetry.record import RequestRecord


class _TracerAndSettings(Protocol):
    """What :func:`emit_logit_dist_for` reads of a :class:`~llm_otel.telemetry.Telemetry`."""

    @property
    def tracer(self) -> Tracer: ...

    @property
    def settings(self) -> Settings: ...


def _percentiles(values: Sequence[float]) -> tuple[float, float, float, float]:
    """p50, p90, p99 (linear interpolation, NumPy's default method) and max of a non-empty
    sequence; sorting a few hundred floats in Python beats ``np.percentile``'s fixed overhead."""
    if len(values) > 4096:
        p50, p90, p99 = np.percentile(values, (50, 90, 99))
        return float(p50), float(p90), float(p99), float(np.max(values))
    v = sorted(values)
    last = len(v) - 1

    def q(p: float) -> float:
        pos = p * last
        lo = int(pos)
        hi = min(lo + 1, last)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return q(0.5), q(0.9), q(0.99), v[-1]


class SpanBuilder:
    """Emits ``llm.prompt`` / ``llm.token_stream`` / ``llm.logit_dist`` under a request span.

    With a ``tree_outlet`` (:class:`~llm_otel.telemetry.outlets.SpanTreeOutlet`: the tracer's
    spans go to an exporter process, which builds them), ``llm.prompt`` and ``llm.token_stream``
    are built there from the record's raw arrays by this same class (:meth:`children`); their ids
    and sampling decisions are still made here.
    """

    def __init__(self, tracer: Tracer, settings: Settings, tree_outlet: SpanTreeOutlet | None = None) -> None:
        self.tracer = tracer
        self.settings = settings
        # ship_children(rec, end_ns, settings) -> bool, or None: the children are built here
        self._ship = tree_outlet.ship_children if tree_outlet is not None else None

    def emit(self, rec: RequestRecord, end_ns: int) -> None:
        """Finish ``rec.span`` at ``end_ns`` (epoch ns) after creating its children.

        Only for a recording span; attributes and status of the request span are set here too.
        """
        end_ns = max(end_ns, rec.arrival_ns)
        ship = self._ship
        if ship is not None and ship(rec, end_ns, self.settings):
            if rec.logprob_rows and rec.step_times:  # llm.logit_dist (a few % of requests) stays here
                start_ns = rec.arrival_ns
                first_ns = min(max(rec.epoch_ns(rec.step_times[0]), start_ns), end_ns)
                last_ns = min(max(rec.epoch_ns(rec.step_times[-1]), start_ns), end_ns)
                self._logit_dist(rec, trace.set_span_in_context(cast(Span, rec.span)), first_ns, last_ns)
        else:
            ctx = trace.set_span_in_context(cast(Span, rec.span))  # a recording request's span
            first, last = self.children(rec, ctx, end_ns)
            if first is not None and last is not None and rec.logprob_rows:  # both or neither
                self._logit_dist(rec, ctx, first, last)
        self._finish_request_span(rec, end_ns)

    def children(self, rec: RequestRecord, ctx: Context | None, end_ns: int) -> tuple[int | None, int | None]:
        """Create ``llm.prompt`` and (when a token came) ``llm.token_stream`` under ``ctx`` (the
        request span's Context) with this builder's tracer; ``end_ns`` >= arrival (epoch ns).
        Returns the first and last token's epoch ns, clamped into the request (None without tokens).
        Runs in the serving process, or in the exporter process on a record rebuilt from
        :meth:`RequestRecord.span_fields` (``ctx`` None there: the tracer knows the parent)."""
        start_ns = rec.arrival_ns
        clamp: Callable[[int], int] = lambda t: min(max(t, start_ns), end_ns)  # noqa: E731

        first_ns = clamp(rec.epoch_ns(rec.step_times[0])) if rec.step_times else None
        last_ns = clamp(rec.epoch_ns(rec.step_times[-1])) if rec.step_times else None
        error = rec.error_type

        # llm.prompt: arrival -> first token (a pooling request: its pooled output; else -> end)
        if first_ns is None and rec.pooled_mono is not None:
            first_out_ns: int | None = clamp(rec.epoch_ns(rec.pooled_mono))
        else:
            first_out_ns = first_ns
        prompt_end = first_out_ns if first_out_ns is not None else end_ns
        attrs: dict[str, AttributeValue] = {
            A.GEN_AI_USAGE_INPUT_TOKENS: rec.input_tokens,
            A.LLM_REQUEST_TIMING_SOURCE: rec.timing_source,
        }
        if rec.cached_tokens is not None:
            attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = rec.cached_tokens
        # each preemption goes on the span of the phase it happened in: before the first token on
        # llm.prompt, after it on llm.token_stream (each span counts only its own)
        preempt_in_prompt: list[int] = []
        preempt_in_decode: list[int] = []
        for t in rec.preempted_mono:
            ts = clamp(rec.epoch_ns(t))
            (preempt_in_prompt if first_ns is None or ts <= first_ns else preempt_in_decode).append(ts)
        if preempt_in_prompt:
            attrs[A.LLM_REQUEST_PREEMPTIONS] = len(preempt_in_prompt)
        if rec.handed_s is not None:  # frontend processing on the frontend's clock; then the engine's input wait
            attrs[A.LLM_REQUEST_FRONTEND_DURATION] = max(0.0, rec.handed_s - rec.arrival_s)
            if rec.queued_mono is not None:
                attrs[A.LLM_REQUEST_ENGINE_INPUT_WAIT_DURATION] = max(
                    0.0, (rec.epoch_ns(rec.queued_mono) - round(rec.handed_s * 1e9)) / 1e9
                )
        elif rec.queued_mono is not None:  # an adapter that cannot stamp the hand-over
            attrs[A.LLM_REQUEST_FRONTEND_DURATION] = max(0.0, (rec.epoch_ns(rec.queued_mono) - start_ns) / 1e9)
        queue = rec.queue_time_s()
        if queue is not None:
            attrs[A.LLM_REQUEST_QUEUE_DURATION] = queue
        if rec.scheduled_mono is not None and first_out_ns is not None:
            attrs[A.LLM_REQUEST_PREFILL_DURATION] = max(0.0, (first_out_ns - rec.epoch_ns(rec.scheduled_mono)) / 1e9)
        if error is not None and first_ns is None:
            attrs[A.ERROR_TYPE] = error
        prompt = self.tracer.start_span(
            S.LLM_PROMPT, context=ctx, kind=SpanKind.INTERNAL, start_time=start_ns, attributes=attrs
        )
        if rec.queued_mono is not None:
            prompt.add_event(S.EVENT_LLM_REQUEST_QUEUED, timestamp=clamp(rec.epoch_ns(rec.queued_mono)))
        if rec.scheduled_mono is not None:
            prompt.add_event(S.EVENT_LLM_REQUEST_SCHEDULED, timestamp=clamp(rec.epoch_ns(rec.scheduled_mono)))
        for ts in preempt_in_prompt:
            prompt.add_event(S.EVENT_LLM_REQUEST_PREEMPTED, timestamp=ts)
        if error is not None and first_ns is None:
            prompt.set_status(Status(StatusCode.ERROR, rec.error_message or error))
        prompt.end(end_time=prompt_end)

        if first_ns is not None and last_ns is not None:  # both or neither (from rec.step_times)
            self._token_stream(rec, ctx, first_ns, last_ns, preempt_in_decode)
        return first_ns, last_ns

    def _token_stream(
        self, rec: RequestRecord, ctx: Context | None, first_ns: int, last_ns: int, preempts: list[int]
    ) -> None:
        st = self.settings
        times, counts = rec.step_times, rec.step_token_counts  # plain floats/ints: no NumPy per request
        ttft = (first_ns - rec.arrival_ns) / 1e9
        attrs: dict[str, AttributeValue] = {
            A.GEN_AI_USAGE_OUTPUT_TOKENS: rec.num_output_tokens,
            A.LLM_TIME_TO_FIRST_TOKEN: ttft,
            A.LLM_REQUEST_DECODE_DURATION: (last_ns - first_ns) / 1e9,
        }
        if rec.finish_reason:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [rec.finish_reason]
        tpot = rec.time_per_output_token_s()
        if tpot is not None:
            attrs[A.LLM_TIME_PER_OUTPUT_TOKEN] = tpot
        itl = [times[i] - times[i - 1] for i in range(1, len(times))]
        threshold: float | None = None
        if itl:
            p50, p90, p99, mx = _percentiles(itl)
            attrs.update(
                {
                    A.LLM_INTER_TOKEN_LATENCY_P50: p50,
                    A.LLM_INTER_TOKEN_LATENCY_P90: p90,
                    A.LLM_INTER_TOKEN_LATENCY_P99: p99,
                    A.LLM_INTER_TOKEN_LATENCY_MAX: mx,
                }
            )
            if p50 > 0:
                threshold = st.stall_factor * p50
                attrs[A.LLM_TOKEN_STALL_THRESHOLD] = threshold
        if preempts:
            attrs[A.LLM_REQUEST_PREEMPTIONS] = len(preempts)
        if rec.error_type is not None:
            attrs[A.ERROR_TYPE] = rec.error_type
        span = self.tracer.start_span(
            S.LLM_TOKEN_STREAM, context=ctx, kind=SpanKind.INTERNAL, start_time=first_ns, attributes=attrs
        )
        # token events: the first N tokens, each stamped with its step's time; tokens that came
        # in the same step (speculative decoding) have latency 0
        token_times = itertools.islice(
            itertools.chain.from_iterable(map(itertools.repeat, times, counts)), st.token_events
        )  # each token's step time, first N tokens
        # token ids decode back to the completion with the model's tokenizer: content
        add_token_events(
            span,
            token_times,
            (rec.arrival_ns - rec.mono_offset_ns) / 1e9,  # arrival, engine clock
            rec.head_token_ids,
            with_ids=st.capture_content,
            per_second=1.0,
            stamp=lambda t: min(max(rec.epoch_ns(t), first_ns), last_ns),
        )
        dropped = 0
        # stall events: steps whose inter-token latency exceeds k x median
        if threshold is not None:
            stalls = [s for s, gap in enumerate(itl) if gap > threshold]
            if stalls:
                cum = list(itertools.accumulate(counts))
                for s in stalls[: st.max_stall_events]:
                    span.add_event(
                        S.EVENT_LLM_TOKEN_STALL,
                        {
                            A.LLM_TOKEN_INDEX: int(cum[s]),  # first token of step s+1
                            A.LLM_TOKEN_LATENCY: float(itl[s]),
                            A.LLM_TOKEN_STALL_THRESHOLD: float(threshold),
                        },
                        timestamp=min(max(rec.epoch_ns(times[s + 1]), first_ns), last_ns),
                    )
                dropped += max(0, len(stalls) - st.max_stall_events)
        for ts in preempts:
            span.add_event(S.EVENT_LLM_REQUEST_PREEMPTED, timestamp=ts)
        span.set_attribute(A.LLM_TOKEN_EVENTS_DROPPED, dropped)
        if rec.error_type is not None:
            span.set_status(Status(StatusCode.ERROR, rec.error_message or rec.error_type))
        span.end(end_time=last_ns)

    def _logit_dist(self, rec: RequestRecord, ctx: Context | None, first_ns: int, last_ns: int) -> None:
        width = np.asarray(rec.logprob_rows[0][0]).shape[-1]
        ids = np.concatenate([np.asarray(i).reshape(-1, width) for i, _ in rec.logprob_rows])
        lps = np.concatenate([np.asarray(lp, dtype=np.float64).reshape(-1, width) for _, lp in rec.logprob_rows])
        if width < 2:
            return
        top_ids, top_lp = ids[:, 1:], lps[:, 1:]
        entropy, margin, nonfinite = logits.topk_logprob_stats(top_lp, rec.vocab_size)
        # one step per output token, stamped with its step's time
        token_times = np.repeat(
            np.frombuffer(rec.step_times, dtype=np.float64), np.asarray(rec.step_token_counts, dtype=np.int64)
        )[: len(lps)]
        times_ns = [
            min(max(rec.epoch_ns(float(t)), first_ns), last_ns) for t in token_times[: self.settings.logit_events]
        ]
        emit_logit_dist(
            self.tracer,
            self.settings,
            ctx,
            source="engine_logprobs",
            start_ns=first_ns,
            end_ns=last_ns,
            times_ns=times_ns,
            top_ids=top_ids,
            top_logprobs=top_lp,
            sampled_logprobs=lps[:, 0],
            entropy=entropy,
            margin=margin,
            nonfinite=nonfinite,
        )

    def _finish_request_span(self, rec: RequestRecord, end_ns: int) -> None:
        span = cast(Span, rec.span)  # emit() runs for a recording request's span only
        attrs: dict[str, AttributeValue] = {
            A.GEN_AI_USAGE_INPUT_TOKENS: rec.input_tokens,
            A.GEN_AI_RESPONSE_MODEL: rec.response_model,
            A.LLM_REQUEST_TIMING_SOURCE: rec.timing_source,
        }
        if not rec.pooling:  # a pooling request has no output tokens
            attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = rec.num_output_tokens
        if rec.finish_reason:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [rec.finish_reason]
        if rec.cached_tokens is not None:
            attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = rec.cached_tokens
        if rec.kv_transfer_tokens:
            attrs[A.LLM_USAGE_KV_TRANSFER_INPUT_TOKENS] = rec.kv_transfer_tokens
        ttft = rec.time_to_first_token_s()
        if ttft is not None:
            attrs[A.LLM_TIME_TO_FIRST_TOKEN] = ttft
        if rec.error_type is not None:
            attrs[A.ERROR_TYPE] = rec.error_type
            span.set_status(Status(StatusCode.ERROR, rec.error_message or rec.error_type))
        span.set_attributes(attrs)
        span.end(end_time=end_ns)


def add_token_events(
    span: Span,
    token_times: Iterable[float],
    start: float,
    token_ids: Sequence[int],
    *,
    with_ids: bool,
    per_second: float,
    stamp: Callable[[float], int],
) -> None:
    """One ``llm.token`` event per time in ``token_times`` (an iterable already cut to the events
    wanted), with its index and its latency since the previous token (the first: since ``start``).

    ``token_times`` / ``start`` are in one clock whose unit is ``1 / per_second`` s (request spans:
    engine monotonic s, ``per_second=1.0``; stage spans: epoch ns, ``1e9``); ``stamp(t)`` gives
    the event's epoch ns. ``token_ids[i]`` goes on event ``i`` when ``with_ids`` (content capture
    only: ids decode back to the text) and there is one.
    """
    prev = start
    for i, t in enumerate(token_times):
        ev: dict[str, AttributeValue] = {A.LLM_TOKEN_INDEX: i, A.LLM_TOKEN_LATENCY: max(0, t - prev) / per_second}
        if with_ids and i < len(token_ids):
            ev[A.LLM_TOKEN_ID] = int(token_ids[i])
        span.add_event(S.EVENT_LLM_TOKEN, ev, timestamp=stamp(t))
        prev = t


def emit_logit_dist(
    tracer: Tracer,
    settings: Settings,
    parent: Context | None,
    *,
    source: str,
    start_ns: int,
    end_ns: int,
    times_ns: list[int],
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    sampled_logprobs: np.ndarray | None,
    entropy: np.ndarray,
    margin: np.ndarray,
    nonfinite: np.ndarray,
) -> None:
    """One ``llm.logit_dist`` span from per-step arrays (``(steps, k)`` and ``(steps,)``, nats).

    ``parent``: the request span's Context (local or remote). ``times_ns``: epoch ns of the first
    ``len(times_ns)`` steps, which get ``llm.logit.step`` events (capped by ``logit_events``).
    ``source``: ``engine_logprobs`` (frontend, top-k returned by the engine) or
    ``full_vocab_logits`` (worker).
    """
    steps = len(entropy)
    finite = ~nonfinite
    attrs: dict[str, AttributeValue] = {
        A.LLM_LOGIT_SOURCE: source,
        A.LLM_LOGIT_TOP_K: int(top_logprobs.shape[1]),
        A.LLM_LOGIT_STEPS: int(steps),
        A.LLM_LOGIT_NONFINITE_STEPS: int(nonfinite.sum()),
        A.LLM_TOKEN_EVENTS_DROPPED: max(0, steps - settings.logit_events),
    }
    if finite.any():
        attrs[A.LLM_LOGIT_ENTROPY_MEAN] = float(entropy[finite].mean())
        attrs[A.LLM_LOGIT_ENTROPY_MAX] = float(entropy[finite].max())
        m = margin[finite]
        m = m[np.isfinite(m)]
        if m.size:
            attrs[A.LLM_LOGIT_MARGIN_MIN] = float(m.min())
    if sampled_logprobs is not None:
        ppl = logits.perplexity(sampled_logprobs)
        if not math.isnan(ppl):
            attrs[A.LLM_LOGIT_PERPLEXITY] = ppl
    span = tracer.start_span(
        S.LLM_LOGIT_DIST, context=parent, kind=SpanKind.INTERNAL, start_time=start_ns, attributes=attrs
    )
    for i in range(min(steps, settings.logit_events, len(times_ns))):
        row = top_logprobs[i]
        order = np.argsort(-np.where(np.isnan(row), -np.inf, row), kind="stable")
        ev: dict[str, AttributeValue] = {
            A.LLM_TOKEN_INDEX: i,
            A.LLM_LOGIT_TOP_LOGPROBS: [float(v) for v in row[order]],
            A.LLM_LOGIT_ENTROPY: float(entropy[i]),
            A.LLM_LOGIT_MARGIN: float(margin[i]),
            A.LLM_LOGIT_NONFINITE: bool(nonfinite[i]),
        }
        if settings.capture_content:  # the top token ids are the completion (and its alternatives)
            ev[A.LLM_LOGIT_TOP_TOKEN_IDS] = [int(v) for v in top_ids[i][order]]
        if sampled_logprobs is not None:
            ev[A.LLM_LOGIT_SAMPLED_LOGPROB] = float(sampled_logprobs[i])
        span.add_event(S.EVENT_LLM_LOGIT_STEP, ev, timestamp=times_ns[i])
    if nonfinite.any():
        span.set_status(Status(StatusCode.ERROR, f"{int(nonfinite.sum())} decode step(s) with non-finite logits"))
    span.end(end_time=end_ns)


def emit_logit_dist_for(telemetry: _TracerAndSettings, parent: Context | None, **arrays: Any) -> None:
    """:func:`emit_logit_dist` on ``telemetry``'s tracer and settings: what an engine adapter
    calls (adapters never hold the tracer). ``arrays``: :func:`emit_logit_dist`'s keywords."""
    emit_logit_dist(telemetry.tracer, telemetry.settings, parent, **arrays)
