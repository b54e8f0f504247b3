"""VRAM pressure levels ``ok`` / ``warn`` / ``critical`` with thresholds, hold times and hysteresis.

A level is entered when usage has stayed at or above its threshold for its hold time
(``LLM_OTEL_VRAM_WARN`` for ``LLM_OTEL_VRAM_WARN_HOLD_S``, ``LLM_OTEL_VRAM_CRITICAL`` for
``LLM_OTEL_VRAM_CRITICAL_HOLD_S``; defaults: :class:`llm_otel.config.SignalsConfig`). It is left
when usage has stayed below ``threshold - clear_margin`` for ``clear_hold_s``; the level then
becomes whatever the entry rules give for the current history (critical -> warn while usage stays
above the warn threshold). Each transition is logged once. :meth:`PressureMonitor.update` is fed
by the signals thread once a second; readers only read :attr:`level`.
"""

from __future__ import annotations

import logging

from llm_otel.config.signals import SignalsConfig

logger = logging.getLogger("llm_otel")

LEVELS = ("ok", "warn", "critical")
_DEFAULTS = SignalsConfig()


class PressureMonitor:
    """Hysteresis state machine over a usage fraction in [0, 1].

    Raises ValueError for thresholds outside (0, 1], ``warn > critical`` or negative times.
    """

    def __init__(
        self,
        warn: float = _DEFAULTS.vram_warn,
        warn_hold_s: float = _DEFAULTS.vram_warn_hold_s,
        critical: float = _DEFAULTS.vram_critical,
        critical_hold_s: float = _DEFAULTS.vram_critical_hold_s,
        clear_margin: float = _DEFAULTS.vram_clear_margin,
        clear_hold_s: float = _DEFAULTS.vram_clear_hold_s,
    ) -> None:
        if not (0 < warn <= critical <= 1) or min(warn_hold_s, critical_hold_s, clear_hold_s, clear_margin) < 0:
            raise ValueError("need 0 < warn <= critical <= 1 and non-negative hold times and margin")
        self.thresholds = {"warn": warn, "critical": critical}
        self.holds = {"warn": warn_hold_s, "critical": critical_hold_s}
        self.clear_margin = clear_margin
        self.clear_hold_s = clear_hold_s
        self.level = "ok"
        self.usage: float | None = None
        self.source: str | None = None
        self._above: dict[str, float | None] = {"warn": None, "critical": None}
        self._below: dict[str, float | None] = {"warn": None, "critical": None}
        self.transitions: list[tuple[float, str, str]] = []  # (time, from, to), last 64

    def update(self, usage: float | None, now: float, source: str | None = None) -> str:
        """Fold one reading (``usage`` fraction at monotonic ``now`` seconds) in; returns the level.
        ``None`` (source unavailable) resets the hold timers and keeps the level."""
        if usage is None:
            self.usage = None
            self._above = {"warn": None, "critical": None}
            self._below = {"warn": None, "critical": None}
            return self.level
        self.usage, self.source = usage, source
        for name, threshold in self.thresholds.items():
            if usage >= threshold:
                if self._above[name] is None:
                    self._above[name] = now
            else:
                self._above[name] = None
            if usage < threshold - self.clear_margin:
                if self._below[name] is None:
                    self._below[name] = now
            else:
                self._below[name] = None
        entered = "ok"
        for name in ("warn", "critical"):
            since = self._above[name]
            if since is not None and now - since >= self.holds[name]:
                entered = name
        current = LEVELS.index(self.level)
        target = LEVELS.index(entered)
        if target > current:
            self._move(entered, now)
        elif target < current:
            since = self._below[self.level]
            if since is not None and now - since >= self.clear_hold_s:
                self._move(entered, now)
        return self.level

    def _move(self, level: str, now: float) -> None:
        old, self.level = self.level, level
        self.transitions.append((now, old, level))
        del self.transitions[:-64]
        log = logger.warning if LEVELS.index(level) > LEVELS.index(old) else logger.info
        log("llm-otel: VRAM pressure %s -> %s (usage %.2f from %s)", old, level, self.usage or 0.0, self.source or "?")
