"""Clock domains: whether an engine's monotonic stamps can be mixed with the frontend's clock.

vLLM's engine core stamps its events and outputs with ``time.monotonic()`` of *its* host
(``EngineCoreEvent.timestamp``, ``EngineCoreOutputs.timestamp``). The frontend turns them into
epoch time with its own ``time.time() - time.monotonic()`` offset - exact when both processes run
on one host (Linux ``CLOCK_MONOTONIC`` is system-wide), meaningless when the engine core runs on
another host (multi-node data parallelism, a remote engine): its monotonic clock counts from that
host's boot, and TTFTs would come out hours long or clamped to zero.

:class:`EngineClock` decides from causality alone, with no extra messages. With ``d`` the engine's
clock minus the frontend's:

* every output was stamped before the frontend read it: ``ts_engine - d <= received_frontend``,
  so ``d >= lo = max(ts_engine - received_frontend)``;
* every request was handed over before the engine queued it: ``handed_frontend <= queued_engine - d``,
  so ``d <= hi = min(queued_engine - handed_frontend)``.

One clock domain when ``d = 0`` is consistent with both bounds (within ``TOLERANCE_S``): engine
stamps are used as they are. Otherwise the engine's stamps are shifted by an estimate of ``d``
(the middle of ``[lo, hi]``, or the bound that is known): intervals between engine stamps (queue,
prefill, TPOT, ITL) stay exact, and those that mix the two clocks (frontend duration, engine input
wait, TTFT) are off by at most the message delays that bound ``d``; such requests carry
``llm.request.timing.source = engine_clock_mapped``.

Cost: one subtraction and comparison per engine step (``observe_output``) and per request
(``observe_queued``); no allocation.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("llm_otel")

# Slack for float rounding of stamps taken microseconds apart on one clock (vLLM ships them as
# float seconds) - far below any cross-host offset worth correcting.
TOLERANCE_S = 0.002


class EngineClock:
    """What is known about one engine core's clock relative to this frontend's ``time.monotonic()``."""

    __slots__ = ("lo", "hi", "_warned")

    def __init__(self) -> None:
        self.lo = -math.inf  # lower bound of d (engine - frontend), from outputs
        self.hi = math.inf  # upper bound of d, from QUEUED events of requests we handed over
        self._warned = False

    def observe_output(self, engine_ts: float, received_mono: float) -> None:
        """An ``EngineCoreOutputs.timestamp`` (engine s) read at ``received_mono`` (frontend s)."""
        d = engine_ts - received_mono
        if d > self.lo:
            self.lo = d
            self._check()

    def observe_queued(self, handed_mono: float, queued_engine: float) -> None:
        """A request handed to the engine at ``handed_mono`` (frontend s), QUEUED at ``queued_engine``."""
        d = queued_engine - handed_mono
        if d < self.hi:
            self.hi = d
            self._check()

    @property
    def same_domain(self) -> bool:
        """True while the engine's stamps are consistent with the frontend's own clock."""
        return self.lo <= TOLERANCE_S and self.hi >= -TOLERANCE_S

    def offset_s(self) -> float:
        """Seconds to subtract from an engine stamp to put it on the frontend's clock (0 in one domain)."""
        if self.same_domain:
            return 0.0
        lo, hi = self.lo, self.hi
        if math.isinf(lo):
            return hi
        if math.isinf(hi) or lo > hi:  # no hand-over bound, or bounds crossed (a clock jumped): trust outputs
            return lo
        return (lo + hi) / 2

    def _check(self) -> None:
        if not self._warned and not self.same_domain:
            self._warned = True
            logger.warning(
                "llm-otel: the engine core's clock is not this frontend's (offset about %.3f s): its "
                "stamps are shifted onto this clock and requests are marked "
                "llm.request.timing.source=engine_clock_mapped",
                self.offset_s(),
            )
