"""The device timeline of engine steps: ring lifecycle, drain thread, timeouts, CUDA-graph captures.

:class:`DeviceTimeline` is the machinery under :class:`llm_otel.telemetry.steps.StepTracker`:
it builds the step-record ring (:mod:`llm_otel.gpu.ring`; CuPy on a background thread, waiting
for CUDA-graph captures in progress), launches a record per step boundary on the engine's stream,
and runs a drain thread that reads finished records, maps them onto the pending steps and hands
each finished step to :meth:`DeviceTimeline._complete` (the step API builds spans from it). A
step whose records never arrive (ring off, overwritten, device error) is handed over without
device times after ``step_timeout_s``.

A pending step is any object with the fields of :class:`llm_otel.telemetry.steps.StepContext`
that this module reads and writes: ``span_id`` (ring key), ``launch_ns`` / ``end_launch_ns``
(host epoch ns of begin / end; ``end_launch_ns`` None while the step runs), ``device_begin_ns``
/ ``device_end_ns`` / ``queue_delay_ns`` (written by the drain), ``recorded``.

Bad input never reaches the engine: an error while recording or draining turns the ring off with
one log line (:meth:`DeviceTimeline._ring_failed`); steps are still completed.

CUDA graphs (:mod:`llm_otel.gpu.capture`): while a graph is being captured no record is launched
and the drain thread does no device work; building the CuPy ring waits for captures in progress.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import threading
import time
from typing import Any

from llm_otel.errors import process_errors
from llm_otel.gpu.capture import capture_gate
from llm_otel.gpu.ring import (
    DEFAULT_CAPACITY,
    KIND_BEGIN,
    KIND_END,
    CupyRing,
    RingBackend,
    RingError,
    fallback_warning,
    make_ring,
)
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")


class DeviceTimeline:
    """Owns the ring buffer and the drain thread; subclasses implement :meth:`_complete`.

    Args:
        errors: a :class:`~llm_otel.telemetry.errors.HookErrors` (``report(hook, exc)``) for
            failures of the drain thread.
        meter: OpenTelemetry meter for ``llm_otel.gpu.ring.overwritten`` (None: not counted).
        backend: ``auto`` | ``cupy`` | ``numpy`` | ``off`` (see :func:`llm_otel.gpu.ring.make_ring`);
            or a ready :class:`~llm_otel.gpu.ring.RingBackend`.
        capacity: ring slots (2 per step).
        drain_period_s: how often the drain thread polls (it sleeps longer while idle).
        step_timeout_s: a step with no device records after this long is completed without them.
        calibrate_every_s: device clock re-calibration period (CuPy backend).
        max_pending: bound on steps in flight (later ones are not tracked on the device).
        start_thread: False for tests that drive :meth:`drain` themselves.
    """

    def __init__(
        self,
        errors: Any,
        meter: Any,
        *,
        backend: Any = "auto",
        capacity: int = DEFAULT_CAPACITY,
        drain_period_s: float = 0.005,
        step_timeout_s: float = 10.0,
        calibrate_every_s: float = 10.0,
        max_pending: int = 65536,
        start_thread: bool = True,
    ) -> None:
        self._errors = errors
        self.ring: RingBackend | None = None
        self._ready = threading.Event()
        if "torch" in sys.modules:  # count CUDA-graph captures from now on (vLLM captures lazily too)
            capture_gate.install()
        if isinstance(backend, str) and backend in ("auto", "cupy") and importlib.util.find_spec("cupy"):
            # importing CuPy and compiling the kernel take up to seconds: never on the engine's
            # step; steps begun before the ring is ready simply carry no device times
            device = _current_cuda_device()
            threading.Thread(
                target=self._build_ring, args=(backend, capacity, device), name="llm-otel-gpu-ring-init", daemon=True
            ).start()
        else:
            self._build_ring(backend, capacity, None)
        self.step_timeout_s = step_timeout_s
        self.calibrate_every_s = calibrate_every_s
        self.drain_period_s = drain_period_s
        self.max_pending = max_pending
        self._pending: dict[int, Any] = {}  # span id -> StepContext awaiting its records
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._overwritten_reported = 0
        self._counter = None
        self._last_calibration = time.monotonic()
        self._last_scan = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_thread = start_thread
        self.counts = {"steps": 0, "completed_with_device": 0, "completed_without_device": 0, "overwritten": 0}
        if meter is not None:
            self._counter = meter.create_counter(
                M.LLM_OTEL_GPU_RING_OVERWRITTEN,
                unit=M.LLM_OTEL_GPU_RING_OVERWRITTEN_UNIT,
                description="Step records the device ring buffer overwrote before the drain read them.",
            )

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
            process_errors().report("gpu.timeline.ring", exc, "GPU step timing off; the engine runs without it")
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the ring is built (or failed); True when done. For tests and tools."""
        return self._ready.wait(timeout)

    @property
    def backend(self) -> str:
        """``cupy``, ``numpy`` or ``off`` (ring not running)."""
        return self.ring.name if self.ring is not None else "off"

    # --- one step's records ----------------------------------------------------------------
    def _track(self, ctx: Any, stream: Any) -> None:
        """A step begins: keep it pending (up to ``max_pending``), launch its begin record on
        ``stream`` and make sure the drain thread runs."""
        with self._lock:
            if len(self._pending) < self.max_pending:
                self._pending[ctx.span_id] = ctx
        self.counts["steps"] += 1
        ctx.recorded = self._record(ctx.span_id, KIND_BEGIN, stream)
        self._ensure_thread()

    def _record_end(self, ctx: Any, stream: Any, record: bool) -> None:
        """A step ends: launch its end record (``record=False``: the stream is capturing a CUDA
        graph), or complete it at once when no record of it will ever be drained."""
        ctx.end_launch_ns = time.time_ns()
        if ctx.recorded and record and self._record(ctx.span_id, KIND_END, stream):
            ring = self.ring  # None if closed (or failed) since the record above: nothing to mark
            try:
                if ring is not None:
                    ring.mark_step(stream)
            except Exception as exc:  # noqa: BLE001
                self._ring_failed(exc)
        else:
            ctx.recorded = False
        if not ctx.recorded or self.ring is None or ctx.span_id not in self._pending:
            self._complete(ctx)

    def _complete(self, ctx: Any) -> None:
        """Hand a finished step (device times set, or None) to the step API. Exactly once per
        context is the implementation's job."""
        raise NotImplementedError

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
        finished: list = []
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
                    if (
                        ctx.device_begin_ns is not None
                        and ctx.device_end_ns is not None
                        and ctx.end_launch_ns is not None
                    ):
                        finished.append(self._pending.pop(ctx.span_id))
        now = time.monotonic()
        if now - self._last_scan < 1.0 and self.ring is not None:
            for ctx in finished:
                self._complete(ctx)
            return len(finished)
        self._last_scan = now  # timeouts: a full scan at most once a second
        cutoff = time.time_ns() - int(self.step_timeout_s * 1e9)
        with self._lock:
            # steps that never got their records, or were never ended
            for sid, ctx in list(self._pending.items()):
                ended = ctx.end_launch_ns is not None
                drained = ctx.device_begin_ns is not None and ctx.device_end_ns is not None
                if ctx.launch_ns < cutoff or (ended and (drained or self.ring is None)):
                    finished.append(self._pending.pop(sid))
        for ctx in finished:
            self._complete(ctx)
        return len(finished)

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
        logger.warning(
            "llm-otel: GPU step timing turned off after a %s ring error (%s: %s); "
            "the engine continues, step spans no longer carry device times",
            ring.name,
            type(exc).__name__,
            exc,
        )
        try:
            ring.close()
        except Exception:  # noqa: BLE001 - silent: cleanup after the failure reported above
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
                self._errors.report("gpu.drain", exc)
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
    except Exception:  # noqa: BLE001 - silent: feature probe: no CUDA device
        pass
    return None
