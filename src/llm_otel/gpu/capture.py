"""CUDA-graph capture safety: llm-otel's own threads never touch the device while a graph is
being captured anywhere in the process, and nothing of ours is launched into a captured graph.

Why: PyTorch captures with ``cudaStreamCaptureModeGlobal`` by default; while any thread captures
in that mode, a *potentially unsafe* CUDA call from any other thread - ``cudaEventQuery``,
``cudaStreamSynchronize``, ``cudaMalloc``, a copy on the legacy stream - invalidates the capture
("operation not permitted when stream is capturing"). vLLM captures graphs at warm-up and, with
some configurations, later on the engine's thread, while our drain thread polls CUDA events and
copies ring records (pytorch/pytorch PR #104555, #148594; vllm RFC #20098; case C23).

:data:`capture_gate` does two things:

* it counts captures in progress - :meth:`CaptureGate.install` wraps
  ``torch.cuda.graphs.CUDAGraph.capture_begin`` / ``capture_end``, through which every
  ``torch.cuda.graph(...)`` capture (vLLM's included) passes - and
* it serialises our device work against capture starts: a background thread does device work
  only inside ``with capture_gate.device_work() as allowed:`` and only when ``allowed``; a
  ``capture_begin`` waits for such a block to finish (tens of microseconds: event queries and one
  copy on a private stream) before the capture starts, and while the count is above zero every
  block is told ``allowed = False`` and skips its work.

The engine's own thread (step records, logit statistics) asks :meth:`CaptureGate.capturing`,
which is also true while the *current* stream is capturing with a capture this gate did not see
(``torch.cuda.is_current_stream_capturing()``). All of it is a few attribute reads when no GPU
is present; nothing here raises into the engine.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")


class CaptureGate:
    """Process-wide count of CUDA-graph captures in progress plus the lock our device work holds.

    Attributes:
        active: captures begun and not yet ended (``capture_begin`` .. ``capture_end``).
        skipped: device-work blocks that were told to skip because a capture was in progress.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.skipped = 0
        self._installed: dict[Any, tuple[Any, Any]] = {}  # graph class -> original methods

    # --- the capture side (engine thread, through the wrapped CUDAGraph methods) --------------
    def capture_started(self) -> None:
        """A capture is about to begin: wait for our device work in flight, then count it."""
        with self._lock:
            self.active += 1

    def capture_ended(self) -> None:
        """A capture ended (or failed to begin)."""
        with self._lock:
            self.active = max(0, self.active - 1)

    # --- our side ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def device_work(self) -> Iterator[bool]:
        """Hold the gate for one block of device work from an llm-otel thread; yields False
        (do nothing on the device) while a capture is in progress. Never blocks the engine for
        longer than the block itself."""
        with self._lock:
            allowed = self.active == 0
            if not allowed:
                self.skipped += 1
            yield allowed

    def capturing(self, cuda: Any = None) -> bool:
        """True while a capture is in progress in this process (counted by the gate) or on the
        calling thread's current stream (``torch.cuda.is_current_stream_capturing()``; ``cuda``
        is ``torch.cuda`` when the caller has it, else it is looked up without importing torch)."""
        if self.active:
            return True
        if cuda is None:
            torch = sys.modules.get("torch")
            cuda = getattr(torch, "cuda", None) if torch is not None else None
            if cuda is None:
                return False
        try:
            return bool(cuda.is_initialized() and cuda.is_current_stream_capturing())
        except Exception:  # noqa: BLE001 - silent: a torch without CUDA
            return False

    # --- hooking torch --------------------------------------------------------------------------
    def install(self, graph_cls: Any = None) -> bool:
        """Wrap ``graph_cls.capture_begin`` / ``capture_end`` (default
        ``torch.cuda.graphs.CUDAGraph``, signature ``capture_begin(self, pool=None,
        capture_error_mode="global")`` / ``capture_end(self)``) so the gate counts captures.
        Idempotent; returns False (one debug line) when the class or methods are missing."""
        try:
            if graph_cls is None:
                from torch.cuda.graphs import CUDAGraph

                graph_cls = CUDAGraph
            if graph_cls in self._installed:
                return True
            begin, end = vars(graph_cls)["capture_begin"], vars(graph_cls)["capture_end"]
        except ImportError as exc:  # no torch (or no torch.cuda) here: nothing can capture a graph
            logger.debug("llm-otel: CUDA-graph capture gate not installed (%s: %s)", type(exc).__name__, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - torch moved the capture methods
            process_errors().report(
                "gpu.capture.install",
                exc,
                "CUDA-graph capture gate not installed; device records may be taken while a graph is captured",
            )
            return False
        gate = self

        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            gate.capture_started()
            try:
                return begin(graph, *args, **kwargs)
            except BaseException:
                gate.capture_ended()
                raise

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(graph, *args, **kwargs)
            finally:
                gate.capture_ended()

        wrappers: tuple[tuple[str, Any, Any], ...] = (
            ("capture_begin", capture_begin, begin),
            ("capture_end", capture_end, end),
        )
        for name, fn, orig in wrappers:
            fn.__name__, fn.__qualname__, fn.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
            fn.__wrapped__ = orig
            setattr(graph_cls, name, fn)
        self._installed[graph_cls] = (begin, end)
        return True

    def uninstall(self) -> None:
        """Put back the original methods of every class :meth:`install` wrapped (tests)."""
        for graph_cls, (begin, end) in self._installed.items():
            graph_cls.capture_begin = begin
            graph_cls.capture_end = end
        self._installed.clear()


#: the process's gate (one per process: a capture anywhere in it matters to every thread)
capture_gate = CaptureGate()
