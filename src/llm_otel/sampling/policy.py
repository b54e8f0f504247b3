"""Sampling probability from utilisation, and the quantised consistent-probability threshold.

:class:`UtilizationPolicy` maps smoothed utilisation to a root probability (floor/ceiling,
hysteresis, bounded change per interval); :func:`quantize_threshold` turns a probability into the
OpenTelemetry threshold written as ``ot=th`` (short, never below the requested probability).
"""

from __future__ import annotations

import math
import time

from opentelemetry.sdk.trace._sampling_experimental._util import (
    MAX_THRESHOLD,
    calculate_threshold,
)

__all__ = ["QUANT_BITS", "quantize_threshold", "UtilizationPolicy"]

QUANT_BITS = 12  # thresholds keep their top 12 bits: at most 3 hex digits in `th`


def quantize_threshold(probability: float) -> int:
    """Threshold for ``probability`` rounded down to a multiple of 2**(56-QUANT_BITS) (short ``th``):
    the effective probability is never below the requested one, and any p > 0 keeps at least
    2**-QUANT_BITS (about 2.4e-4) of traces."""
    p = min(1.0, max(0.0, probability))
    step = 1 << (56 - QUANT_BITS)
    threshold = calculate_threshold(p) // step * step
    if p > 0 and threshold >= MAX_THRESHOLD:
        threshold = MAX_THRESHOLD - step
    return threshold


class UtilizationPolicy:
    """Maps smoothed utilisation in [0, 1] to a sampling probability.

    Linear from ``ceiling`` at ``low`` utilisation down to ``floor`` at ``high``; the probability
    moves at most a factor ``max_step`` per ``interval_s`` seconds elapsed since its last change
    (one factor for the first change; evaluated when a decision asks, so after a quiet spell it
    catches up at once), and only when the target differs by more than ``hysteresis``
    (relative), so it does not flap with noisy utilisation.
    """

    def __init__(
        self,
        floor: float = 0.01,
        ceiling: float = 1.0,
        low: float = 0.5,
        high: float = 0.95,
        max_step: float = 2.0,
        hysteresis: float = 0.1,
        interval_s: float = 1.0,
        base: float | None = None,
    ) -> None:
        base = ceiling if base is None else base
        if not (
            0 < floor <= ceiling <= 1
            and 0 <= low < high <= 1
            and max_step >= 1
            and hysteresis >= 0
            and interval_s >= 0
            and floor <= base <= ceiling
        ):
            raise ValueError(
                "need 0 < floor <= base <= ceiling <= 1, 0 <= low < high <= 1, max_step >= 1, "
                "hysteresis >= 0, interval_s >= 0"
            )
        self.floor, self.ceiling, self.low, self.high = floor, ceiling, low, high
        self.max_step, self.hysteresis, self.interval_s = max_step, hysteresis, interval_s
        self.base = base
        self.probability = self.base
        self._last_change: float | None = None

    def target(self, utilization: float | None) -> float:
        if utilization is None:
            return self.base
        u = min(1.0, max(0.0, utilization))
        frac = min(1.0, max(0.0, (u - self.low) / (self.high - self.low)))
        return self.ceiling + (self.floor - self.ceiling) * frac

    def update(self, utilization: float | None, now: float | None = None) -> float:
        """Move toward the target for ``utilization``; returns the current probability."""
        now = time.monotonic() if now is None else now
        target = self.target(utilization)
        if abs(target - self.probability) <= self.hysteresis * self.probability:
            return self.probability
        elapsed = math.inf if self._last_change is None else now - self._last_change
        if elapsed < self.interval_s:
            return self.probability
        # a factor max_step per interval of elapsed time: after a quiet spell (no decision asked
        # for the probability) it may catch up at once instead of one step per request
        steps = 1 if self._last_change is None or self.interval_s <= 0 else min(64, int(elapsed / self.interval_s))
        factor = self.max_step**steps
        lo, hi = self.probability / factor, self.probability * factor
        self.probability = min(self.ceiling, max(self.floor, min(hi, max(lo, target))))
        self._last_change = now
        return self.probability
