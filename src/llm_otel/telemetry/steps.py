"""Engine steps on the device timeline: the ``StepContext`` API engine adapters call around each
model execution.

An adapter (vLLM worker, LightLLM router, ...) brackets the model execution of one batch::

    ctx = telemetry.steps.begin(request_ids, span=step_span, phase="decode", stream=cuda_stream)
    ...launch the model...
    telemetry.steps.end(ctx, span_end_ns=time.time_ns())

``begin`` pushes an NVTX range (payload: the step span id) and writes a ``begin`` record into the
ring buffer on ``stream``; ``end`` writes the ``end`` record and pops the range. Neither waits for
the device. A drain thread (:class:`StepTracker`) reads finished records and *completes* the step:

* ``span`` given (a live ``llm.engine.step`` span in this process): device start/end, duration and
  launch -> execution queueing delay are set on it, and it is ended at ``span_end_ns``. A layer
  that owns the step span but does not run the model (vLLM's engine core) calls
  :meth:`StepTracker.register_span` before and :meth:`StepTracker.release_span` after the step; a
  ``begin(parent=...)`` in the same process then completes that very span;
* ``parent`` given (the step span lives in another process, e.g. vLLM's engine core while the
  model runs in a worker): a child span ``llm.engine.step.device`` from device start to device end;
* neither: the tracker starts its own ``llm.engine.step`` span (``links`` to the request spans).

Each request id of the batch accumulates the step's device duration; :meth:`StepTracker.request_device_time`
hands it to the request span at finish (``Telemetry.finish`` does this when both live in one
process). A step whose records never arrive (ring off, overwritten, device error) is completed
without device times after ``step_timeout_s``.

Bad input never reaches the engine: no GPU / no CuPy -> host-clock ring; an error while recording
or draining -> the ring turns itself off with one log line, spans are still completed.

CUDA graphs (:mod:`llm_otel.gpu.capture`): while a graph is being captured no record is launched
(the step completes without device times) and the drain thread does no device work; building
the CuPy ring waits for captures in progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import sys
import threading
import time
from typing import Any, Iterable, Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags

from llm_otel.gpu.capture import capture_gate
from llm_otel.gpu.nvtx import NvtxRanges
from llm_otel.gpu.ring import KIND_BEGIN, KIND_END, CupyRing, RingBackend, RingError, fallback_warning, make_ring
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.semconv import spans as S

logger = logging.getLogger("llm_otel")

PHASES = ("prefill", "decode", "mixed")


@dataclasses.dataclass(eq=False)
class StepContext:
    """One engine step as the device sees it.

    Attributes:
        span_id / trace_id: the step span's ids (uint64 / uint128); ``span_id`` keys the ring
            records and is the NVTX payload.
        request_ids: the batch (engine request ids, e.g. vLLM ``input_batch.req_ids``).
        phase: ``prefill`` | ``decode`` | ``mixed``.
        launch_ns / end_launch_ns: host epoch ns when ``begin`` / ``end`` were called.
        span_end_ns: epoch ns at which the step span ends (``end``'s argument, default ``end_launch_ns``).
        device_begin_ns / device_end_ns: epoch ns when the begin / end records executed (None until drained).
        queue_delay_ns: begin record's execution minus its launch (device timeline only).
    """

    span_id: int
    trace_id: int
    request_ids: tuple[str, ...]
    phase: str
    launch_ns: int
    span: Span | None = None
    parent: SpanContext | None = None
    end_launch_ns: int | None = None
    span_end_ns: int | None = None
    device_begin_ns: int | None = None
    device_end_ns: int | None = None
    queue_delay_ns: int | None = None
    completed: bool = False
    thread: int = 0
    owner_ends: bool = False  # the span's owner (register_span) gives span_end_ns
    recorded: bool = False  # the begin record was written (the ring was running)

    @property
    def device_duration_ns(self) -> int | None:
        if self.device_begin_ns is None or self.device_end_ns is None:
            return None
        return max(0, self.device_end_ns - self.device_begin_ns)


class StepTracker:
    """Begins/ends steps, owns the ring buffer, NVTX ranges and the drain thread.

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

    def __init__(self, telemetry: Any, *, backend: Any = "auto", capacity: int = 4096, nvtx: Any = True,
                 drain_period_s: float = 0.005, step_timeout_s: float = 10.0, calibrate_every_s: float = 10.0,
                 max_pending: int = 65536, max_requests: int = 1 << 16, start_thread: bool = True) -> None:
        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.nvtx = nvtx if isinstance(nvtx, NvtxRanges) else NvtxRanges(enabled=bool(nvtx))
        self.ring: RingBackend | None = None
        self._ready = threading.Event()
        if "torch" in sys.modules:  # count CUDA-graph captures from now on (vLLM captures lazily too)
            capture_gate.install()
        if isinstance(backend, str) and backend in ("auto", "cupy") and importlib.util.find_spec("cupy"):
            # importing CuPy and compiling the kernel take up to seconds: never on the engine's
            # step; steps begun before the ring is ready simply carry no device times
            device = _current_cuda_device()
            threading.Thread(target=self._build_ring, args=(backend, capacity, device),
                             name="llm-otel-gpu-ring-init", daemon=True).start()
        else:
            self._build_ring(backend, capacity, None)
        self.step_timeout_s = step_timeout_s
        self.calibrate_every_s = calibrate_every_s
        self.drain_period_s = drain_period_s
        self.max_pending = max_pending
        self.max_requests = max_requests
        self._pending: dict[int, StepContext] = {}
        self._local_spans: dict[int, Span] = {}  # register_span: step spans owned by another layer
        self._requests: dict[str, list] = {}  # request id -> [device ns, steps], insertion-ordered
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._overwritten_reported = 0
        self._counter = None
        self._last_calibration = time.monotonic()
        self._last_scan = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_thread = start_thread
        self.counts = {"steps": 0, "completed_with_device": 0, "completed_without_device": 0,
                       "overwritten": 0}
        meter = getattr(telemetry, "meter", None)
        if meter is not None:
            self._counter = meter.create_counter(
                M.LLM_OTEL_GPU_RING_OVERWRITTEN, unit=M.LLM_OTEL_GPU_RING_OVERWRITTEN_UNIT,
                description="Step records the device ring buffer overwrote before the drain read them.")

    def _build_ring(self, backend: Any, capacity: int, device: int | None) -> None:
        try:
            if not isinstance(backend, str):
                self.ring = backend
            elif backend in ("auto", "cupy") and device is not None:
                try:
                    self.ring = _outside_capture(lambda: CupyRing(capacity, device=device))
                except RingError as exc:
                    if backend == "cupy":
                        raise
                    fallback_warning(exc)
                    self.ring = make_ring("numpy", capacity)
            else:
                self.ring = make_ring(backend, capacity)
        except Exception as exc:  # noqa: BLE001 - configuration asked for cupy on a machine without it
            logger.warning("llm-otel: GPU step timing off (%s: %s); the engine runs without it",
                           type(exc).__name__, exc)
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the ring is built (or failed); True when done. For tests and tools."""
        return self._ready.wait(timeout)

    # --- the adapter-facing API -----------------------------------------------------------
    @property
    def backend(self) -> str:
        """``cupy``, ``numpy`` or ``off`` (ring not running)."""
        return self.ring.name if self.ring is not None else "off"

    def begin(self, request_ids: Iterable[str], *, span: Span | None = None, parent: SpanContext | None = None,
              links: Sequence[Link] = (), attributes: dict | None = None, phase: str = "mixed",
              stream: Any = None, request_spans: dict[str, tuple[int, int]] | None = None) -> StepContext | None:
        """Start one step, before the model's kernels are launched. Never raises, never blocks.

        Args:
            request_ids: the batch's engine request ids.
            span: a live step span of this process that the tracker completes and ends.
            parent: the step span's SpanContext when that span lives in another process.
            links / attributes: for the ``llm.engine.step`` span the tracker starts itself when
                neither ``span`` nor ``parent`` is given.
            phase: ``prefill`` | ``decode`` | ``mixed`` (NVTX category).
            stream: the engine's CUDA stream handle (``torch.cuda.current_stream().cuda_stream``);
                None = CuPy's current stream. Ignored by the host-clock ring.
            request_spans: ``{request_id: (trace_id, span_id)}`` of requests whose NVTX process
                range should start now (first step of a request); ranges end in :meth:`end_requests`.

        Returns the :class:`StepContext` to pass to :meth:`end`, or None if nothing could be started
        (bad input - ``request_ids`` not an iterable of ids, ``span`` not a span, ``parent`` not a
        SpanContext - is counted and logged as one line, and starts no span).
        """
        try:
            request_ids, problem = _check_begin(request_ids, span, parent)
            if problem:
                self.telemetry.errors.bad_input("gpu.step.begin", problem)
                return None
            now = time.time_ns()
            if span is None and parent is None:
                span = self.tracer.start_span(S.LLM_ENGINE_STEP, kind=SpanKind.INTERNAL, links=list(links),
                                              attributes=attributes, start_time=now)
            sc = span.get_span_context() if span is not None else parent
            owner_ends = False
            if span is None:
                with self._lock:
                    span = self._local_spans.pop(sc.span_id, None)
                owner_ends = span is not None  # release_span gives the end time
            ctx = StepContext(span_id=sc.span_id, trace_id=sc.trace_id, request_ids=request_ids,
                              phase=phase if phase in PHASES else "mixed", launch_ns=now, span=span,
                              parent=None if span is not None else parent, thread=threading.get_ident(),
                              owner_ends=owner_ends)
            if request_spans:
                for rid, (tid, sid) in request_spans.items():
                    self.nvtx.start_request(rid, tid, sid)
            self.nvtx.begin_step(ctx.span_id, ctx.phase)
            with self._lock:
                if len(self._pending) < self.max_pending:
                    self._pending[ctx.span_id] = ctx
            self.counts["steps"] += 1
            ctx.recorded = self._record(ctx.span_id, KIND_BEGIN, stream)
            self._ensure_thread()
            return ctx
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.begin", exc)
            return None

    def end(self, ctx: StepContext | None, *, span_end_ns: int | None = None, stream: Any = None,
            record: bool = True) -> None:
        """End the step after the model's kernels were launched (they may still run). Never blocks.

        ``span_end_ns``: epoch ns at which the step span ends (default: now). The span is ended
        once the device records are drained (or at once when the ring is off). ``record=False``:
        launch no end record (the caller's stream is capturing a CUDA graph); the step then
        completes without device times.
        """
        if ctx is None:
            return
        if not isinstance(ctx, StepContext):
            self.telemetry.errors.bad_input("gpu.step.end", f"ctx must be what begin() returned, "
                                                            f"got {type(ctx).__name__}")
            return
        try:
            ctx.end_launch_ns = time.time_ns()
            if not ctx.owner_ends:
                ctx.span_end_ns = span_end_ns if span_end_ns is not None else ctx.end_launch_ns
            if threading.get_ident() == ctx.thread:
                self.nvtx.end_step(ctx.span_id)
            if ctx.recorded and record and self._record(ctx.span_id, KIND_END, stream):
                try:
                    self.ring.mark_step(stream)
                except Exception as exc:  # noqa: BLE001
                    self._ring_failed(exc)
            else:
                ctx.recorded = False
            if (not ctx.recorded or self.ring is None or ctx.span_id not in self._pending) \
                    and ctx.span_end_ns is not None:
                self._complete(ctx)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.end", exc)

    def register_span(self, span: Span) -> None:
        """Announce a live step span *before* its model execution, from the layer that owns it
        (vLLM's engine core). If the model then runs in this process (``begin(parent=...)`` with
        this span's context), the tracker completes this span itself - device attributes and
        end - once :meth:`release_span` gave its end time; otherwise nothing changes."""
        if span.is_recording():
            with self._lock:
                if len(self._local_spans) < self.max_pending:
                    self._local_spans[span.get_span_context().span_id] = span

    def release_span(self, span: Span, span_end_ns: int) -> bool:
        """The owner's step is over. True: a step of this process took the span over and will end
        it at ``span_end_ns`` after draining; False: the caller ends the span itself."""
        span_id = span.get_span_context().span_id
        with self._lock:
            self._local_spans.pop(span_id, None)
            ctx = self._pending.get(span_id)
            if ctx is None or ctx.span is not span:
                return False
            ctx.span_end_ns = span_end_ns
            drained = ctx.device_begin_ns is not None and ctx.device_end_ns is not None
            now = ctx.end_launch_ns is not None and (self.ring is None or not ctx.recorded or drained)
        if now:  # otherwise the drain completes it when the records arrive
            self._complete(ctx)
        return True

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

    # --- drain ----------------------------------------------------------------------------
    def drain(self, blocking: bool = True, timeout: float = -1) -> int:
        """Read new ring records and complete the steps they finish; expire stale steps.

        Returns the number of steps completed. ``blocking=False`` returns 0 at once, and
        ``timeout`` (s) after that long, if another thread is draining.
        """
        if not self._drain_lock.acquire(blocking=blocking, timeout=timeout if blocking else -1):
            return 0
        try:
            return self._drain_locked()
        finally:
            self._drain_lock.release()

    def _drain_locked(self) -> int:
        ring = self.ring
        finished: list[StepContext] = []
        if ring is not None:
            try:
                records, lost = self._poll(ring)
            except Exception as exc:  # noqa: BLE001
                self._ring_failed(exc)
                records, lost = (), 0
            if lost > 0:
                self._overwritten_reported += lost
                self.counts["overwritten"] += lost
                if self._counter is not None:
                    self._counter.add(lost, {A.LLM_GPU_RING_BACKEND: ring.name})
            with self._lock:
                for rec in records:
                    ctx = self._pending.get(int(rec["span_id"]))
                    if ctx is None:
                        continue
                    ts = int(rec["timestamp"])
                    if int(rec["kind"]) == KIND_BEGIN:
                        ctx.device_begin_ns = ts
                        ctx.queue_delay_ns = max(0, ts - int(rec["aux"]))
                    else:
                        ctx.device_end_ns = ts
                    if ctx.device_begin_ns is not None and ctx.device_end_ns is not None \
                            and ctx.span_end_ns is not None:
                        finished.append(self._pending.pop(ctx.span_id))
        now = time.monotonic()
        if now - self._last_scan < 1.0 and self.ring is not None:
            for ctx in finished:
                self._complete(ctx)
            return len(finished)
        self._last_scan = now  # timeouts: a full scan at most once a second
        cutoff = time.time_ns() - int(self.step_timeout_s * 1e9)
        with self._lock:
            # steps that never got their records, or were never ended / released
            for sid, ctx in list(self._pending.items()):
                if ctx.launch_ns < cutoff and ctx.span_end_ns is None:
                    # never ended, or the owner never released it: end where we last saw it
                    ctx.span_end_ns = ctx.end_launch_ns if ctx.end_launch_ns is not None else ctx.launch_ns
                if ctx.span_end_ns is not None and (
                        (ctx.device_begin_ns is not None and ctx.device_end_ns is not None)
                        or ctx.launch_ns < cutoff or self.ring is None):
                    finished.append(self._pending.pop(sid))
        for ctx in finished:
            self._complete(ctx)
        return len(finished)

    def _complete(self, ctx: StepContext) -> None:
        """Set device attributes on the step span (or emit the device child span), accumulate
        per-request device time, end the span. Exactly once per context."""
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
            attrs = self.device_attributes(ctx)
            key = "completed_with_device" if duration is not None else "completed_without_device"
            self.counts[key] += 1
            if ctx.span is not None:
                if attrs:
                    ctx.span.set_attributes(attrs)
                ctx.span.end(end_time=ctx.span_end_ns)
            elif ctx.parent is not None and duration is not None and ctx.parent.trace_flags.sampled:
                parent = trace.set_span_in_context(NonRecordingSpan(ctx.parent))
                attrs[A.LLM_ENGINE_STEP_BATCH_SIZE] = len(ctx.request_ids)
                child = self.tracer.start_span(S.LLM_ENGINE_STEP_DEVICE, context=parent, kind=SpanKind.INTERNAL,
                                               attributes=attrs, start_time=ctx.device_begin_ns)
                child.end(end_time=ctx.device_end_ns)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("gpu.step.complete", exc)

    def device_attributes(self, ctx: StepContext) -> dict:
        """The ``llm.engine.step.device.*`` attributes of a completed step ({} without device times)."""
        duration = ctx.device_duration_ns
        if duration is None:
            return {}
        ring = self.ring
        attrs = {
            A.LLM_ENGINE_STEP_DEVICE_START_NS: int(ctx.device_begin_ns),
            A.LLM_ENGINE_STEP_DEVICE_END_NS: int(ctx.device_end_ns),
            A.LLM_ENGINE_STEP_DEVICE_DURATION: duration / 1e9,
            A.LLM_ENGINE_STEP_DEVICE_QUEUE_DELAY: (ctx.queue_delay_ns or 0) / 1e9,
        }
        if ring is not None:
            attrs[A.LLM_ENGINE_STEP_DEVICE_CLOCK] = ring.clock
            attrs[A.LLM_ENGINE_STEP_DEVICE_CLOCK_ERROR] = ring.clock_error_ns / 1e9
        return attrs

    def _poll(self, ring: RingBackend) -> tuple[Any, int]:
        """Calibrate when due and read new records; a device ring only outside CUDA-graph
        captures (records stay in the ring until the next pass)."""
        # a host ring touches no device: no gate, no lock
        gate = capture_gate.device_work() if getattr(ring, "on_device", False) else contextlib.nullcontext(True)
        with gate as allowed:
            if not allowed:
                return (), 0
            if time.monotonic() - self._last_calibration >= self.calibrate_every_s:
                self._last_calibration = time.monotonic()
                ring.calibrate()
            records = ring.poll()
        return records, ring.overwritten - self._overwritten_reported

    # --- plumbing ---------------------------------------------------------------------------
    def _record(self, span_id: int, kind: int, stream: Any) -> bool:
        ring = self.ring
        if ring is None:
            return False
        if capture_gate.active and getattr(ring, "on_device", False):
            return False  # a capture is running somewhere in the process: launch nothing now
        try:
            ring.record(span_id, kind, stream)
            return True
        except Exception as exc:  # noqa: BLE001
            self._ring_failed(exc)
            return False

    def _ring_failed(self, exc: BaseException) -> None:
        ring, self.ring = self.ring, None
        if ring is None:
            return
        logger.warning("llm-otel: GPU step timing turned off after a %s ring error (%s: %s); "
                       "the engine continues, step spans no longer carry device times",
                       ring.name, type(exc).__name__, exc)
        try:
            ring.close()
        except Exception:  # noqa: BLE001
            pass

    def _ensure_thread(self) -> None:
        if self._thread is not None or not self._start_thread:
            return
        self._thread = threading.Thread(target=self._loop, name="llm-otel-gpu-drain", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        idle = 0
        while not self._stop.is_set():
            try:
                n = self.drain()
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report("gpu.drain", exc)
                n = 0
            idle = 0 if n or self._pending else min(idle + 1, 20)
            self._stop.wait(self.drain_period_s * (1 + idle))

    def close(self) -> None:
        """Stop the drain thread, complete what is pending, release the ring. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.drain()
        with self._lock:
            rest = list(self._pending.values())
        for ctx in rest:
            if ctx.span_end_ns is None:
                ctx.span_end_ns = time.time_ns()
            self._complete(ctx)
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()


def _outside_capture(build: Any, wait_s: float = 600.0) -> Any:
    """Run ``build`` (device allocations, module load) under the capture gate, waiting - on our
    own thread - while CUDA graphs are being captured.

    Raises:
        RingError: captures kept going for ``wait_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    while True:
        with capture_gate.device_work() as allowed:
            if allowed:
                return build()
        if time.monotonic() > deadline:
            raise RingError(f"CUDA graphs were being captured for {wait_s:.0f} s; ring not built")
        time.sleep(0.05)


def _current_cuda_device() -> int | None:
    """The engine thread's CUDA device as torch sees it (vLLM sets it per worker), or None when
    torch has not initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
    except Exception:  # noqa: BLE001
        pass
    return None


def step_parent(trace_id: int, span_id: int, sampled: bool = True) -> SpanContext:
    """The SpanContext of a step span received from another process (for ``begin(parent=...)``)."""
    return SpanContext(trace_id, span_id, is_remote=True,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT))


def _check_begin(request_ids: Any, span: Any, parent: Any) -> tuple[tuple, str | None]:
    """``(request ids as a tuple, None)``, or ``((), what is wrong)`` for :meth:`StepTracker.begin`."""
    if request_ids is None or isinstance(request_ids, (str, bytes)):
        return (), f"request_ids must be an iterable of request ids, got {type(request_ids).__name__}"
    try:
        ids = tuple(request_ids)
    except TypeError:
        return (), f"request_ids must be an iterable of request ids, got {type(request_ids).__name__}"
    if span is not None and not callable(getattr(span, "get_span_context", None)):
        return (), f"span must be an OpenTelemetry Span, got {type(span).__name__}"
    if parent is not None and not isinstance(parent, SpanContext):
        return (), f"parent must be a SpanContext, got {type(parent).__name__}"
    return ids, None
