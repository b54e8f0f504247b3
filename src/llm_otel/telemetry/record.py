"""Per-request record: the only state the hot path touches.

An engine adapter creates one :class:`RequestRecord` when a request arrives, appends to it as
the engine emits outputs (a few list appends per step - no spans, no dicts of strings, no I/O),
and hands it to :meth:`llm_otel.telemetry.Telemetry.finish` once. The span tree and the metrics
are built from it then.

Clocks: ``arrival_s`` is wall-clock seconds (``time.time()``, vLLM ``EngineCoreRequest.arrival_time``);
every ``*_mono`` value is the engine's ``time.monotonic()`` in seconds (vLLM's EngineCore stamps,
``EngineCoreOutputs.timestamp`` and ``EngineCoreEvent.timestamp``). ``mono_offset_ns`` maps the
latter to epoch nanoseconds once: ``epoch_ns = round(mono_s * 1e9) + mono_offset_ns``. On Linux
``CLOCK_MONOTONIC`` is system-wide, so engine processes on the same host share it; an engine core
on another host does not, which :meth:`RequestRecord.settle_clock` corrects (telemetry/clock.py).
"""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span

if TYPE_CHECKING:
    from llm_otel.config.tiers import Tier
    from llm_otel.signals.kv import KVSpec
    from llm_otel.telemetry.clock import EngineClock


def mono_offset_ns() -> int:
    """Nanoseconds to add to a ``time.monotonic()`` reading to get epoch nanoseconds (this host, now)."""
    return time.time_ns() - time.monotonic_ns()


class ChoiceGroup:
    """The ``n`` choices of one request (vLLM ``n > 1``: one child request, and one record, per
    choice). Per-request metrics (input tokens, the request count and duration) are recorded once,
    by the choice that finishes last; per-choice ones (output tokens, TTFT, TPOT, ITL) by each."""

    __slots__ = ("n", "left")

    def __init__(self, n: int) -> None:
        self.n = n
        self.left = n

    def finish_one(self) -> bool:
        """Count one finished choice; True for the last one."""
        self.left -= 1
        return self.left == 0


