"""Engine steps: the step API engine adapters call - ``llm.engine.step`` spans and the steps'
device timing.

**Step spans** (:class:`EngineSteps`). The layer that schedules a batch (vLLM's engine core,
LightLLM's router) owns the step span: it asks :meth:`EngineSteps.ready` (the
``LLM_OTEL_STEP_SPANS_PER_S`` budget) before doing any work for a span, passes plain values to
:meth:`EngineSteps.start` (links to the sampled request spans of the batch, batch size, prefill /
decode / recompute token counts, preemptions, the step's start) and ends it with
:meth:`EngineSteps.finish` (end time, CPU time, and what only the step's output tells: emitted
decode tokens, speculative-decoding drafts accepted and rejected). Nothing else ever ends a step
span; with pipelined engines (vLLM async scheduling) it ends in a later engine step, once the
batch's output is processed.

**Device timing** (:class:`StepTracker`). The layer that runs the model (vLLM's worker) brackets
the model execution of one batch::

    ctx = telemetry.steps.begin(request_ids, parent=step_span_context, phase="decode", stream=cuda_stream)
    ...launch the model...
    telemetry.steps.end(ctx)

``begin`` pushes an NVTX range (payload: the step span id) and writes a ``begin`` record into the
ring buffer on ``stream``; ``end`` writes the ``end`` record and pops the range. Neither waits for
the device. The device timeline (:mod:`llm_otel.gpu.timeline`: ring, drain thread, timeouts,
CUDA-graph captures) reads finished records; the tracker then emits the step's device timing as
a child span ``llm.engine.step.device`` of the step span (device start -> device end), whether
the step span lives in this process (vLLM with one GPU) or in another (vLLM's engine core while
the model runs in a worker process). Without a ``parent`` (or with an unsampled one) no span is
emitted; the device time is still counted.

Each request id of the batch accumulates the step's device duration; :meth:`StepTracker.request_device_time`
hands it to the request span at finish (``Telemetry.finish`` does this when both live in one
process). A step whose records never arrive (ring off, overwritten, device error) is completed
without device times after ``step_timeout_s``.

Bad input never reaches the engine: no GPU / no CuPy -> host-clock ring; an error while recording
or draining -> the ring turns itself off with one log line, steps are still completed.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags, Tracer
from opentelemetry.util.types import AttributeValue

from llm_otel.config import Settings
from llm_otel.errors import HookErrors
from llm_otel.gpu.nvtx import NvtxRanges
from llm_otel.gpu.ring import DEFAULT_CAPACITY
from llm_otel.gpu.timeline import DeviceTimeline
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S

PHASES = ("prefill", "decode", "mixed")


class StepTelemetry(Protocol):
    """What :class:`EngineSteps` and :class:`StepTracker` read of the
    :class:`~llm_otel.telemetry.Telemetry` they are given (``meter`` too when it has one)."""

    @property
    def tracer(self) -> Tracer: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def errors(self) -> HookErrors: ...


class StepSpanBudget:
    """Token bucket for step spans: ``rate`` per second, burst of ``max(1, rate)`` (one second's
    worth). ``rate`` 0 allows none, ``inf`` every step. Called on the engine loop only (one
    thread); :meth:`ready` is a float comparison when spans are allowed."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.capacity = max(1.0, self.rate) if self.rate > 0.0 else 0.0
        self.tokens = self.capacity
        self.clock = clock
        self._last = clock()

    def ready(self) -> bool:
        """Whether a step span may start now (does not take it)."""
        if self.tokens >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = now
        return self.tokens >= 1.0

    def take(self) -> None:
        if self.rate != float("inf"):
            self.tokens -= 1.0
            if self.tokens < 1.0:
                self._last = self.clock()


