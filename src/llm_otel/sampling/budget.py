"""Trace budget: the kept-root rate held within ``LLM_OTEL_TRACES_PER_S`` per decision."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD

from llm_otel.sampling.policy import QUANT_BITS

__all__ = ["TraceBudget", "trace_budget"]

_STEP_BITS = 56 - QUANT_BITS  # a quantised threshold is a multiple of 2**_STEP_BITS
_SCALE = float(MAX_THRESHOLD)


class TraceBudget:
    """Keeps the expected kept-root rate within ``traces_per_s`` (``LLM_OTEL_TRACES_PER_S``).

    Per root decision (kept or not) at monotonic time ``now`` (seconds), O(1), no lock:

    * ``rate``: exponentially decayed count of root decisions over ``time_constant_s`` (tau), i.e.
      ``rate = rate * exp(-dt / tau) + 1 / tau``, decisions per second including this one;
    * ``credit``: a token bucket of expected kept traces, refilled at ``traces_per_s`` up to
      ``capacity = max(1, traces_per_s * burst_s)`` and debited by the probability each decision used
      (its expectation of kept traces, not whether it kept - so the threshold depends only on the
      arrival times, never on any trace's randomness);
    * budget probability ``p_b = min(1, credit / (rate * horizon))``: spend the credit left over the
      next ``horizon`` seconds at the arrival rate seen now. While credit is full and decisions
      come at fewer than ``capacity / horizon`` per second, ``p_b = 1``; at a steady rate ``r`` above
      the budget the credit settles at ``traces_per_s * horizon`` and ``p_b = traces_per_s / r``; a
      burst from idle meets a falling credit with a rising rate: its first ``2/3 * capacity`` or
      so requests are kept (``horizon = tau / 2``; 7-8 at the default 10/s), then the probability
      falls steeply, and the whole burst spends at most the bucket plus its refill.
      ``horizon = min(horizon_s, capacity * tau)`` so that one request after a quiet spell (rate
      ``1 / tau``) always reads ``p_b = 1``.

    :meth:`limit` returns the larger of the policy's threshold and ``quantize_threshold(p_b)`` (the
    probability actually used is never above either); with no credit left the probability is the
    quantisation's minimum ``2**-12``. Guarantee: the expected number of kept roots over any W
    seconds is at most ``capacity + traces_per_s * W`` plus ``2**-12`` per decision made without
    credit. Threads racing on one decision may lose one update (the state is one tuple swapped
    whole); that shifts the rate by one decision and never the consistency of a threshold.

    Raises ValueError unless ``traces_per_s > 0`` and the times are positive.
    """

    def __init__(
        self,
        traces_per_s: float,
        burst_s: float = 1.0,
        time_constant_s: float = 0.25,
        horizon_s: float = 0.125,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (traces_per_s > 0 and burst_s > 0 and time_constant_s > 0 and horizon_s > 0):
            raise ValueError("need traces_per_s > 0, burst_s > 0, time_constant_s > 0, horizon_s > 0")
        self.traces_per_s = float(traces_per_s)
        self.capacity = max(1.0, self.traces_per_s * burst_s)
        self.tau = float(time_constant_s)
        self.horizon = min(float(horizon_s), self.capacity * self.tau)
        self.clock = clock
        self._state: tuple[float | None, float, float] = (None, 0.0, self.capacity)  # (last, rate, credit)

    def limit(self, policy_threshold: int, now: float | None = None) -> tuple[int, bool]:
        """``(threshold, lowered)`` for one root decision: the threshold to use (>= the policy's)
        and whether the budget raised it. Records the decision (rate, credit)."""
        last, rate, credit, budget_threshold = self._advance(self.clock() if now is None else now)
        threshold, lowered = policy_threshold, False
        if budget_threshold > policy_threshold:
            threshold, lowered = budget_threshold, True
        credit -= (MAX_THRESHOLD - threshold) / MAX_THRESHOLD
        self._state = (last, rate, credit)
        return threshold, lowered

    def probability(self, now: float | None = None) -> float:
        """The budget's probability for a root decided at ``now`` (default: the clock), without
        recording one: for the ``llm_otel.sampling.probability`` gauge."""
        return (MAX_THRESHOLD - self._advance(self.clock() if now is None else now)[3]) / MAX_THRESHOLD

    def _advance(self, now: float) -> tuple[float, float, float, int]:
        """State at ``now`` with one more decision counted: ``(last, rate, credit, threshold)``,
        the threshold being the budget's own (0 when it does not limit)."""
        last, rate, credit = self._state
        if last is None or now <= last:
            dt = 0.0
            last = now if last is None else last
        else:
            dt = now - last
            last = now
        rate = rate * math.exp(-dt / self.tau) + 1.0 / self.tau
        credit = min(self.capacity, credit + self.traces_per_s * dt)
        budget_p = credit / (rate * self.horizon)
        if budget_p >= 1.0:
            return last, rate, credit, 0
        # quantize_threshold(budget_p) without its general checks (p < 1 here): the threshold
        # rounded down to a multiple of 2**44, at least one step below MAX_THRESHOLD
        steps = -(-round(budget_p * _SCALE) >> _STEP_BITS) if budget_p > 0 else 1
        return last, rate, credit, MAX_THRESHOLD - (max(1, steps) << _STEP_BITS)

    @property
    def credit(self) -> float:
        """Expected kept traces the bucket holds after the last decision (may dip below 0 by the
        minimum probabilities spent without credit)."""
        return self._state[2]


def trace_budget(traces_per_s: float) -> TraceBudget | None:
    """The :class:`TraceBudget` for ``LLM_OTEL_TRACES_PER_S``: None (no budget) for 0 or infinity."""
    if traces_per_s <= 0 or math.isinf(traces_per_s):
        return None
    return TraceBudget(traces_per_s)
