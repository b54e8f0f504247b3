"""Adaptive consistent-probability sampling driven by GPU utilisation and latency health.

The root decision uses OpenTelemetry's consistent probability sampling (W3C tracestate
``ot=th:<hex>``; the SDK's composable samplers do the threshold arithmetic and the tracestate):
a trace is kept iff its randomness (the low 56 bits of the trace id, or ``rv``) is >= the
threshold. The threshold comes from :class:`UtilizationPolicy` (high utilisation -> lower
probability, floor/ceiling, hysteresis, bounded change per interval, quantised) and is raised to
1 by :class:`DriftDetector` while P99 latency drifts upward. It never depends on the trace's
randomness, so traces stay whole across processes and adjusted counts (1/p) stay unbiased.
:class:`TraceBudget` lowers the root probability further, per decision, so that the kept-trace rate
stays within ``LLM_OTEL_TRACES_PER_S`` even for a burst that reaches an idle engine (where the
utilisation policy still says 1); the probability used is the one recorded in ``ot=th``.
Children reuse the parent's threshold. Spans started with ``llm.sampling.reason=outlier`` (a
request the head decision dropped that ended in error or breached an SLO) are kept without a
threshold, so they do not bias adjusted counts.

Usage: ``TracerProvider(sampler=adaptive_sampler())`` or ``OTEL_TRACES_SAMPLER=llm_otel_adaptive``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np
from opentelemetry.sdk.trace._sampling_experimental import (
    ComposableSampler,
    SamplingIntent,
    composable_parent_threshold,
    composite_sampler,
)
from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD, calculate_threshold
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult

from llm_otel.semconv import attributes as A

__all__ = ["UtilizationPolicy", "DriftDetector", "AdaptiveRootSampler", "EngineOccupancy", "TraceBudget",
           "adaptive_sampler", "trace_budget", "traces_sampler_factory", "quantize_threshold"]

logger = logging.getLogger("llm_otel")

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

    def __init__(self, traces_per_s: float, burst_s: float = 1.0, time_constant_s: float = 0.25,
                 horizon_s: float = 0.125, clock: Callable[[], float] = time.monotonic) -> None:
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


class UtilizationPolicy:
    """Maps smoothed utilisation in [0, 1] to a sampling probability.

    Linear from ``ceiling`` at ``low`` utilisation down to ``floor`` at ``high``; the probability
    moves at most a factor ``max_step`` per ``interval_s`` seconds elapsed since its last change
    (one factor for the first change; evaluated when a decision asks, so after a quiet spell it
    catches up at once), and only when the target differs by more than ``hysteresis``
    (relative), so it does not flap with noisy utilisation.
    """

    def __init__(self, floor: float = 0.01, ceiling: float = 1.0, low: float = 0.5, high: float = 0.95,
                 max_step: float = 2.0, hysteresis: float = 0.1, interval_s: float = 1.0,
                 base: float | None = None) -> None:
        base = ceiling if base is None else base
        if not (0 < floor <= ceiling <= 1 and 0 <= low < high <= 1 and max_step >= 1 and hysteresis >= 0
                and interval_s >= 0 and floor <= base <= ceiling):
            raise ValueError("need 0 < floor <= base <= ceiling <= 1, 0 <= low < high <= 1, max_step >= 1, "
                             "hysteresis >= 0, interval_s >= 0")
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
        factor = self.max_step ** steps
        lo, hi = self.probability / factor, self.probability * factor
        self.probability = min(self.ceiling, max(self.floor, min(hi, max(lo, target))))
        self._last_change = now
        return self.probability


class DriftDetector:
    """Sustained P99 latency rise detector (TTFT and inter-token latency, seconds).

    Observations fill windows of ``window_s`` seconds; each closed window's P99 is compared with
    the baseline (median of the previous ``baseline_windows`` windows). A rise >= ``rise`` (0.15 =
    15 %) in ``consecutive`` windows in a row starts a boost lasting ``cooldown_s`` seconds.
    """

    def __init__(self, window_s: float = 10.0, rise: float = 0.15, consecutive: int = 3,
                 cooldown_s: float = 60.0, baseline_windows: int = 6, min_samples: int = 20) -> None:
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


class EngineOccupancy:
    """A ``SignalSource`` for hosts without NVML: how full the serving engines' batches are.

    Each engine adapter attaches a callable returning ``(requests, capacity)``: requests the engine
    holds now (running and waiting; for vLLM the frontend's live request records) and the most it
    runs at once (vLLM ``scheduler_config.max_num_seqs``), or None once that engine is gone (the
    callable is then dropped). :meth:`read` returns the highest ``requests / capacity`` over the
    attached engines, capped at 1 (a queue behind a full batch reads 1.0), and 0.0 with none
    attached (nothing is being served). A full batch is when tracing competes with the model for
    the host, so the sampler lowers the probability, exactly as for a busy GPU.
    """

    period_s = 0.25  # reading it is a few len() calls: poll it more often than NVML
    thread_name = "llm-otel-occupancy-poller"

    def __init__(self, on_attach: Callable[[], object] | None = None) -> None:
        self._sources: list[Callable[[], tuple[int, int] | None]] = []
        self._lock = threading.Lock()
        self.on_attach = on_attach  # an idempotent poller.start: no thread until an engine attaches

    def attach(self, source: Callable[[], "tuple[int, int] | None"]) -> None:
        """Add one engine's ``source() -> (requests, capacity) | None``, then run ``on_attach``
        (errors logged, never raised)."""
        with self._lock:
            self._sources.append(source)
        if self.on_attach is not None:
            try:
                self.on_attach()
            except Exception as exc:  # noqa: BLE001 - called from an engine's constructor hook
                logger.warning("llm-otel: engine occupancy poller did not start (%s)", exc)

    @property
    def engines(self) -> int:
        """Sources attached and not yet dropped."""
        return len(self._sources)

    def read(self) -> float:
        """Occupancy in [0, 1] (see the class). A source that raises is dropped (logged once)."""
        best = 0.0
        dead = []
        for source in list(self._sources):
            try:
                got = source()
                if got is None:
                    dead.append(source)
                    continue
                requests, capacity = got
                if capacity > 0:
                    best = max(best, min(1.0, requests / capacity))
            except Exception as exc:  # noqa: BLE001 - one broken engine must not stop the signal
                logger.warning("llm-otel: engine occupancy source failed (%s: %s); dropped", type(exc).__name__, exc)
                dead.append(source)
        if dead:
            with self._lock:
                self._sources = [s for s in self._sources if s not in dead]
        return best


def utilization_is_gpu(poller) -> bool:
    """True unless ``poller`` reads :class:`EngineOccupancy` (which is not a GPU's utilisation and
    must not feed ``hw.gpu.utilization`` or the health score)."""
    return poller is not None and not isinstance(getattr(poller, "source", None), EngineOccupancy)


def default_poller():
    """The adaptive sampler's poller: GPU utilisation from NVML when NVML sees a GPU (started), or
    else :class:`EngineOccupancy`, whose thread starts when the first engine attaches (a process
    that serves no engine, e.g. a Triton client, runs no poller). Stop it with ``poller.stop()``."""
    from llm_otel.gpu.nvml import UtilizationPoller

    poller = UtilizationPoller.from_nvml()
    if poller.source is not None:
        return poller.start()
    occupancy = EngineOccupancy()
    poller = UtilizationPoller(occupancy, period_s=EngineOccupancy.period_s)
    occupancy.on_attach = poller.start  # starts once; later calls return at once
    logger.info("llm-otel: the adaptive sampler follows engine occupancy (no GPU utilisation)")
    return poller


def _as_poller(poller):
    """What the sampler reads utilisation from. Returns ``poller`` itself when it has a
    ``utilization`` attribute (a :class:`~llm_otel.gpu.nvml.UtilizationPoller` or alike), a started
    ``UtilizationPoller`` around it when it is a bare ``SignalSource`` (a ``read()`` method and no
    ``utilization``), None for None. Raises TypeError for anything else, at construction, so that
    span creation never meets it."""
    try:
        has_utilization = hasattr(poller, "utilization")
    except Exception:  # noqa: BLE001 - a property failing now: read (guarded) at each decision
        has_utilization = True
    if poller is None or has_utilization:
        return poller
    if callable(getattr(poller, "read", None)):
        from llm_otel.gpu.nvml import UtilizationPoller

        return UtilizationPoller(poller).start()
    raise TypeError(f"poller must be a UtilizationPoller (a .utilization attribute) or a SignalSource "
                    f"(a .read() method returning utilisation in [0, 1]), not {type(poller).__name__}")


class AdaptiveRootSampler(ComposableSampler):
    """Composable root sampler: threshold from the policy (and drift boost); outliers kept untracked.

    ``poller``: a ``UtilizationPoller`` (its ``utilization``, a fraction in [0, 1] or None, is read
    at most every 100 ms), a bare ``SignalSource`` (wrapped in a started ``UtilizationPoller``, see
    :attr:`poller`), or None (base rate). Raises TypeError for anything else. A utilisation that
    cannot be read or is not a finite number counts as None (logged once); nothing raises out of a
    sampling decision. ``budget``: a :class:`TraceBudget` applied to every root decision after the
    policy (and the drift boost): the threshold used is the larger of the two, and a root the
    budget lowered carries ``llm.sampling.reason=budget``. None: no budget.
    """

    def __init__(self, policy: UtilizationPolicy | None = None, poller=None,
                 drift: DriftDetector | None = None, budget: TraceBudget | None = None) -> None:
        self.policy = policy or UtilizationPolicy()
        self.budget = budget
        self.poller = _as_poller(poller)
        self._bad_utilization_logged = False
        self.drift = drift or DriftDetector()
        self._state = (quantize_threshold(self.policy.probability), {A.LLM_SAMPLING_REASON: "head"})
        self._next_update = 0.0
        self._lock = threading.Lock()

    def _policy_now(self) -> None:
        """Re-evaluate the policy threshold and reason (``_state``) when 100 ms have passed."""
        now = time.monotonic()
        if now >= self._next_update:
            with self._lock:
                if now >= self._next_update:
                    self._next_update = now + 0.1
                    util = self._utilization()
                    boosting = self.drift.boosting(now)
                    p = 1.0 if boosting else self.policy.update(util, now)
                    # threshold and reason change together (one tuple, swapped atomically)
                    self._state = (quantize_threshold(p),
                                   {A.LLM_SAMPLING_REASON: "drift_boost" if boosting else "head"})

    def current_probability(self) -> float:
        """The probability a root decided now would get: the policy's (or the drift boost's),
        re-evaluated at most every 100 ms, lowered by the trace budget's (read, not recorded)."""
        self._policy_now()
        policy = (MAX_THRESHOLD - self._state[0]) / MAX_THRESHOLD
        return policy if self.budget is None else min(policy, self.budget.probability())

    def _utilization(self) -> float | None:
        if self.poller is None:
            return None
        try:
            util = self.poller.utilization
            if util is None:
                return None
            util = float(util)
            if math.isfinite(util):
                return util
            problem = f"not a finite number: {util!r}"
        except Exception as exc:  # noqa: BLE001 - a broken signal must not fail span creation
            problem = f"{type(exc).__name__}: {exc}"
        if not self._bad_utilization_logged:
            self._bad_utilization_logged = True
            logger.warning("llm-otel: sampler utilisation unusable (%s); using the base rate", problem)
        return None

    def sampling_intent(self, parent_ctx, name, span_kind, attributes, links, trace_state=None) -> SamplingIntent:
        if attributes and attributes.get(A.LLM_SAMPLING_REASON) == "outlier":
            return SamplingIntent(threshold=0, threshold_reliable=False)  # kept, no `th`: no count bias
        self._policy_now()
        threshold, attrs = self._state
        if self.budget is not None:
            threshold, lowered = self.budget.limit(threshold)
            if lowered:
                attrs = _BUDGET_REASON
        return SamplingIntent(threshold=threshold, attributes=attrs)

    def get_description(self) -> str:
        budget = "" if self.budget is None else f",traces_per_s={self.budget.traces_per_s:g}"
        return f"LlmOtelAdaptive{{floor={self.policy.floor},ceiling={self.policy.ceiling}{budget}}}"