class EngineSteps:
    """``llm.engine.step`` spans of one engine loop (vLLM engine core, LightLLM router).

    The step span is the root of its own trace (batching is fan-in) and **links** to the request
    spans it served; it is started only for a batch with at least one sampled request, and at
    most ``LLM_OTEL_STEP_SPANS_PER_S`` times a second (:attr:`budget`, a :class:`StepSpanBudget`):
    an engine steps every few milliseconds, and a span for every step would cost more than the
    requests' own trees. Called on the engine loop only (one thread).

    Args:
        telemetry: the :class:`~llm_otel.telemetry.Telemetry` (tracer, settings).
    """

    def __init__(self, telemetry: StepTelemetry) -> None:
        self.telemetry = telemetry
        self.budget = StepSpanBudget(telemetry.settings.step_spans_per_s)

    def ready(self) -> bool:
        """Whether a step span may start now; ask before collecting the batch's links."""
        return self.budget.ready()

    def start(
        self,
        requests: Sequence[SpanContext],
        *,
        start_ns: int,
        batch_size: int,
        prefill_tokens: int | None = None,
        decode_tokens: int | None = None,
        preempted: int | None = None,
        recompute_tokens: int | None = None,
    ) -> Span | None:
        """Start the step span (takes one token of the budget) with a link to each request span;
        None when ``requests`` is empty (no sampled request in the batch: no span).

        Args:
            requests: the SpanContext of each sampled request span of the batch (the links).
            start_ns: the step's start, epoch ns.
            batch_size: requests scheduled in the step.
            prefill_tokens / decode_tokens: prompt / output tokens the step computes (None: the
                engine does not tell; the attribute is absent).
            preempted: requests the scheduler preempted in this step (None: unknown).
            recompute_tokens: the part of ``prefill_tokens`` that requests resumed after a
                preemption compute again (None or 0: the attribute is absent).
        """
        if not requests:
            return None
        self.budget.take()
        attrs = {A.LLM_ENGINE_STEP_BATCH_SIZE: batch_size}
        if prefill_tokens is not None:
            attrs[A.LLM_ENGINE_STEP_PREFILL_TOKENS] = prefill_tokens
        if decode_tokens is not None:
            attrs[A.LLM_ENGINE_STEP_DECODE_TOKENS] = decode_tokens
        if preempted is not None:
            attrs[A.LLM_ENGINE_STEP_PREEMPTED] = preempted
        if recompute_tokens:
            attrs[A.LLM_ENGINE_STEP_RECOMPUTE_TOKENS] = recompute_tokens
        return self.telemetry.tracer.start_span(
            S.LLM_ENGINE_STEP,
            kind=SpanKind.INTERNAL,
            links=[Link(sc) for sc in requests],
            attributes=attrs,
            start_time=start_ns,
        )

    @staticmethod
    def finish(
        span: Span,
        *,
        end_ns: int | None = None,
        cpu_time_s: float | None = None,
        decode_tokens: int | None = None,
        draft_tokens: int | None = None,
        accepted_tokens: int | None = None,
    ) -> None:
        """End the step span at ``end_ns`` (epoch ns; default now).

        Args:
            cpu_time_s: the engine loop's CPU time for the step (seconds, ``time.thread_time_ns``
                delta; None: absent).
            decode_tokens: the step's emitted decode tokens, known from its output (replaces the
                scheduled count :meth:`start` set; None: keep it).
            draft_tokens / accepted_tokens: speculative-decoding draft tokens the step verified /
                accepted (None: no drafts in the step; rejected = draft - accepted).
        """
        if cpu_time_s is not None:
            span.set_attribute(A.LLM_ENGINE_STEP_CPU_TIME, cpu_time_s)
        if decode_tokens is not None:
            span.set_attribute(A.LLM_ENGINE_STEP_DECODE_TOKENS, decode_tokens)
        if draft_tokens is not None and accepted_tokens is not None:
            span.set_attribute(A.LLM_ENGINE_STEP_SPEC_DECODE_DRAFT_TOKENS, draft_tokens)
            span.set_attribute(A.LLM_ENGINE_STEP_SPEC_DECODE_ACCEPTED_TOKENS, accepted_tokens)
            span.set_attribute(A.LLM_ENGINE_STEP_SPEC_DECODE_REJECTED_TOKENS, draft_tokens - accepted_tokens)
        span.end(end_time=end_ns)

    @staticmethod
    def ids(span: Span) -> tuple[int, int, bool]:
        """``(trace_id, span_id, sampled)`` of a step span: what travels to the process that runs
        the model (there: :func:`step_parent`)."""
        sc = span.get_span_context()
        return sc.trace_id, sc.span_id, bool(sc.trace_flags.sampled)


