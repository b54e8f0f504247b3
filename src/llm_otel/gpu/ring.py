"""A fixed-capacity ring buffer of engine-step records written in stream order on the device.

Each record is five little-endian uint64 words::

    (step span id, kind, timestamp ns, aux, seq)

``kind`` is :data:`KIND_BEGIN` or :data:`KIND_END`; ``timestamp`` is the device clock
(``%globaltimer``, ns) for the CuPy backend and the host clock (``time.time_ns()``) for the NumPy
backend; ``aux`` is the host epoch ns at which the record was *launched* (so launch -> execution
queueing delay needs nothing else); ``seq`` is the record's global index + 1, written last, so a
reader can tell a complete record from a stale or not-yet-written slot.

Two backends share one API (:class:`RingBackend`):

* :class:`CupyRing` - a one-thread CuPy ``RawKernel`` claims a slot with ``atomicAdd`` on a device
  head counter and writes the record. It is launched on the stream the caller names (the engine's
  current stream, so the record is ordered with the model's kernels). After each step's ``end``
  record a CUDA event is recorded on that stream; :meth:`CupyRing.poll` asks the events (never
  blocking, never synchronising the engine's stream) how far the device has got and copies new
  records on a private stream into pinned host memory. Device time is mapped to epoch ns with an
  offset calibrated against the host clock (:meth:`CupyRing.calibrate`, redone periodically).
* :class:`NumpyRing` - the same records in a host array, timestamps from the host clock. Used
  automatically where there is no GPU or no CuPy, so the whole record -> drain -> span pipeline
  runs (and is tested) on any machine.

Overflow: a slow reader never blocks a writer; the writer overwrites the oldest slot, and the
reader counts the records it lost (``overwritten``).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Protocol

import numpy as np

from llm_otel.config import Settings
from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")

RECORD_WORDS = 5
KIND_BEGIN = 1
KIND_END = 2
DEFAULT_CAPACITY: int = Settings().gpu_ring_capacity  # LLM_OTEL_GPU_RING_CAPACITY's default
RECORD_DTYPE = np.dtype([("span_id", "<u8"), ("kind", "<u8"), ("timestamp", "<u8"), ("aux", "<u8"), ("seq", "<u8")])
_RECORD_FIELDS: tuple[str, ...] = RECORD_DTYPE.names or ()  # structured: always named

KERNEL_NAME = "llm_otel_step_record"
TIMER_KERNEL_NAME = "llm_otel_globaltimer"
# Compiled by CuPy (NVRTC) at first use, and to PTX by nvcc in the test suite.
KERNEL_SOURCE = r"""
extern "C" __global__ void llm_otel_step_record(unsigned long long* ring,
                                                unsigned long long* head,
                                                unsigned long long capacity,
                                                unsigned long long span_id,
                                                unsigned long long kind,
                                                unsigned long long aux) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    unsigned long long index = atomicAdd(head, 1ULL);
    unsigned long long* r = ring + (index % capacity) * 5ULL;
    r[0] = span_id;
    r[1] = kind;
    r[2] = now;
    r[3] = aux;
    __threadfence();      /* the sequence word is written last: a reader never sees half a record */
    r[4] = index + 1ULL;
}