class RequestRecord:
    """Everything known about one request (one choice of it when n>1).

    Hot-path methods: :meth:`on_tokens`, :meth:`on_logprobs`, :meth:`on_event`. All others run
    once per request.
    """

    __slots__ = (
        "request_id",
        "operation",
        "provider",
        "model",
        "response_model",
        "span",
        "recording",
        "arrival_s",
        "mono_offset_ns",
        "queued_mono",
        "scheduled_mono",
        "preempted_mono",
        "step_times",
        "step_token_counts",
        "num_output_tokens",
        "head_token_ids",
        "head_cap",
        "input_tokens",
        "cached_tokens",
        "kv_transfer_tokens",
        "finish_reason",
        "error_type",
        "error_message",
        "request_attributes",
        "logprob_rows",
        "logprob_cap",
        "finished",
        "timing_source",
        "injected_logprobs",
        "vocab_size",
        "output_state",
        "metric_attributes",
        "signal_state",
        "handed_s",
        "handed_mono",
        "engine_clock",
        "choice_group",
        "pooling",
        "pooled_mono",
    )

    def __init__(
        self,
        request_id: str,
        *,
        operation: str,
        provider: str,
        model: str,
        arrival_s: float,
        input_tokens: int,
        span: Span | None = None,
        request_attributes: dict[str, Any] | None = None,
        head_cap: int = 16,
        logprob_cap: int = 0,
        offset_ns: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.operation = operation
        self.provider = provider
        self.model = model
        self.response_model = model
        self.span = span
        self.recording = bool(span is not None and span.is_recording())
        self.arrival_s = arrival_s
        self.mono_offset_ns = mono_offset_ns() if offset_ns is None else offset_ns
        self.queued_mono: float | None = None
        self.scheduled_mono: float | None = None
        self.preempted_mono: list[float] = []
        self.step_times = array("d")  # engine monotonic s of each step that produced tokens
        self.step_token_counts = array("l")  # tokens produced in that step
        self.num_output_tokens = 0
        self.head_token_ids: list[int] = []
        self.head_cap = head_cap
        self.input_tokens = input_tokens
        self.cached_tokens: int | None = None
        # prompt tokens whose KV came over a KV connector (prefill/decode disaggregation), or None
        self.kv_transfer_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error_type: str | None = None
        self.error_message: str | None = None
        self.request_attributes = request_attributes or {}
        # (token_ids, logprobs) per decode step: (tokens, k+1) arrays, column 0 the sampled token (on_logprobs)
        self.logprob_rows: list[tuple[Any, Any]] = []
        self.logprob_cap = logprob_cap
        self.finished = False
        self.timing_source = "engine_steps"
        self.injected_logprobs = False  # the instrumentation asked the engine for log-probs
        self.vocab_size: int | None = None  # for the entropy estimate from top-k log-probs
        self.output_state: Any = None  # engine object holding the completion text (content capture only)
        self.metric_attributes: dict[str, Any] = {}  # bounded request-class labels (llm_otel.signals)
        self.signal_state: tuple[Tier | None, KVSpec | None] | None = None  # (tier, KV spec) set by Signals.admit
        # the frontend handed the request to the engine core: wall s and the frontend's monotonic s
        self.handed_s: float | None = None
        self.handed_mono: float | None = None
        self.engine_clock: EngineClock | None = None  # telemetry.clock.EngineClock of the engine core serving it
        self.choice_group: ChoiceGroup | None = None  # the request's choices when n > 1
        # a pooling request (embeddings, classify, score): no output tokens; its one pooled output
        # came at pooled_mono (engine monotonic s), the end of its prefill
        self.pooling = False
        self.pooled_mono: float | None = None

    # --- hot path ---------------------------------------------------------------------------
    def on_tokens(self, token_ids: list[int], engine_mono: float) -> int:
        """Append the ``len(token_ids)`` tokens the engine emitted in one step at ``engine_mono`` (s);
        returns that count (adapters add it to the step's total)."""
        n = len(token_ids)
        if n:
            self.step_times.append(engine_mono)
            self.step_token_counts.append(n)
            done = self.num_output_tokens  # tokens before this step: the head's length while it fills
            self.num_output_tokens = done + n
            if done < self.head_cap:
                self.head_token_ids.extend(token_ids[: self.head_cap - done])
        return n

    def on_event(self, kind: str, engine_mono: float) -> None:
        """Record a scheduler event: ``"queued"``, ``"scheduled"`` or ``"preempted"`` at ``engine_mono`` (s)."""
        if kind == "queued":
            if self.queued_mono is None:
                self.queued_mono = engine_mono
        elif kind == "scheduled":
            if self.scheduled_mono is None:
                self.scheduled_mono = engine_mono
        elif kind == "preempted":
            if len(self.preempted_mono) < 64:
                self.preempted_mono.append(engine_mono)
        self.timing_source = "engine_events"

    def on_logprobs(self, token_ids: Any, logprobs: Any) -> None:
        """Keep one step's log-probs: ``token_ids``/``logprobs`` are ``(tokens, k+1)`` arrays whose
        column 0 is the sampled token (vLLM ``LogprobsLists`` layout) and columns 1.. the top-k."""
        if len(self.logprob_rows) < self.logprob_cap:
            self.logprob_rows.append((token_ids, logprobs))

    def annotate(self, attributes: dict[str, Any]) -> None:
        """Set ``attributes`` on the live request span, for a recording request only: facts the
        engine reports while the request runs (vLLM's per-request speculative-decoding figures).
        Once per request, not per step."""
        if self.recording and self.span is not None:
            self.span.set_attributes(attributes)

    def on_handed(self) -> None:
        """The frontend hands the request to the engine core now (stamps both of its clocks)."""
        self.handed_s = time.time()
        self.handed_mono = time.monotonic()

    # --- shipped to an exporter process --------------------------------------------------------
    # the fields :class:`llm_otel.telemetry.spans.SpanBuilder` reads to build ``llm.prompt`` and
    # ``llm.token_stream``, in :meth:`span_fields`' order
    SPAN_FIELDS = (
        "arrival_s",
        "mono_offset_ns",
        "queued_mono",
        "scheduled_mono",
        "preempted_mono",
        "step_times",
        "step_token_counts",
        "num_output_tokens",
        "head_token_ids",
        "input_tokens",
        "cached_tokens",
        "finish_reason",
        "error_type",
        "error_message",
        "timing_source",
        "handed_s",
        "pooled_mono",
    )

    def span_fields(self, token_ids: bool) -> tuple[Any, ...]:
        """The raw data ``llm.prompt`` / ``llm.token_stream`` are built from, as plain values that
        pickle cheaply (:data:`SPAN_FIELDS` order): the step arrays as bytes (one copy, no per-token
        objects), the head token ids only when ``token_ids`` (content capture). Called once, at finish."""
        return (
            self.arrival_s,
            self.mono_offset_ns,
            self.queued_mono,
            self.scheduled_mono,
            tuple(self.preempted_mono),
            self.step_times.tobytes(),
            self.step_token_counts.tobytes(),
            self.num_output_tokens,
            tuple(self.head_token_ids) if token_ids else (),
            self.input_tokens,
            self.cached_tokens,
            self.finish_reason,
            self.error_type,
            self.error_message,
            self.timing_source,
            self.handed_s,
            self.pooled_mono,
        )

    @classmethod
    def from_span_fields(cls, fields: tuple[Any, ...]) -> RequestRecord:
        """A record with only :data:`SPAN_FIELDS` set (from :meth:`span_fields`, in the exporter
        process): enough for :meth:`llm_otel.telemetry.spans.SpanBuilder.children`. Step arrays
        are read back with this host's ``array`` item sizes (the exporter process runs on the
        serving process's host, same interpreter)."""
        rec = cls.__new__(cls)
        for name, value in zip(cls.SPAN_FIELDS, fields, strict=False):
            setattr(rec, name, value)
        times, counts = array("d"), array("l")
        times.frombytes(rec.step_times)
        counts.frombytes(rec.step_token_counts)
        rec.step_times, rec.step_token_counts = times, counts
        rec.preempted_mono = list(rec.preempted_mono)
        rec.head_token_ids = list(rec.head_token_ids)
        return rec

    # --- derived, at finish -----------------------------------------------------------------
    def settle_clock(self) -> None:
        """Put the engine's stamps on the frontend's clock when they come from another clock
        domain (:mod:`llm_otel.telemetry.clock`); called once, before spans and metrics are built."""
        clock = self.engine_clock
        if clock is not None and not clock.same_domain:
            self.mono_offset_ns -= round(clock.offset_s() * 1e9)
            self.timing_source = "engine_clock_mapped"

    def epoch_ns(self, mono_s: float) -> int:
        """Engine monotonic seconds -> epoch nanoseconds."""
        return round(mono_s * 1e9) + self.mono_offset_ns

    @property
    def arrival_ns(self) -> int:
        return round(self.arrival_s * 1e9)

    def time_to_first_token_s(self) -> float | None:
        """Seconds from arrival (wall) to the engine's first-token stamp, or None without tokens."""
        if not self.step_times:
            return None
        return (self.epoch_ns(self.step_times[0]) - self.arrival_ns) / 1e9

    def time_per_output_token_s(self) -> float | None:
        """Mean decode seconds per token after the first: (last - first) / (tokens - 1)."""
        if self.num_output_tokens < 2:
            return None
        return (self.step_times[-1] - self.step_times[0]) / (self.num_output_tokens - 1)

    def queue_time_s(self) -> float | None:
        if self.queued_mono is None or self.scheduled_mono is None:
            return None
        return max(0.0, self.scheduled_mono - self.queued_mono)