@dataclasses.dataclass(eq=False)
class StepContext:
    """One engine step as the device sees it.

    Attributes:
        span_id / trace_id: the step span's ids (uint64 / uint128); ``span_id`` keys the ring
            records and is the NVTX payload. A step begun without a step span gets a local key
            (trace_id 0).
        request_ids: the batch (engine request ids, e.g. vLLM ``input_batch.req_ids``).
        phase: ``prefill`` | ``decode`` | ``mixed``.
        parent: the step span's SpanContext; the device child span hangs under it.
        launch_ns / end_launch_ns: host epoch ns when ``begin`` / ``end`` were called.
        device_begin_ns / device_end_ns: epoch ns when the begin / end records executed (None until drained).
        queue_delay_ns: begin record's execution minus its launch (device timeline only).
    """

    span_id: int
    trace_id: int
    request_ids: tuple[str, ...]
    phase: str
    launch_ns: int
    parent: SpanContext | None = None
    end_launch_ns: int | None = None
    device_begin_ns: int | None = None
    device_end_ns: int | None = None
    queue_delay_ns: int | None = None
    completed: bool = False
    thread: int = 0
    recorded: bool = False  # the begin record was written (the ring was running)

    @property
    def device_duration_ns(self) -> int | None:
        if self.device_begin_ns is None or self.device_end_ns is None:
            return None
        return max(0, self.device_end_ns - self.device_begin_ns)