extern "C" __global__ void llm_otel_globaltimer(unsigned long long* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    out[0] = now;
}
"""


class RingError(RuntimeError):
    """The backend cannot be used (no CuPy, no GPU, no driver) or failed at run time.

    ``expected`` is True for the ordinary absence of a GPU stack (CuPy not installed, no CUDA
    device): the automatic choice then falls back quietly. Anything else (kernel compilation,
    a CuPy/torch CUDA mismatch) is worth the one warning :func:`make_ring` gives.
    """

    def __init__(self, message: str, *, expected: bool = False) -> None:
        super().__init__(message)
        self.expected = expected


#: environment variable CuPy reads at each compilation: keep compiled kernels in memory only
CUPY_CACHE_IN_MEMORY = "CUPY_CACHE_IN_MEMORY"


def load_kernels(
    cp: Any, source: str = KERNEL_SOURCE, names: tuple[str, ...] = (KERNEL_NAME, TIMER_KERNEL_NAME)
) -> list[Any]:
    """Compile ``source`` with CuPy (NVRTC) and return its kernels ``names``.

    CuPy writes compiled kernels to its on-disk cache (``CUPY_CACHE_DIR``, default
    ``~/.cupy/kernel_cache``). Where that is not writable - a read-only HOME, a cache owned by
    another user (case C21; cupy/cupy#2296) - the compilation fails with an ``OSError``; then it is
    retried once with ``CUPY_CACHE_IN_MEMORY=1`` (CuPy's own switch, read at each compilation;
    the environment is restored afterwards) and one warning names the directory and the cause.

    Raises:
        RingError: the kernel does not compile even in memory.
    """
    try:
        module = cp.RawModule(code=source)
        return [module.get_function(name) for name in names]  # compiles and caches here
    except OSError as exc:
        cache_dir = os.environ.get("CUPY_CACHE_DIR") or os.path.join("~", ".cupy", "kernel_cache")
        cause = f"{type(exc).__name__}: {exc}"
    previous = os.environ.get(CUPY_CACHE_IN_MEMORY)
    os.environ[CUPY_CACHE_IN_MEMORY] = "1"
    try:
        module = cp.RawModule(code=source)
        kernels = [module.get_function(name) for name in names]
    except Exception as exc:  # noqa: BLE001
        raise RingError(
            f"the ring kernel does not compile: CuPy's kernel cache {cache_dir} is not writable "
            f"({cause}) and compiling in memory failed too ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        if previous is None:
            os.environ.pop(CUPY_CACHE_IN_MEMORY, None)
        else:
            os.environ[CUPY_CACHE_IN_MEMORY] = previous
    logger.warning(
        "llm-otel: CuPy's kernel cache %s is not writable (%s); the GPU step ring compiled its "
        "kernel in memory instead (set CUPY_CACHE_DIR to a writable directory to cache it)",
        cache_dir,
        cause,
    )
    return kernels


class RingBackend(Protocol):
    """What the step tracker needs from a ring (both backends implement it).

    Attributes:
        name: ``"cupy"`` or ``"numpy"``; ``clock``: ``"globaltimer"`` or ``"host"``.
        capacity: number of record slots. ``overwritten``: records lost to overflow so far.
        clock_error_ns: half-width of the last clock calibration window (0 for the host clock).
    """

    name: str
    clock: str
    capacity: int
    clock_error_ns: int

    @property
    def overwritten(self) -> int:
        """Records lost to overflow so far."""
        ...

    def record(self, span_id: int, kind: int, stream: Any = None) -> None:
        """Append one record on ``stream`` (CUDA stream handle, CuPy backend only). Never blocks."""

    def mark_step(self, stream: Any = None) -> None:
        """A step's last record was launched on ``stream``: lets :meth:`poll` see when it ran."""

    def poll(self) -> np.ndarray:
        """New complete records (``RECORD_DTYPE``, timestamps already in epoch ns), oldest first.
        Never blocks on the engine; safe from one reader thread at a time."""

    def calibrate(self) -> None:
        """Re-measure the device -> epoch clock offset (no-op for the host clock)."""

    def close(self) -> None:
        """Release device and host buffers."""


def _u64(value: int) -> int:
    return value & 0xFFFF_FFFF_FFFF_FFFF


class _Reader:
    """Turns a window of slots into complete records; shared by both backends.

    ``read`` is the global index of the next record to consume. ``collect(words, upto)`` takes the
    ring's slot words and the global index just past the last record known to be launched and
    *executed*, skips (and counts) records that were overwritten before they were read, and stops
    at the first slot that is not yet written so it is read on the next pass.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.read = 0
        self.overwritten = 0

    def collect(self, words: np.ndarray, upto: int) -> np.ndarray:
        if upto <= self.read:
            return np.empty(0, RECORD_DTYPE)
        if upto - self.read > self.capacity:
            lost = upto - self.read - self.capacity
            self.overwritten += lost
            self.read += lost
        idx = np.arange(self.read, upto, dtype=np.uint64)
        rows = words[(idx % np.uint64(self.capacity)).astype(np.int64)]
        seq = rows[:, 4]
        expected = idx + np.uint64(1)
        newer = seq > expected  # overwritten while we were reading
        pending = seq < expected  # claimed but not written yet
        stop = int(np.argmax(pending)) if pending.any() else len(rows)
        good = ~newer[:stop]
        self.overwritten += int(newer[:stop].sum())
        self.read += stop
        out = np.empty(int(good.sum()), RECORD_DTYPE)
        sel = rows[:stop][good]
        for i, field in enumerate(_RECORD_FIELDS):
            out[field] = sel[:, i]
        return out


class NumpyRing:
    """Host-memory ring with host-clock timestamps (epoch ns); the same records and reader as
    :class:`CupyRing`. ``record`` may be called from any thread; ``poll`` from one reader."""

    name = "numpy"
    clock = "host"
    clock_error_ns = 0
    on_device = False  # nothing here touches CUDA: no capture gate needed

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"ring capacity must be >= 2, got {capacity}")
        self.capacity = capacity
        self._words = np.zeros((capacity, RECORD_WORDS), dtype=np.uint64)
        self._claim = itertools.count()  # next() is atomic under the GIL: a slot per record
        self._claimed = 0
        self._reader = _Reader(capacity)

    @property
    def overwritten(self) -> int:
        return self._reader.overwritten

    def record(self, span_id: int, kind: int, stream: Any = None) -> None:
        now = time.time_ns()
        index = next(self._claim)
        row = self._words[index % self.capacity]
        row[:4] = (_u64(span_id), kind, now, now)
        row[4] = index + 1  # the sequence word last, as the kernel does
        if index + 1 > self._claimed:
            self._claimed = index + 1

    def mark_step(self, stream: Any = None) -> None:
        pass

    def poll(self) -> np.ndarray:
        return self._reader.collect(self._words, self._claimed)

    def calibrate(self) -> None:
        pass

    def close(self) -> None:
        pass


class CupyRing:
    """Device ring written by a one-thread CuPy ``RawKernel`` on the caller's stream.

    Args:
        capacity: record slots (device memory ``capacity x 40`` bytes, the same in pinned host memory).
        device: CUDA device ordinal (the current one when None).
        max_inflight: CUDA events kept for steps not yet seen complete; when all are in use a step
            is simply not marked (the next marked step covers it, since records are stream-ordered).

    Raises:
        RingError: CuPy is not installed, no CUDA device/driver, or the kernel does not compile.
    """

    name = "cupy"
    clock = "globaltimer"
    on_device = True  # poll/calibrate run under llm_otel.gpu.capture.capture_gate

    def __init__(self, capacity: int = DEFAULT_CAPACITY, device: int | None = None, max_inflight: int = 256) -> None:
        if capacity < 2:
            raise ValueError(f"ring capacity must be >= 2, got {capacity}")
        from llm_otel.gpu.stack import cuda_stack

        stack = cuda_stack()
        if stack.mismatch:  # CuPy would look for the other major's libraries: say which extra fixes it
            raise RingError(stack.advice())
        try:
            import cupy as cp
        except ImportError as exc:  # quiet only where CuPy is simply not installed
            raise RingError(
                f"CuPy is not importable ({type(exc).__name__}: {exc})", expected=stack.cupy_dist is None
            ) from exc
        except Exception as exc:  # noqa: BLE001 - a CUDA library load error
            raise RingError(f"CuPy is not importable ({type(exc).__name__}: {exc})") from exc
        try:
            try:
                devices = cp.cuda.runtime.getDeviceCount()
            except Exception as exc:  # noqa: BLE001 - no driver: a CPU machine with CuPy installed
                raise RingError(
                    f"no CUDA driver ({type(exc).__name__}: {exc})", expected=stack.torch_cuda is None
                ) from exc
            if devices < 1:
                raise RingError("no CUDA device", expected=stack.torch_cuda is None)
            self._cp = cp
            self._device = cp.cuda.Device(device if device is not None else cp.cuda.runtime.getDevice())
            with self._device:
                self.capacity = capacity
                self._ring = cp.zeros((capacity, RECORD_WORDS), dtype=cp.uint64)
                self._head = cp.zeros(1, dtype=cp.uint64)
                self._timer = cp.zeros(1, dtype=cp.uint64)
                self._kernel, self._timer_kernel = load_kernels(cp)
                nbytes = capacity * RECORD_WORDS * 8
                self._pinned_mem = cp.cuda.alloc_pinned_memory(nbytes)
                self._host = np.frombuffer(self._pinned_mem, dtype=np.uint64, count=capacity * RECORD_WORDS).reshape(
                    capacity, RECORD_WORDS
                )
                self._host[:] = 0
                # private streams: never ordered with (or synchronising) the engine's stream
                self._copy_stream = cp.cuda.Stream(non_blocking=True)
                self._calib_stream = cp.cuda.Stream(non_blocking=True)
                self._copy_done = cp.cuda.Event(disable_timing=True)
                self._free_events = [cp.cuda.Event(disable_timing=True) for _ in range(max_inflight)]
                self._streams: dict[int, Any] = {}
                self._inflight: list[tuple[Any, int]] = []  # (event, records launched when recorded)
                self._launched = 0
                self._launch_lock = threading.Lock()
                self._reader = _Reader(capacity)
                self.offset_ns = 0
                self.clock_error_ns = 0
                self.calibrate()
        except RingError:
            raise
        except Exception as exc:  # noqa: BLE001 - CUDA / NVRTC errors of any kind
            raise RingError(f"CUDA ring buffer unavailable ({type(exc).__name__}: {exc})") from exc

    @property
    def overwritten(self) -> int:
        return self._reader.overwritten

    def _stream(self, stream: Any) -> Any:
        if stream is None:
            return self._cp.cuda.get_current_stream()
        if isinstance(stream, int):
            ext = self._streams.get(stream)
            if ext is None:
                ext = self._streams[stream] = self._cp.cuda.ExternalStream(stream, self._device.id)
            return ext
        return stream  # a cupy Stream

    def record(self, span_id: int, kind: int, stream: Any = None) -> None:
        np_u64 = np.uint64
        launch_ns = time.time_ns()
        with self._device, self._stream(stream):
            self._kernel(
                (1,),
                (1,),
                (self._ring, self._head, np_u64(self.capacity), np_u64(_u64(span_id)), np_u64(kind), np_u64(launch_ns)),
            )
        with self._launch_lock:
            self._launched += 1

    def mark_step(self, stream: Any = None) -> None:
        with self._launch_lock:
            if not self._free_events:
                return
            event = self._free_events.pop()
            launched = self._launched
        with self._device:
            event.record(self._stream(stream))
        with self._launch_lock:
            self._inflight.append((event, launched))

    def poll(self) -> np.ndarray:
        cp = self._cp
        upto = None
        with self._launch_lock:
            inflight = list(self._inflight)
        done = []
        for event, launched in inflight:
            if not event.done:  # cudaEventQuery: never blocks
                break
            done.append((event, launched))
            upto = launched
        if done:
            with self._launch_lock:
                del self._inflight[: len(done)]
                self._free_events.extend(e for e, _ in done)
        if upto is None or upto <= self._reader.read:
            return np.empty(0, RECORD_DTYPE)
        start = max(self._reader.read, upto - self.capacity)
        row_bytes = RECORD_WORDS * 8
        with self._device:
            # copy only the slots holding [start, upto), in at most two contiguous pieces
            first, last = start % self.capacity, (upto - 1) % self.capacity
            pieces = [(first, last + 1)] if first <= last else [(first, self.capacity), (0, last + 1)]
            for a, b in pieces:
                cp.cuda.runtime.memcpyAsync(
                    self._host.ctypes.data + a * row_bytes,
                    self._ring.data.ptr + a * row_bytes,
                    (b - a) * row_bytes,
                    cp.cuda.runtime.memcpyDeviceToHost,
                    self._copy_stream.ptr,
                )
            self._copy_done.record(self._copy_stream)
            self._copy_done.synchronize()  # our private copy stream only
        records = self._reader.collect(self._host, upto)
        records["timestamp"] = (records["timestamp"].astype(np.int64) + self.offset_ns).astype(np.uint64)
        return records

    def calibrate(self, tries: int = 5) -> None:
        """Offset = midpoint of the host-clock window around a device ``%globaltimer`` read, minus
        that read; the narrowest of ``tries`` windows wins. Runs on a private stream."""
        best: tuple[int, int] | None = None  # (window ns, offset ns)
        with self._device:
            for _ in range(tries):
                t0 = time.time_ns()
                with self._calib_stream:
                    self._timer_kernel((1,), (1,), (self._timer,))
                    device_ns = int(self._timer.get(stream=self._calib_stream)[0])
                t1 = time.time_ns()
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, (t0 + t1) // 2 - device_ns)
        if best is None:
            raise ValueError(f"calibrate needs tries >= 1, not {tries}")
        self.clock_error_ns = best[0] // 2
        self.offset_ns = best[1]

    def close(self) -> None:
        self._inflight.clear()
        self._ring = self._head = self._timer = None


def make_ring(backend: str = "auto", capacity: int = DEFAULT_CAPACITY) -> RingBackend | None:
    """The ring for ``backend``: ``cupy``, ``numpy``, ``auto`` (CuPy when it and a GPU work, else
    NumPy) or ``off`` (None). ``cupy`` that cannot start raises :class:`RingError`."""
    if backend == "off":
        return None
    if backend == "numpy":
        return NumpyRing(capacity)
    if backend == "cupy":
        return CupyRing(capacity)
    if backend != "auto":
        raise ValueError(f"unknown ring backend {backend!r}")
    try:
        return CupyRing(capacity)
    except RingError as exc:
        fallback_warning(exc)
        return NumpyRing(capacity)


def fallback_warning(exc: RingError) -> None:
    """Log why the automatic choice fell back to the host-clock ring: one debug line where no GPU
    stack is expected, one warning otherwise (a GPU machine that should have had device times)."""
    if exc.expected:
        logger.debug("llm-otel: no CUDA ring buffer (%s); step timing uses the host clock", exc)
    else:
        process_errors().report("gpu.ring.cuda", exc, "no CUDA ring buffer; step timing uses the host clock")