_BUDGET_REASON = {A.LLM_SAMPLING_REASON: A.LlmSamplingReasonValues.BUDGET}


def adaptive_sampler(policy: UtilizationPolicy | None = None, poller=None,
                     drift: DriftDetector | None = None, budget: TraceBudget | None = None) -> Sampler:
    """A complete SDK sampler: parent threshold for children, :class:`AdaptiveRootSampler` for roots.

    ``budget`` (a :class:`TraceBudget`, or None for none) limits the kept-root rate; it applies to
    root decisions only - a child of a sampled parent (e.g. a request a router already traced)
    reuses the parent's threshold and is never subject to it.

    ``poller`` defaults to :func:`default_poller`: NVML GPU utilisation, or without NVML
    :class:`EngineOccupancy` (the vLLM adapter attaches its engines; polled from the first). A ``UtilizationPoller``
    is used as given (start it yourself); a bare ``SignalSource`` (``read() -> [0, 1]``) is wrapped in
    a started ``UtilizationPoller`` (``sampler.root.poller``; stop it when done). Raises TypeError
    for any other ``poller``.
    """
    if poller is None:
        poller = default_poller()
    return _AdaptiveSampler(AdaptiveRootSampler(policy, poller, drift, budget))


class _AdaptiveSampler(Sampler):
    """SDK Sampler around the SDK's composite sampler that (a) hands it the parent's tracestate -
    the SDK tracer does not pass one, so children would lose ``th`` - and (b) keeps the span's own
    attributes: the SDK uses the sampler's result attributes as the span's attributes, and the
    experimental composite sampler returns only the intent's."""

    def __init__(self, root: AdaptiveRootSampler) -> None:
        self.root = root  # Telemetry feeds its drift detector
        self._inner = composite_sampler(composable_parent_threshold(root))

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if trace_state is None:
            parent = trace.get_current_span(parent_context).get_span_context()
            if parent.is_valid:
                trace_state = parent.trace_state
        result = self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if attributes:
            merged = dict(attributes)
            merged.update(result.attributes)
            return SamplingResult(result.decision, merged, result.trace_state)
        return result

    def get_description(self) -> str:
        return self._inner.get_description()


