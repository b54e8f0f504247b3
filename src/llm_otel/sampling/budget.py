"""Trace budget: the kept-root rate held within ``LLM_OTEL_TRACES_PER_S`` per decision, per server
(:class:`SharedTraceBudget`: the API servers of one launcher share one), and the outlier bound."""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD

from llm_otel.sampling.policy import QUANT_BITS

__all__ = ["SharedTraceBudget", "TraceBudget", "trace_budget"]

_R = TypeVar("_R")
# (last decision s or NaN, decision rate /s, credit, last outlier s or NaN, outlier tokens)
_State = tuple[float, float, float, float, float]
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
        self._state: _State = self._initial()

    def limit(self, policy_threshold: int, now: float | None = None) -> tuple[int, bool]:
        """``(threshold, lowered)`` for one root decision: the threshold to use (>= the policy's)
        and whether the budget raised it. Records the decision (rate, credit)."""
        now = self.clock() if now is None else now

        def decide(state: _State) -> tuple[tuple[int, bool], _State]:
            last, rate, credit, budget_threshold = self._advance(state, now)
            threshold, lowered = policy_threshold, False
            if budget_threshold > policy_threshold:
                threshold, lowered = budget_threshold, True
            credit -= (MAX_THRESHOLD - threshold) / MAX_THRESHOLD
            return (threshold, lowered), (last, rate, credit, state[3], state[4])

        return self._update(decide)

    def take_outlier(self, now: float | None = None) -> bool:
        """Whether one outlier capture (``llm.sampling.reason=outlier``: a dropped request kept at
        its end for an error or an SLO breach) may be kept now, spending one token if so. Outliers
        have a bound of their own: a token bucket refilled at ``traces_per_s`` up to ``capacity``
        (the same rate and burst as root decisions, apart from them), so that a storm of failing
        requests adds at most ``capacity + traces_per_s * W`` kept traces over any W seconds."""
        now = self.clock() if now is None else now

        def take(state: _State) -> tuple[bool, _State]:
            last, tokens = state[3], state[4]
            if not math.isnan(last) and now > last:
                tokens = min(self.capacity, tokens + self.traces_per_s * (now - last))
            if math.isnan(last) or now > last:
                last = now
            kept = tokens >= 1.0
            return kept, (*state[:3], last, tokens - 1.0 if kept else tokens)

        return self._update(take)

    def probability(self, now: float | None = None) -> float:
        """The budget's probability for a root decided at ``now`` (default: the clock), without
        recording one: for the ``llm_otel.sampling.probability`` gauge."""
        now = self.clock() if now is None else now
        return (MAX_THRESHOLD - self._advance(self._read(), now)[3]) / MAX_THRESHOLD

    def _update(self, step: Callable[[_State], tuple[_R, _State]]) -> _R:
        """Apply ``step`` to the state: this process's own (one tuple swapped whole, no lock)."""
        result, self._state = step(self._state)
        return result

    def _read(self) -> _State:
        return self._state

    def _advance(self, state: _State, now: float) -> tuple[float, float, float, int]:
        """``state`` at ``now`` with one more decision counted: ``(last, rate, credit, threshold)``,
        the threshold being the budget's own (0 when it does not limit)."""
        last, rate, credit = state[:3]
        if math.isnan(last) or now <= last:
            dt = 0.0
            last = now if math.isnan(last) else last
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

    def _initial(self) -> _State:
        """The state of a budget that has decided nothing: full credit, full outlier tokens."""
        return (math.nan, 0.0, self.capacity, math.nan, self.capacity)

    @property
    def credit(self) -> float:
        """Expected kept traces the bucket holds after the last decision (may dip below 0 by the
        minimum probabilities spent without credit)."""
        return self._read()[2]


