"""NVTX ranges that carry OpenTelemetry span ids, so an Nsight Systems timeline leads to the trace.

Domain ``llm_otel``. Messages are fixed strings (NVTX registers and caches every message, so ids
never go into them); the ids travel as payloads:

* per engine step: a push/pop range with message ``llm.engine.step``, the step's phase
  (``prefill`` / ``decode`` / ``mixed``) as its category, and the **step span id as a signed INT64
  payload** (the 64-bit span id reinterpreted as two's complement: :func:`span_id_to_int64`);
* per request: a process range (``start_range``/``end_range``, may start and end on different
  threads) with message ``llm.request``; its payload is a structured NVTX payload
  ``(trace_id_hi, trace_id_lo, span_id)`` (three uint64: the full W3C trace id and the request
  span id) where the installed ``nvtx`` supports structured NumPy payloads, else the request span
  id as INT64.

Everything is a no-op - and nothing is imported at module import time - when the ``nvtx`` package
is absent, ``NVTX_DISABLE`` is set, ``LLM_OTEL_NVTX`` is off, or no NVTX tool (Nsight Systems,
Nsight Compute, ...) is attached to the process: the ``nvtx`` package then hands out a dummy
domain and this module does not even build event attributes.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from llm_otel.errors import process_errors

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger("llm_otel")

DOMAIN = "llm_otel"
STEP_MESSAGE = "llm.engine.step"
REQUEST_MESSAGE = "llm.request"
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def span_id_to_int64(span_id: int) -> int:
    """The signed INT64 NVTX payload for a 64-bit span id (two's complement reinterpretation).

    ``span_id`` must be in [0, 2**64). Ids >= 2**63 become negative; :func:`int64_to_span_id`
    inverts it (what a reader of the Nsight export applies to ``int64Value``).
    Raises ValueError outside the range.
    """
    if not 0 <= span_id < _U64:
        raise ValueError(f"span id {span_id} is not an unsigned 64-bit value")
    return span_id - _U64 if span_id > _I64_MAX else span_id


def int64_to_span_id(value: int) -> int:
    """Inverse of :func:`span_id_to_int64`: the unsigned span id from an INT64 payload."""
    return value + _U64 if value < 0 else value


def request_payload_dtype(np_module: Any) -> Any:
    """NumPy dtype of the structured per-request payload (three little-endian uint64)."""
    return np_module.dtype([("trace_id_hi", "<u8"), ("trace_id_lo", "<u8"), ("span_id", "<u8")])


def request_payload(trace_id: int, span_id: int) -> np.ndarray:
    """A 0-d structured array ``(trace_id_hi, trace_id_lo, span_id)`` (24 bytes) for a request range."""
    import numpy as np

    return np.array((trace_id >> 64, trace_id & (_U64 - 1), span_id), dtype=request_payload_dtype(np))


class NvtxDomain(Protocol):
    """The methods of an ``nvtx.Domain`` that :class:`NvtxRanges` calls."""

    def get_event_attributes(
        self, message: str | None = None, color: Any = None, category: str | int | None = None, payload: Any = None
    ) -> Any: ...

    def push_range(self, attributes: Any) -> None: ...

    def pop_range(self) -> None: ...

    def start_range(self, attributes: Any) -> int: ...

    def end_range(self, range_id: int) -> None: ...


class NvtxRanges:
    """Step and request ranges in domain ``llm_otel``.

    Args:
        enabled: False makes every method a no-op (``LLM_OTEL_NVTX=false``).
        domain: for tests - an object with the ``nvtx.Domain`` methods (``get_event_attributes``,
            ``push_range``, ``pop_range``, ``start_range``, ``end_range``); default: the real
            domain from ``nvtx.get_domain("llm_otel")``.

    ``active`` is True only when the ``nvtx`` package imported, NVTX is not disabled and a tool is
    attached. Step ranges are thread-local (push/pop); :meth:`end_step` on another thread than
    :meth:`begin_step` is ignored rather than popping someone else's range.
    """

    def __init__(self, enabled: bool = True, domain: NvtxDomain | None = None) -> None:
        self.active = False  # True only with a domain
        self.structured_payloads = False
        self._domain: NvtxDomain | None = None
        self._requests: dict[str, int] = {}
        self._lock = threading.Lock()
        self._tls = threading.local()
        if not enabled:
            return
        try:
            if domain is None:
                import nvtx
                from nvtx._lib.lib import DummyDomain

                if not nvtx.enabled():
                    return
                domain = nvtx.get_domain(DOMAIN)
                if isinstance(domain, DummyDomain):
                    return  # no tool attached: the package would drop every call anyway
                self.structured_payloads = hasattr(nvtx, "numpy_dtype")
            else:
                self.structured_payloads = True
            self._domain = domain
            self.active = True
        except ImportError as exc:  # no nvtx package: no ranges, quietly (it is an optional extra)
            logger.debug("llm-otel: NVTX ranges off (%s: %s)", type(exc).__name__, exc)
        except Exception as exc:  # noqa: BLE001 - a broken nvtx: no ranges, counted
            process_errors().report("gpu.nvtx.init", exc, "NVTX ranges off")

    def begin_step(self, step_span_id: int, phase: str = "mixed") -> None:
        """Push the step range (payload: the step span id as INT64) on this thread."""
        domain = self._domain
        if not self.active or domain is None:
            return
        try:
            payload = span_id_to_int64(step_span_id)
            stack = getattr(self._tls, "stack", None)
            if stack is None:
                stack = self._tls.stack = []
            domain.push_range(domain.get_event_attributes(message=STEP_MESSAGE, category=phase, payload=payload))
            stack.append(step_span_id)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def end_step(self, step_span_id: int) -> None:
        """Pop the step range pushed by :meth:`begin_step` for this step on this thread."""
        domain = self._domain
        if not self.active or domain is None:
            return
        stack = getattr(self._tls, "stack", None)
        if not stack or stack[-1] != step_span_id:
            return
        stack.pop()
        try:
            domain.pop_range()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def start_request(self, request_id: str, trace_id: int, span_id: int) -> None:
        """Start the request's process range (once per request id; bounded to 1M open ranges)."""
        domain = self._domain
        if not self.active or domain is None or request_id in self._requests or len(self._requests) >= 1_000_000:
            return
        try:
            payload = request_payload(trace_id, span_id) if self.structured_payloads else span_id_to_int64(span_id)
            range_id = domain.start_range(domain.get_event_attributes(message=REQUEST_MESSAGE, payload=payload))
            with self._lock:
                self._requests[request_id] = range_id
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def end_request(self, request_id: str) -> None:
        """End the request's process range, from any thread; unknown ids are ignored."""
        domain = self._domain
        if not self.active or domain is None:
            return
        with self._lock:
            range_id = self._requests.pop(request_id, None)
        if range_id is None:
            return
        try:
            domain.end_range(range_id)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def _fail(self, exc: BaseException) -> None:
        self.active = False
        process_errors().report("gpu.nvtx.range", exc, "NVTX ranges turned off after an error; the engine continues")