def trace_budget(traces_per_s: float) -> TraceBudget | None:
    """The :class:`TraceBudget` for ``LLM_OTEL_TRACES_PER_S``: None (no budget) for 0 or infinity."""
    if traces_per_s <= 0 or math.isinf(traces_per_s):
        return None
    return TraceBudget(traces_per_s)


def traces_sampler_factory(arg: str | None = None, traces_per_s: float | None = None) -> Sampler:
    """``opentelemetry_traces_sampler`` entry point (``OTEL_TRACES_SAMPLER=llm_otel_adaptive``).

    ``OTEL_TRACES_SAMPLER_ARG``: ``floor[,ceiling]`` probabilities, e.g. ``0.01,1``. The trace
    budget is ``traces_per_s`` (llm-otel's providers pass their settings'), else
    ``LLM_OTEL_TRACES_PER_S`` from the environment (the SDK configurator passes only ``arg``).
    Raises ConfigError for a bad argument or budget.
    """
    from llm_otel.config import ConfigError, Settings

    floor, ceiling = 0.01, 1.0
    if arg:
        parts: Sequence[str] = [p for p in arg.split(",") if p.strip()]
        try:
            floor = float(parts[0])
            if len(parts) > 1:
                ceiling = float(parts[1])
        except ValueError:
            floor = math.nan
    if not 0 < floor <= ceiling <= 1:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected 'floor[,ceiling]' with "
                          "0 < floor <= ceiling <= 1")
    if traces_per_s is None:
        traces_per_s = Settings.from_env().traces_per_s
    budget = trace_budget(traces_per_s)
    return adaptive_sampler(UtilizationPolicy(floor=floor, ceiling=ceiling), budget=budget)