class SharedTraceBudget(TraceBudget):
    """A :class:`TraceBudget` whose state is shared by the processes that agree on ``key``: the
    API servers of one ``vllm serve --api-server-count N`` hold one budget per server, not N.

    The state (five doubles, 48 bytes with a magic) lives in a file under ``/dev/shm`` (else the
    temporary directory), ``llm-otel-budget-<uid>-<key>``, mode 0600, mapped with ``mmap``; each
    decision reads, updates and writes it under ``flock``. Never blocks: the lock is tried without
    waiting a few times (a decision holds it for microseconds); when it stays busy, or the file
    cannot be used, the decision is made on this process's own copy of the state (the last one it
    saw) and what it spent is added to the shared state at this process's next locked decision
    (an outlier is not kept without the shared bucket); with the file unusable the budget is this
    process's own (at most N times the budget, never unbounded). Crash-safe: the kernel releases a ``flock`` when its holder dies. Times are
    ``time.monotonic()`` (``CLOCK_MONOTONIC``, one clock for every process of a host), or the
    injected ``clock``. A forked child opens the file again (a lock is per open file).

    ``key``: a string, or a callable returning one (or None: not shared, yet) asked at most once a
    second until it answers, since a spawned API server learns what it is after its providers
    exist. ``directory``: where the file lives (tests). Other arguments: :class:`TraceBudget`.
    """

    _MAGIC = 0x4C4C4D4F54424431  # "LLMOTBD1"
    _LAYOUT = struct.Struct("<Q5d")
    _TRIES = 4

    def __init__(
        self,
        traces_per_s: float,
        key: str | Callable[[], str | None],
        directory: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(traces_per_s, **kwargs)
        self._key = key
        self._directory = directory
        self._next_key_check = 0.0
        self._pid = 0
        self._fd = -1
        self._map: mmap.mmap | None = None
        self.path: str | None = None
        self._fallback = False  # the last update ran on this process's copy (lock busy / unshared)
        self._pending: tuple[float, int] = (0.0, 0)  # (expected kept, decisions) owed to the file

    def _segment(self) -> mmap.mmap | None:
        """The mapped state file of this process (opened on first use and after a fork), or None
        (not shared: no key yet, or the file cannot be used - logged once)."""
        pid = os.getpid()
        if self._pid == pid:
            return self._map
        if callable(self._key):
            now = time.monotonic()
            if now < self._next_key_check:
                return None
            self._next_key_check = now + 1.0
            key = self._key()
            if key is None:
                return None
        else:
            key = self._key
        self._pid, self._map, self._fd = pid, None, -1  # a forked child never uses its parent's
        directory = self._directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        path = os.path.join(directory, f"llm-otel-budget-{os.getuid()}-{_safe(key)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid():
                    raise PermissionError(f"{path} belongs to uid {st.st_uid}")
                if st.st_size < self._LAYOUT.size:
                    os.ftruncate(fd, self._LAYOUT.size)
                self._map = mmap.mmap(fd, self._LAYOUT.size)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self.path = fd, path
        except Exception as exc:  # noqa: BLE001 - the budget falls back to this process's own
            from llm_otel.errors import process_errors

            process_errors().report("sampling.shared_budget", exc, f"trace budget not shared ({path}); per process")
        return self._map

    def _locked(self, step: Callable[[_State], tuple[_R, _State]] | None) -> tuple[bool, _R | None]:
        """``(True, result)`` of ``step`` applied to the shared state under the lock (None: read
        only), or ``(False, None)`` when the state is not shared now or the lock stays busy."""
        segment = self._segment()
        if segment is None:
            return False, None
        for attempt in range(self._TRIES):
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 == self._TRIES:
                    return False, None
                os.sched_yield()
            except OSError:
                return False, None
        try:
            magic, *values = self._LAYOUT.unpack_from(segment, 0)
            state = cast(_State, tuple(values)) if magic == self._MAGIC else self._initial()
            result = None
            if step is not None:
                result, state = step(state)
                debit, count = self._pending
                if count:  # decisions made while the lock was busy: their rate and credit
                    self._pending = (0.0, 0)
                    state = (state[0], state[1] + count / self.tau, state[2] - debit, *state[3:])
                self._LAYOUT.pack_into(segment, 0, self._MAGIC, *state)
            self._state = state  # this process's copy, for a decision the lock cannot wait for
            return True, result
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def limit(self, policy_threshold: int, now: float | None = None) -> tuple[int, bool]:
        self._fallback = False
        threshold, lowered = super().limit(policy_threshold, now)
        if self._fallback:  # decided on this process's copy: owed to the shared state
            debit, count = self._pending
            self._pending = (debit + (MAX_THRESHOLD - threshold) / MAX_THRESHOLD, count + 1)
        return threshold, lowered

    def take_outlier(self, now: float | None = None) -> bool:
        self._fallback = False
        kept = super().take_outlier(now)
        return kept and not self._fallback  # without the shared bucket: not kept

    def _update(self, step: Callable[[_State], tuple[_R, _State]]) -> _R:
        done, result = self._locked(step)
        if done:
            return cast(_R, result)
        self._fallback = True
        return super()._update(step)

    def _read(self) -> _State:
        self._locked(None)
        return self._state


def _safe(key: str) -> str:
    """``key`` as a file-name part: letters, digits, ``-``, ``_`` and ``.`` kept, others ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))[:100]


def trace_budget(
    traces_per_s: float, key: str | Callable[[], str | None] | None = None, directory: str | None = None
) -> TraceBudget | None:
    """The trace budget for ``LLM_OTEL_TRACES_PER_S``: None (no budget) for 0 or infinity; a
    :class:`SharedTraceBudget` shared by the processes that agree on ``key`` (default:
    :func:`llm_otel.process.identity.server_budget_key`, registered by the process runtime with
    :func:`set_default_budget_key`: the API servers of one launcher);
    ``key=""``: this process's own :class:`TraceBudget`."""
    if traces_per_s <= 0 or math.isinf(traces_per_s):
        return None
    if key == "":
        return TraceBudget(traces_per_s)
    if key is None:
        key = _registered_key
    return SharedTraceBudget(traces_per_s, key, directory)


# The process runtime registers how a process finds its server's budget key
# (llm_otel.process.identity.server_budget_key): sampling sits below the process runtime and
# never imports it (docs/architecture.md, "Parts and imports"). Read at each decision until known.
_DEFAULT_KEY: list[Callable[[], str | None]] = []


def set_default_budget_key(key: Callable[[], str | None]) -> None:
    """Register the function that names the budget a process shares (None: its own)."""
    _DEFAULT_KEY[:] = [key]


def _registered_key() -> str | None:
    return _DEFAULT_KEY[0]() if _DEFAULT_KEY else None
