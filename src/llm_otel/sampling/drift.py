"""Latency drift detector: a sustained P99 rise of TTFT or inter-token latency boosts sampling."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Protocol

import numpy as np

__all__ = ["DriftDetector", "DriftListener"]


class DriftDetector:
    """Sustained P99 latency rise detector (TTFT and inter-token latency, seconds).

    Observations fill windows of ``window_s`` seconds; each closed window's P99 is compared with
    the baseline (median of the previous ``baseline_windows`` windows). A rise >= ``rise`` (0.15 =
    15 %) in ``consecutive`` windows in a row starts a boost lasting ``cooldown_s`` seconds.
    """

    def __init__(
        self,
        window_s: float = 10.0,
        rise: float = 0.15,
        consecutive: int = 3,
        cooldown_s: float = 60.0,
        baseline_windows: int = 6,
        min_samples: int = 20,
    ) -> None:
        self.window_s, self.rise, self.consecutive = window_s, rise, consecutive
        self.cooldown_s, self.min_samples = cooldown_s, min_samples
        self._series: dict[str, list[float]] = {}
        self._history: dict[str, deque] = {}
        self._streak: dict[str, int] = {}
        self._window_start: float | None = None
        self.boost_until = -math.inf
        self.boosts = 0
        self._lock = threading.Lock()
        self._baseline_windows = baseline_windows

    def observe(self, metric: str, value: float, now: float | None = None) -> None:
        """Add one latency observation (s) of ``metric`` (e.g. ``"ttft"``, ``"itl"``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._window_start is None:
                self._window_start = now
            while now - self._window_start >= self.window_s:
                self._close_window(self._window_start + self.window_s)
                self._window_start += self.window_s
            self._series.setdefault(metric, []).append(value)

    def _close_window(self, now: float) -> None:
        for metric in set(self._series) | set(self._history):
            values = self._series.get(metric, ())
            if len(values) < self.min_samples:
                self._streak[metric] = 0  # too few samples: the run of drifting windows is broken
                continue
            p99 = float(np.percentile(values, 99))
            history = self._history.setdefault(metric, deque(maxlen=self._baseline_windows))
            if len(history) >= 2:
                baseline = float(np.median(history))
                if p99 >= baseline * (1 + self.rise):
                    self._streak[metric] = self._streak.get(metric, 0) + 1
                    if self._streak[metric] >= self.consecutive:
                        if now >= self.boost_until:
                            self.boosts += 1
                        self.boost_until = now + self.cooldown_s
                        self._streak[metric] = 0
                        # the new level becomes the baseline: a lasting shift boosts once, not forever
                        history.clear()
                        history.append(p99)
                    continue  # until then a drifting window does not become the baseline
                self._streak[metric] = 0
            history.append(p99)
        self._series = {}

    def boosting(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.boost_until


class TimedRequest(Protocol):
    """What :class:`DriftListener` reads of a finished request record
    (:class:`llm_otel.telemetry.record.RequestRecord`)."""

    def time_to_first_token_s(self) -> float | None: ...

    def time_per_output_token_s(self) -> float | None: ...


class DriftListener:
    """Request-lifecycle listener (see :mod:`llm_otel.telemetry.lifecycle`) that feeds a
    :class:`DriftDetector` each finished request's TTFT (``"ttft"``) and time per output token
    (``"itl"``), in seconds."""

    error_key = "telemetry.sampling"
    on_start = None  # nothing to do at arrival or per step
    on_tokens = None

    def __init__(self, drift: DriftDetector) -> None:
        self.drift = drift

    def on_finish(self, rec: TimedRequest, duration_s: float) -> None:
        ttft = rec.time_to_first_token_s()
        if ttft is not None:
            self.drift.observe("ttft", ttft)
        tpot = rec.time_per_output_token_s()
        if tpot is not None:
            self.drift.observe("itl", tpot)
