"""The adaptive root sampler on the SDK's composable samplers, its SDK wrapper and factories."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace._sampling_experimental import (
    ComposableSampler,
    SamplingIntent,
    composite_sampler,
)
from opentelemetry.sdk.trace._sampling_experimental._trace_state import OtelTraceState
from opentelemetry.sdk.trace._sampling_experimental._util import (
    INVALID_THRESHOLD,
    MAX_RANDOM_VALUE,
    MAX_THRESHOLD,
    MIN_THRESHOLD,
    is_valid_random_value,
    is_valid_threshold,
)
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, TraceState
from opentelemetry.util.types import Attributes

from llm_otel.errors import process_errors
from llm_otel.sampling.budget import TraceBudget, trace_budget
from llm_otel.sampling.drift import DriftDetector, DriftListener
from llm_otel.sampling.occupancy import EngineOccupancy, default_poller
from llm_otel.sampling.policy import UtilizationPolicy, quantize_threshold
from llm_otel.semconv import attributes as A

if TYPE_CHECKING:
    from llm_otel.gpu.nvml import SignalSource, UtilizationReader

__all__ = [
    "AdaptiveRootSampler",
    "ParentThreshold",
    "Sampling",
    "adaptive_sampler",
    "decides_children_by_parent",
    "sampling_of",
    "traces_sampler_factory",
]

logger = logging.getLogger("llm_otel")


def _as_poller(poller: UtilizationReader | SignalSource | None) -> UtilizationReader | None:
    """What the sampler reads utilisation from. Returns ``poller`` itself when it has a
    ``utilization`` attribute (a :class:`~llm_otel.gpu.nvml.UtilizationPoller` or alike), a started
    ``UtilizationPoller`` around it when it is a bare ``SignalSource`` (a ``read()`` method and no
    ``utilization``), None for None. Raises TypeError for anything else, at construction, so that
    span creation never meets it."""
    try:
        has_utilization = hasattr(poller, "utilization")
    except Exception:  # noqa: BLE001 - silent: a property failing now: read (guarded) at each decision
        has_utilization = True
    if poller is None or has_utilization:
        return cast("UtilizationReader | None", poller)  # has .utilization: used as a poller
    if callable(getattr(poller, "read", None)):
        from llm_otel.gpu.nvml import UtilizationPoller

        return UtilizationPoller(cast("SignalSource", poller)).start()  # has .read(): a source
    raise TypeError(
        f"poller must be a UtilizationPoller (a .utilization attribute) or a SignalSource "
        f"(a .read() method returning utilisation in [0, 1]), not {type(poller).__name__}"
    )


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

    def __init__(
        self,
        policy: UtilizationPolicy | None = None,
        poller: UtilizationReader | SignalSource | None = None,
        drift: DriftDetector | None = None,
        budget: TraceBudget | None = None,
    ) -> None:
        self.policy = policy or UtilizationPolicy()
        self.budget = budget
        self.poller = _as_poller(poller)
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
                    self._state = (
                        quantize_threshold(p),
                        {A.LLM_SAMPLING_REASON: "drift_boost" if boosting else "head"},
                    )

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
            process_errors().bad_input(
                "sampling.utilization",
                f"sampler utilisation unusable: not a finite number: {util!r}; using the base rate",
            )
        except Exception as exc:  # noqa: BLE001 - a broken signal must not fail span creation
            process_errors().report("sampling.utilization", exc, "sampler utilisation unusable; using the base rate")
        return None

    def sampling_intent(
        self,
        parent_ctx: Context | None,
        name: str,
        span_kind: SpanKind | None,
        attributes: Attributes,
        links: Sequence[Link] | None,
        trace_state: TraceState | None = None,
    ) -> SamplingIntent:
        if attributes and attributes.get(A.LLM_SAMPLING_REASON) == "outlier":
            # kept, no `th` (no count bias), within the outlier bound of the trace budget
            if self.budget is not None and not self.budget.take_outlier():
                return _DROP
            return SamplingIntent(threshold=0, threshold_reliable=False)
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
_PARENT_REASON = {A.LLM_SAMPLING_REASON: A.LlmSamplingReasonValues.PARENT}
_DROP = SamplingIntent(threshold=INVALID_THRESHOLD, threshold_reliable=False)
_RANDOM_FLAG = 0x02  # W3C Trace Context Level 2 trace-flags: random-trace-id
_LOW_56 = MAX_RANDOM_VALUE  # the trace id's bits that W3C's random flag promises random


def _without_lone_th(trace_state: TraceState) -> TraceState:
    """``trace_state`` without its ``ot`` entry when that entry is a threshold alone (``th:..``);
    an entry with more (``rv``, other sub-keys) is rewritten whole by the composite sampler."""
    ot = trace_state.get("ot")
    if ot is not None and ";" not in ot and ot.startswith("th:"):
        return trace_state.delete("ot")
    return trace_state


class ParentThreshold(ComposableSampler):
    """Composable sampler: the parent's decision for children, ``root`` for roots (OTEP 235).

    A child (a span with a valid parent, local or remote) is kept exactly when its parent is
    sampled (trace-flags 0x01): the decision never differs along a trace. Its ``ot=th`` threshold
    is the parent's when that threshold can be checked and passes, i.e. when there is a randomness
    value - explicit ``rv`` in the parent's ``ot=`` tracestate, else the trace id's low 56 bits
    *only if* the parent carries the W3C random-trace-id flag (0x02) - and ``randomness >= th``
    (the specification's consistency check for parent-based samplers). Otherwise the child is kept
    without ``th`` (unknown probability: no adjusted count), as the specification requires of a
    parent-based sampler whose parent's threshold is absent or apparently inconsistent; a trace id
    that nobody flagged random is never read as randomness. A SERVER span under a sampled remote
    parent (a request a router or proxy traced) carries ``llm.sampling.reason=parent``.

    The SDK's ``composable_parent_threshold`` differs in two ways this class exists for: it reads
    the trace id as randomness whatever the flags say, and it decides a child by comparing the
    parent's ``th`` with that randomness, so a child could be dropped under a sampled parent.
    """

    def __init__(self, root: ComposableSampler) -> None:
        self.root = root
        self._description = f"LlmOtelParentThreshold{{root={root.get_description()}}}"

    def sampling_intent(
        self,
        parent_ctx: Context | None,
        name: str,
        span_kind: SpanKind | None,
        attributes: Attributes,
        links: Sequence[Link] | None,
        trace_state: TraceState | None = None,
    ) -> SamplingIntent:
        parent = trace.get_current_span(parent_ctx).get_span_context()
        if not parent.is_valid:
            return self.root.sampling_intent(parent_ctx, name, span_kind, attributes, links, trace_state)
        if not parent.trace_flags.sampled:
            return _DROP
        reason = _PARENT_REASON if parent.is_remote and span_kind is SpanKind.SERVER else None
        ot = OtelTraceState.parse(trace_state)
        threshold = ot.threshold
        if is_valid_threshold(threshold) and threshold != MAX_THRESHOLD:
            if is_valid_random_value(ot.random_value):
                randomness: int | None = ot.random_value
            elif parent.trace_flags & _RANDOM_FLAG:
                randomness = parent.trace_id & _LOW_56
            else:
                randomness = None
            if threshold == MIN_THRESHOLD or (randomness is not None and randomness >= threshold):
                # th:0 (probability 1) holds for any randomness; otherwise the composite sampler
                # compares the same randomness (rv, else the trace id) and keeps the span
                return SamplingIntent(threshold=threshold, threshold_reliable=True, attributes=reason)
            # erase the parent's th: the composite sampler leaves an `ot` entry it has nothing
            # to write into untouched, so the th-only entry goes here
            return SamplingIntent(MIN_THRESHOLD, False, reason, _without_lone_th)
        return SamplingIntent(threshold=MIN_THRESHOLD, threshold_reliable=False, attributes=reason)

    def get_description(self) -> str:
        return self._description


def adaptive_sampler(
    policy: UtilizationPolicy | None = None,
    poller: UtilizationReader | SignalSource | None = None,
    drift: DriftDetector | None = None,
    budget: TraceBudget | None = None,
    random_trace_ids: bool = True,
) -> Sampler:
    """A complete SDK sampler: the parent's decision for children (:class:`ParentThreshold`),
    :class:`AdaptiveRootSampler` for roots.

    ``random_trace_ids``: whether the tracer provider's ``IdGenerator`` makes trace ids whose low
    56 bits are random (the SDK's default ``RandomIdGenerator``: True, and the SDK then sets the
    W3C random-trace-id flag on roots). With False, each root gets explicit randomness (a random
    ``rv`` in its ``ot=`` tracestate, OTEP 235) and the decision uses it, not the trace id.

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
    root = AdaptiveRootSampler(policy, poller, drift, budget)
    # a poller reading engine occupancy (the default where NVML sees no GPU): engines attach to it
    source = getattr(root.poller, "source", None)
    return _AdaptiveSampler(root, source if isinstance(source, EngineOccupancy) else None, random_trace_ids)


class _AdaptiveSampler(Sampler):
    """SDK Sampler around the SDK's composite sampler that (a) hands it the parent's tracestate -
    the SDK tracer does not pass one, so children would lose ``th`` - and (b) keeps the span's own
    attributes: the SDK uses the sampler's result attributes as the span's attributes, and the
    experimental composite sampler returns only the intent's."""

    def __init__(
        self, root: AdaptiveRootSampler, occupancy: EngineOccupancy | None = None, random_trace_ids: bool = True
    ) -> None:
        self.root = root
        self.random_trace_ids = random_trace_ids
        # what this sampler was built with, for the telemetry core (drift listener, engine load)
        self.sampling = Sampling(root, occupancy)
        self._inner = composite_sampler(ParentThreshold(root))

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if trace_state is None:
            parent = trace.get_current_span(parent_context).get_span_context()
            if parent.is_valid:
                trace_state = parent.trace_state
            elif not self.random_trace_ids:
                # a root whose trace id is not random: explicit randomness (OTEP 235 `rv`), which
                # the composite sampler prefers to the trace id and writes to the span's tracestate
                trace_state = TraceState([("ot", f"rv:{random.getrandbits(56):014x}")])
        result = self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if attributes:
            merged = dict(attributes)
            merged.update(result.attributes)
            return SamplingResult(result.decision, merged, result.trace_state)
        return result

    def get_description(self) -> str:
        return self._inner.get_description()


class Sampling:
    """What llm-otel's adaptive sampler was built with, handed to the telemetry core explicitly
    (``build_providers_and_sampling`` returns it; ``instrument()`` passes it to ``Telemetry``).

    Attributes:
        root: the :class:`AdaptiveRootSampler` (its ``drift`` detector learns from every request).
        poller: what the root reads utilisation from (a ``UtilizationPoller`` or None).
        occupancy: the :class:`~llm_otel.sampling.occupancy.EngineOccupancy` the poller reads when
            the sampler follows engine load instead of a GPU (engines attach to it), else None.
        listener: the request-lifecycle listener feeding ``root.drift`` (TTFT, TPOT at finish).
    """

    __slots__ = ("root", "occupancy", "listener")

    def __init__(self, root: AdaptiveRootSampler, occupancy: EngineOccupancy | None = None) -> None:
        self.root = root
        self.occupancy = occupancy
        self.listener = DriftListener(root.drift)

    @property
    def poller(self) -> UtilizationReader | None:
        return self.root.poller

    @property
    def gpu_poller(self) -> UtilizationReader | None:
        """The poller when it reads GPU utilisation (signals share it), None for engine occupancy."""
        return self.poller if self.occupancy is None else None

    def stop(self) -> None:
        """Stop the poller's thread (a forked process that builds its own)."""
        if self.poller is not None:
            self.poller.stop()


def sampling_of(tracer_provider: object) -> Sampling | None:
    """The :class:`Sampling` of a tracer provider the application built with llm-otel's
    :func:`adaptive_sampler` (``TracerProvider(sampler=adaptive_sampler())``), else None: a
    provider with any other sampler gets no drift detector and no engine-load signal."""
    sampler = getattr(tracer_provider, "sampler", None)
    return sampler.sampling if isinstance(sampler, _AdaptiveSampler) else None


def decides_children_by_parent(sampler) -> bool:
    """True for samplers whose decision for a child with a valid parent depends on the parent
    alone (whatever the child's name and attributes): the SDK's ``StaticSampler`` (always_on/off),
    ``ParentBased`` with its default delegates for parents (and its ``TraceIdRatio`` root
    variant), llm-otel's adaptive sampler (parent threshold for children)."""
    from opentelemetry.sdk.trace import sampling

    if type(sampler) in (sampling.StaticSampler, _AdaptiveSampler):
        return True
    if type(sampler) in (sampling.ParentBased, sampling.ParentBasedTraceIdRatio):
        return all(
            type(getattr(sampler, name, None)) is sampling.StaticSampler
            for name in (
                "_remote_parent_sampled",
                "_remote_parent_not_sampled",
                "_local_parent_sampled",
                "_local_parent_not_sampled",
            )
        )
    return False


def traces_sampler_factory(arg: str | None = None, traces_per_s: float | None = None) -> Sampler:
    """``opentelemetry_traces_sampler`` entry point (``OTEL_TRACES_SAMPLER=llm_otel_adaptive``).

    ``OTEL_TRACES_SAMPLER_ARG``: ``floor[,ceiling]`` probabilities, e.g. ``0.01,1``. The trace
    budget is ``traces_per_s`` (llm-otel's providers pass their settings'), else
    ``LLM_OTEL_TRACES_PER_S`` from the environment (the SDK configurator passes only ``arg``).
    Raises ConfigError for a bad argument or budget.
    """
    from llm_otel.config import ConfigError
    from llm_otel.config import traces_per_s as configured_traces_per_s

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
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: expected 'floor[,ceiling]' with 0 < floor <= ceiling <= 1")
    if traces_per_s is None:
        traces_per_s = configured_traces_per_s()
    budget = trace_budget(traces_per_s)
    return adaptive_sampler(UtilizationPolicy(floor=floor, ceiling=ceiling), budget=budget)
