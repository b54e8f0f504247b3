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
Children follow their parent's sampled flag (:class:`ParentThreshold`) and keep its threshold when
it can be checked (explicit ``rv``, or a trace id flagged random, W3C trace-flags 0x02) and
passes. The budget is shared by the API servers of one launcher (:class:`SharedTraceBudget`).
Spans started with ``llm.sampling.reason=outlier`` (a request the head decision dropped that ended
in error or breached an SLO) are kept without a threshold, so they do not bias adjusted counts,
within the budget's outlier bound (a token bucket of their own).

Usage: ``TracerProvider(sampler=adaptive_sampler())`` or ``OTEL_TRACES_SAMPLER=llm_otel_adaptive``.

Modules: :mod:`.policy` (utilisation -> probability, threshold quantisation), :mod:`.budget` (trace
budget), :mod:`.drift` (drift detector and its request-lifecycle listener), :mod:`.occupancy`
(engine occupancy, the default poller), :mod:`.sampler` (the composable root sampler, the SDK
wrapper, factories, and :class:`Sampling`: the parts a sampler was built with, which llm-otel's
providers return to ``instrument()`` for ``Telemetry``).
"""

from llm_otel.sampling.budget import SharedTraceBudget, TraceBudget, trace_budget
from llm_otel.sampling.drift import DriftDetector
from llm_otel.sampling.occupancy import (
    EngineOccupancy,
    default_poller,
    utilization_is_gpu,
)
from llm_otel.sampling.policy import QUANT_BITS, UtilizationPolicy, quantize_threshold
from llm_otel.sampling.sampler import (
    AdaptiveRootSampler,
    ParentThreshold,
    Sampling,
    adaptive_sampler,
    decides_children_by_parent,
    sampling_of,
    traces_sampler_factory,
)

__all__ = [
    "UtilizationPolicy",
    "DriftDetector",
    "AdaptiveRootSampler",
    "ParentThreshold",
    "EngineOccupancy",
    "TraceBudget",
    "SharedTraceBudget",
    "adaptive_sampler",
    "trace_budget",
    "traces_sampler_factory",
    "quantize_threshold",
    "Sampling",
    "sampling_of",
    "default_poller",
    "utilization_is_gpu",
    "decides_children_by_parent",
    "QUANT_BITS",
]