class StepTracker(DeviceTimeline):
    """Begins/ends steps around model executions, NVTX ranges, the device child spans and the
    per-request device time; the ring and drain thread are :class:`~llm_otel.gpu.timeline.DeviceTimeline`'s.

    Args:
        telemetry: the :class:`~llm_otel.telemetry.Telemetry` (tracer, meter, error counter).
        backend: ``auto`` | ``cupy`` | ``numpy`` | ``off`` (see :func:`llm_otel.gpu.ring.make_ring`);
            or a ready :class:`~llm_otel.gpu.ring.RingBackend`.
        capacity: ring slots (2 per step).
        nvtx: NVTX ranges on/off, or an :class:`NvtxRanges` instance.
        drain_period_s: how often the drain thread polls (it sleeps longer while idle).
        step_timeout_s: a step with no device records after this long is completed without them.
        calibrate_every_s: device clock re-calibration period (CuPy backend).
        max_pending / max_requests: bounds on steps in flight and on per-request device-time sums
            (the oldest sum is dropped first).
        start_thread: False for tests that drive :meth:`drain` themselves.
    """

    def __init__(
        self,
        telemetry: StepTelemetry,
        *,
        backend: Any = "auto",
        capacity: int = DEFAULT_CAPACITY,
        nvtx: Any = True,
        drain_period_s: float = 0.005,
        step_timeout_s: float = 10.0,
        calibrate_every_s: float = 10.0,
        max_pending: int = 65536,
        max_requests: int = 1 << 16,
        start_thread: bool = True,
    ) -> None:
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.nvtx = nvtx if isinstance(nvtx, NvtxRanges) else NvtxRanges(enabled=bool(nvtx))
        self.max_requests = max_requests
        self._requests: dict[str, list[int]] = {}  # request id -> [device ns, steps], insertion-ordered
        self._local_ids = itertools.count(1)  # ring keys of steps begun without a step span
        super().__init__(
            telemetry.errors,
            getattr(telemetry, "meter", None),
            backend=backend,
            capacity=capacity,
            drain_period_s=drain_period_s,
            step_timeout_s=step_timeout_s,
            calibrate_every_s=calibrate_every_s,
            max_pending=max_pending,
            start_thread=start_thread,
        )

    # --- the adapter-facing API -----------------------------------------------------------
    def begin(
        self,
        request_ids: Iterable[str],
        *,
        parent: SpanContext | None = None,
        phase: str = "mixed",
        stream: Any = None,
        request_spans: dict[str, tuple[int, int]] | None = None,
    ) -> StepContext | None:
        """Start one step, before the model's kernels are launched. Never raises, never blocks.

        Args:
            request_ids: the batch's engine request ids.
            parent: the step span's SpanContext (:func:`step_parent` for ids received from
                another process, or the local span's context): the device child span's parent.
                None: no span, device time per request only.
            phase: ``prefill`` | ``decode`` | ``mixed`` (NVTX category).
            stream: the engine's CUDA stream handle (``torch.cuda.current_stream().cuda_stream``);
                None = CuPy's current stream. Ignored by the host-clock ring.
            request_spans: ``{request_id: (trace_id, span_id)}`` of requests whose NVTX process
                range should start now (first step of a request); ranges end in :meth:`end_requests`.

        Returns the :class:`StepContext` to pass to :meth:`end`, or None if nothing could be started
        (bad input - ``request_ids`` not an iterable of ids, ``parent`` not a SpanContext - is
        counted and logged as one line).
        """
        try:
            request_ids, problem = _check_begin(request_ids, parent)
            if problem:
                self.telemetry.errors.bad_input("gpu.step.begin", problem)
                return None
            now = time.time_ns()
            span_id, trace_id = (parent.span_id, parent.trace_id) if parent is not None else (next(self._local_ids), 0)
            ctx = StepContext(
                span_id=span_id,
                trace_id=trace_id,
                request_ids=request_ids,
                phase=phase if phase in PHASES else "mixed",
                launch_ns=now,
                parent=parent,
                thread=threading.get_ident(),
            )
            if request_spans:
                for rid, (tid, sid) in request_spans.items():
                    self.nvtx.start_request(rid, tid, sid)
            self.nvtx.begin_step(ctx.span_id, ctx.phase)
            self._track(ctx, stream)
            return ctx
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.begin", exc)
            return None

    def end(self, ctx: StepContext | None, *, stream: Any = None, record: bool = True) -> None:
        """End the step after the model's kernels were launched (they may still run). Never blocks.

        The device child span is emitted once the device records are drained (never when the
        ring is off). ``record=False``: launch no end record (the caller's stream is capturing a
        CUDA graph); the step then completes without device times.
        """
        if ctx is None:
            return
        if not isinstance(ctx, StepContext):
            self.telemetry.errors.bad_input(
                "gpu.step.end", f"ctx must be what begin() returned, got {type(ctx).__name__}"
            )
            return
        try:
            if threading.get_ident() == ctx.thread:
                self.nvtx.end_step(ctx.span_id)
            self._record_end(ctx, stream, record)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.end", exc)

    def end_requests(self, request_ids: Iterable[str]) -> None:
        """Requests that left the engine: end their NVTX process ranges and drop their device-time
        sums (call it after the request's ``Telemetry.finish`` when both run in one process;
        where nobody finishes requests - a worker process - this is what keeps the sums bounded)."""
        for rid in request_ids:
            self.nvtx.end_request(rid)
            if self._requests:
                with self._lock:
                    self._requests.pop(rid, None)

    def request_device_time(self, request_id: str) -> tuple[float, int] | None:
        """Pop ``(device seconds, steps)`` accumulated for ``request_id`` (None if none).

        Drains first, so steps that already ran on the device are counted; if the drain thread
        is busy, waits for it at most 2 ms (a drain pass takes tens of microseconds).
        """
        self.drain(timeout=0.002)
        with self._lock:
            acc = self._requests.pop(request_id, None)
        if acc is None:
            return None
        return acc[0] / 1e9, acc[1]

    # --- completion (called by the device timeline) ----------------------------------------
    def _complete(self, ctx: StepContext) -> None:
        """Accumulate per-request device time and emit the device child span of a sampled step
        span. Exactly once per context."""
        with self._lock:
            if ctx.completed:
                return
            ctx.completed = True
            self._pending.pop(ctx.span_id, None)
            duration = ctx.device_duration_ns
            if duration is not None:
                requests = self._requests
                for rid in ctx.request_ids:
                    acc = requests.get(rid)
                    if acc is None:
                        if len(requests) >= self.max_requests:
                            del requests[next(iter(requests))]  # the oldest request
                        acc = requests[rid] = [0, 0]
                    acc[0] += duration
                    acc[1] += 1
        try:
            key = "completed_with_device" if duration is not None else "completed_without_device"
            self.counts[key] += 1
            if ctx.parent is not None and duration is not None and ctx.parent.trace_flags.sampled:
                attrs = self.device_attributes(ctx)
                attrs[A.LLM_ENGINE_STEP_BATCH_SIZE] = len(ctx.request_ids)
                parent = trace.set_span_in_context(NonRecordingSpan(ctx.parent))
                child = self.tracer.start_span(
                    S.LLM_ENGINE_STEP_DEVICE,
                    context=parent,
                    kind=SpanKind.INTERNAL,
                    attributes=attrs,
                    start_time=ctx.device_begin_ns,
                )
                child.end(end_time=ctx.device_end_ns)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.complete", exc)

    def device_attributes(self, ctx: StepContext) -> dict[str, AttributeValue]:
        """The ``llm.engine.step.device.*`` attributes of a completed step ({} without device times)."""
        duration = ctx.device_duration_ns
        begin, end = ctx.device_begin_ns, ctx.device_end_ns
        if duration is None or begin is None or end is None:  # all three or none
            return {}
        ring = self.ring
        attrs: dict[str, AttributeValue] = {
            A.LLM_ENGINE_STEP_DEVICE_START_NS: int(begin),
            A.LLM_ENGINE_STEP_DEVICE_END_NS: int(end),
            A.LLM_ENGINE_STEP_DEVICE_DURATION: duration / 1e9,
            A.LLM_ENGINE_STEP_DEVICE_QUEUE_DELAY: (ctx.queue_delay_ns or 0) / 1e9,
        }
        if ring is not None:
            attrs[A.LLM_ENGINE_STEP_DEVICE_CLOCK] = ring.clock
            attrs[A.LLM_ENGINE_STEP_DEVICE_CLOCK_ERROR] = ring.clock_error_ns / 1e9
        return attrs


def step_parent(trace_id: int, span_id: int, sampled: bool = True) -> SpanContext:
    """The SpanContext of a step span received from another process (for ``begin(parent=...)``)."""
    return SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    )


def _check_begin(request_ids: Any, parent: Any) -> tuple[tuple[Any, ...], str | None]:
    """``(request ids as a tuple, None)``, or ``((), what is wrong)`` for :meth:`StepTracker.begin`."""
    if request_ids is None or isinstance(request_ids, (str, bytes)):
        return (), f"request_ids must be an iterable of request ids, got {type(request_ids).__name__}"
    try:
        ids = tuple(request_ids)
    except TypeError:
        return (), f"request_ids must be an iterable of request ids, got {type(request_ids).__name__}"
    if parent is not None and not isinstance(parent, SpanContext):
        return (), f"parent must be a SpanContext, got {type(parent).__name__}"
    return ids, None
