"""Adaptive consistent-probability sampling: codec, consistency, parent/child agreement,
unbiased adjusted counts, drift boost, outliers, bad tracestate, NVML fallback."""

from __future__ import annotations

import math
import random
import threading

import pytest
from conftest import make_captured
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace._sampling_experimental._trace_state import OtelTraceState, serialize_th
from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

from llm_otel.config import Settings
from llm_otel.gpu.nvml import UtilizationPoller
from llm_otel.sampling import (
    AdaptiveRootSampler,
    DriftDetector,
    EngineOccupancy,
    UtilizationPolicy,
    adaptive_sampler,
    quantize_threshold,
    traces_sampler_factory,
    utilization_is_gpu,
)
from llm_otel.telemetry import Telemetry


class FixedSource:
    def __init__(self, value: float) -> None:
        self.value = value

    def read(self) -> float:
        return self.value


def poller_at(util: float) -> UtilizationPoller:
    p = UtilizationPoller(FixedSource(util), alpha=1.0)
    p.sample()
    return p


def decide(sampler, trace_id: int, parent=None, trace_state=None):
    return sampler.should_sample(parent, trace_id, "span", trace_state=trace_state)


def probability_of(result) -> float | None:
    th = OtelTraceState.parse(result.trace_state).threshold
    return None if th < 0 else (MAX_THRESHOLD - th) / MAX_THRESHOLD


@pytest.mark.parametrize("th, p", [("0", 1.0), ("c", 0.25), ("e666", 0.1), ("fd70a4", 0.01), ("aaab", 1 / 3)])
def test_thresholds_from_the_specification_parse_to_their_probability_and_serialise_back(th, p):
    threshold = OtelTraceState.parse(TraceState([("ot", f"th:{th}")])).threshold
    assert (MAX_THRESHOLD - threshold) / MAX_THRESHOLD == pytest.approx(p, rel=1e-4)
    assert serialize_th(threshold) == th


@pytest.mark.parametrize("p, th", [(1.0, "0"), (0.25, "c"), (0.5, "8"), (0.1, "e66")])
def test_quantised_thresholds_are_short_and_close(p, th):
    q = quantize_threshold(p)
    assert serialize_th(q) == th
    assert (MAX_THRESHOLD - q) / MAX_THRESHOLD == pytest.approx(p, abs=2**-12)


def test_policy_lowers_probability_with_utilisation_within_bounds_and_steps():
    policy = UtilizationPolicy(floor=0.01, ceiling=1.0, low=0.5, high=0.9, max_step=2.0, hysteresis=0.0, interval_s=1.0)
    assert policy.target(0.2) == 1.0 and policy.target(1.0) == pytest.approx(0.01)
    assert policy.update(1.0, now=0.0) == 0.5  # at most a factor 2 per interval
    assert policy.update(1.0, now=0.5) == 0.5  # not before the interval
    assert policy.update(1.0, now=1.0) == 0.25
    for t in range(2, 20):
        policy.update(1.0, now=float(t))
    assert policy.probability == pytest.approx(0.01)
    # no decision for 10 s while the load went away: one factor per elapsed interval, at once
    assert policy.update(0.0, now=29.0) == 1.0
    assert policy.update(1.0, now=29.5) == 1.0 and policy.update(1.0, now=30.0) == 0.5
    assert policy.update(1.0, now=31.5) == 0.25  # 1.5 intervals: still one factor
    assert policy.update(1.0, now=33.5) == 0.0625  # 2 intervals: two
    assert UtilizationPolicy(hysteresis=0.2).update(None) == 1.0  # no signal: base rate


def test_policy_hysteresis_ignores_small_moves():
    policy = UtilizationPolicy(floor=0.1, ceiling=1.0, low=0.0, high=1.0, hysteresis=0.2, interval_s=0.0)
    policy.update(0.5, now=0.0)
    p = policy.probability
    assert policy.update(0.52, now=1.0) == p


@pytest.mark.case("C27")
@settings(max_examples=200, deadline=None)
@given(st.integers(1, (1 << 128) - 1), st.floats(0.001, 1.0), st.floats(0.001, 1.0))
def test_consistency_higher_probability_keeps_a_superset(trace_id, p1, p2):
    lo, hi = sorted((p1, p2))
    keep = [
        decide(adaptive_sampler(UtilizationPolicy(floor=p, ceiling=p), poller=poller_at(0.0)), trace_id).decision
        == Decision.RECORD_AND_SAMPLE
        for p in (lo, hi)
    ]
    assert not keep[0] or keep[1]


def test_threshold_does_not_depend_on_the_traces_randomness():
    root = AdaptiveRootSampler(UtilizationPolicy(floor=0.3, ceiling=0.3), poller_at(0.0))
    thresholds = {root.sampling_intent(None, "s", None, {}, None).threshold for _ in range(100)}
    assert len(thresholds) == 1
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.3, ceiling=0.3), poller=poller_at(0.0))
    kept = [
        probability_of(r)
        for r in (decide(sampler, random.getrandbits(128)) for _ in range(500))
        if r.decision == Decision.RECORD_AND_SAMPLE
    ]
    assert kept and len(set(kept)) == 1 and kept[0] == pytest.approx(0.3, abs=2**-12)


@pytest.mark.case("C27")
def test_children_in_another_process_reuse_the_parents_threshold():
    frontend = adaptive_sampler(UtilizationPolicy(floor=0.25, ceiling=0.25), poller=poller_at(0.0))
    engine_process = adaptive_sampler(UtilizationPolicy(floor=0.01, ceiling=0.01), poller=poller_at(1.0))
    agree = 0
    for _ in range(300):
        tid = random.getrandbits(128)
        root = decide(frontend, tid)
        # the frontend's root trace id is random (the SDK's RandomIdGenerator): its traceparent
        # carries the W3C random flag 0x02 next to the sampled flag
        flags = TraceFlags((1 if root.decision == Decision.RECORD_AND_SAMPLE else 0) | 0x02)
        parent_sc = SpanContext(tid, random.getrandbits(64) | 1, True, flags, root.trace_state or TraceState())
        parent = trace.set_span_in_context(trace.NonRecordingSpan(parent_sc))
        child = decide(engine_process, tid, parent=parent, trace_state=root.trace_state)
        assert child.decision == root.decision
        # the same parent without the random flag: the same decision, but its th cannot be checked
        # against a trace id nobody said was random, so the child carries none
        plain_sc = SpanContext(tid, parent_sc.span_id, True, TraceFlags(flags & 1), parent_sc.trace_state)
        plain = decide(engine_process, tid, parent=trace.set_span_in_context(trace.NonRecordingSpan(plain_sc)))
        assert plain.decision == root.decision
        if root.decision == Decision.RECORD_AND_SAMPLE:
            assert OtelTraceState.parse(child.trace_state).threshold == OtelTraceState.parse(root.trace_state).threshold
            assert OtelTraceState.parse(plain.trace_state).threshold == -1
            agree += 1
    assert agree > 30


def test_real_tracer_children_keep_their_attributes_and_the_roots_threshold():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=adaptive_sampler(UtilizationPolicy(floor=0.5, ceiling=0.5), poller=poller_at(0.0))
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for _ in range(20):
        with tracer.start_as_current_span("root", attributes={"a": 1}):
            with tracer.start_as_current_span("child", attributes={"b": 2}):
                pass
    spans = exporter.get_finished_spans()
    assert spans and len(spans) % 2 == 0
    for s in spans:
        assert s.context.trace_state.get("ot") == "th:8"
        assert s.attributes.get("a" if s.name == "root" else "b") in (1, 2)
    assert all(s.attributes["llm.sampling.reason"] == "head" for s in spans if s.name == "root")


def test_adjusted_counts_estimate_the_request_count_within_three_sigma_under_varying_load():
    rng = random.Random(7)
    source = FixedSource(0.0)
    poller = UtilizationPoller(source, alpha=1.0)
    policy = UtilizationPolicy(floor=0.02, ceiling=1.0, low=0.3, high=0.9, max_step=4.0, hysteresis=0.0, interval_s=0.0)
    sampler = adaptive_sampler(policy, poller=poller)
    root = sampler.root
    n, estimate, variance = 100_000, 0.0, 0.0
    for i in range(n):
        if i % 5_000 == 0:
            source.value = rng.random()
            poller.sample()
            root._next_update = 0.0  # re-evaluate the policy now (normally every 100 ms)
        result = decide(sampler, rng.getrandbits(128))
        p = root.current_probability() if result.decision != Decision.RECORD_AND_SAMPLE else probability_of(result)
        variance += (1 - p) / p
        if result.decision == Decision.RECORD_AND_SAMPLE:
            estimate += 1 / p
    assert abs(estimate - n) <= 3 * math.sqrt(variance)
    assert estimate != n  # some traces were dropped


def test_drift_detector_ignores_noise_boosts_on_sustained_rise_and_cools_down():
    rng = random.Random(3)
    d = DriftDetector(window_s=1.0, rise=0.15, consecutive=3, cooldown_s=5.0, min_samples=20)
    t = 0.0
    for _ in range(10):  # noise around 100 ms
        for _ in range(50):
            d.observe("ttft", 0.1 * (1 + rng.uniform(-0.05, 0.05)), now=t)
            t += 0.02
    assert d.boosts == 0 and not d.boosting(t)
    for _ in range(4):  # sustained +40 %
        for _ in range(50):
            d.observe("ttft", 0.14 * (1 + rng.uniform(-0.05, 0.05)), now=t)
            t += 0.02
    assert d.boosts == 1 and d.boosting(t)
    assert not d.boosting(t + 6.0)


def test_boost_raises_the_probability_to_one():
    drift = DriftDetector()
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.01, ceiling=0.01), poller=poller_at(1.0), drift=drift)
    drift.boost_until = float("inf")
    sampler.root._next_update = 0.0
    result = decide(sampler, 1)  # randomness 1: kept only at probability 1
    assert result.decision == Decision.RECORD_AND_SAMPLE
    assert result.attributes["llm.sampling.reason"] == "drift_boost"


def test_outliers_dropped_by_the_head_are_kept_as_linked_roots_without_threshold_and_metrics_count_all():
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.0001, ceiling=0.0001), poller=poller_at(1.0))
    cap = make_captured(Settings(outlier_ttft_s=0.5), sampler=sampler)
    assert cap.telemetry.sampling_root is sampler.root
    recs = []
    for i, (ttft, error) in enumerate([(0.1, None), (0.9, None), (0.1, "aborted")]):
        rec = cap.telemetry.start_request(
            f"r{i}", operation="chat", provider="vllm", model="m", arrival_s=1000.0, input_tokens=3
        )
        rec.mono_offset_ns = 0
        rec.on_tokens([1], 1000.0 + ttft)
        rec.error_type = error
        recs.append(rec)
        cap.telemetry.finish(rec, end_ns=int((1000.0 + ttft + 0.01) * 1e9))
    roots = [s for s in cap.finished() if s.parent is None]
    assert sorted(s.attributes["llm.request.id"] for s in roots) == ["r1", "r2"]
    for s in roots:
        assert s.attributes["llm.sampling.reason"] == "outlier"
        assert len(s.links) == 1 and s.links[0].context.trace_id != s.context.trace_id
        assert OtelTraceState.parse(s.context.trace_state).threshold < 0  # no th: no count bias
    assert len([s for s in cap.finished() if s.name == "llm.prompt"]) == 2
    (dur_ok,) = [p for p in cap.metric_points("gen_ai.server.request.duration") if "error.type" not in p.attributes]
    assert dur_ok.count == 2  # metrics count every request, sampled or not


@pytest.mark.parametrize("ts", ["ot=th:zz", "ot=th:" + "f" * 20, "ot=th:8;rv:xyz;foo:bar", "ot=" + "x" * 300])
def test_malformed_ot_tracestate_never_raises(ts):
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.5, ceiling=0.5), poller=poller_at(0.0))
    state = TraceState.from_header([ts])
    parent = trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(5, 7, True, TraceFlags(1), state)))
    result = decide(sampler, 5, parent=parent, trace_state=state)
    assert result.decision in (Decision.RECORD_AND_SAMPLE, Decision.DROP)


def test_a_failing_signal_source_reports_unavailable_and_the_sampler_uses_its_base_rate():
    class Broken:
        def read(self):
            raise OSError("NVML gone")

    poller = UtilizationPoller(Broken())
    assert poller.sample() is None and not poller.available and poller.utilization is None
    nvml = UtilizationPoller.from_nvml()  # no GPU on CI machines
    if nvml.source is None:
        assert not nvml.available
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.01, ceiling=1.0), poller=poller)
    assert decide(sampler, 1).decision == Decision.RECORD_AND_SAMPLE  # base = ceiling = 1


def test_otel_traces_sampler_entry_point(monkeypatch):
    """The SDK configurator (opentelemetry-instrument with a distro) and llm-otel's own providers."""
    from opentelemetry.sdk._configuration import _import_sampler

    from llm_otel.process.providers import build_providers

    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.05,0.5")
    sampler = _import_sampler("llm_otel_adaptive")
    assert sampler.root.policy.floor == 0.05 and sampler.root.policy.ceiling == 0.5
    tp, _ = build_providers(
        Settings(console="off"), env={"OTEL_TRACES_SAMPLER": "llm_otel_adaptive", "OTEL_TRACES_SAMPLER_ARG": "0.2"}
    )
    assert tp.sampler.root.policy.floor == 0.2


def test_utilization_gauge_and_providers_use_the_sampler_when_forced(monkeypatch):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from llm_otel.process.providers import build_providers, register_utilization_gauge

    tp, mp = build_providers(Settings(adaptive_sampling="on", console="off"), env={})
    assert tp.sampler.get_description().startswith("LlmOtelParentThreshold{root=LlmOtelAdaptive")
    tp2, _ = build_providers(Settings(adaptive_sampling="on", console="off"), env={"OTEL_TRACES_SAMPLER": "always_on"})
    assert not hasattr(tp2.sampler, "root")
    from opentelemetry.sdk.metrics import MeterProvider

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    register_utilization_gauge(provider, poller_at(0.75))
    data = reader.get_metrics_data()
    (metric,) = [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    assert metric.name == "hw.gpu.utilization" and metric.data.data_points[0].value == 0.75
    assert isinstance(tp, TracerProvider) and Telemetry is not None


def test_a_lasting_latency_shift_boosts_once_then_becomes_the_baseline():
    d = DriftDetector(window_s=1.0, rise=0.15, consecutive=3, cooldown_s=5.0, min_samples=20)
    t = 0.0
    for level, windows in ((0.1, 6), (0.2, 60)):
        for _ in range(windows):
            for _ in range(25):
                d.observe("ttft", level, now=t)
                t += 1.0 / 25
    assert d.boosts == 1 and not d.boosting(t)


def test_sparse_windows_break_the_run_of_drifting_windows():
    d = DriftDetector(window_s=1.0, rise=0.15, consecutive=3, cooldown_s=5.0, min_samples=20)
    t = 0.0
    for _ in range(4):
        for _ in range(25):
            d.observe("ttft", 0.1, now=t)
            t += 0.04
    for i in range(8):  # drifting windows alternating with near-empty ones
        n = 25 if i % 2 == 0 else 2
        for _ in range(n):
            d.observe("ttft", 0.2, now=t)
            t += 1.0 / n
    assert d.boosts == 0


def test_a_tiny_floor_still_keeps_traces():
    assert quantize_threshold(1e-5) < MAX_THRESHOLD
    sampler = adaptive_sampler(UtilizationPolicy(floor=1e-5, ceiling=1e-5), poller=poller_at(1.0))
    kept = sum(decide(sampler, random.getrandbits(128)).decision == Decision.RECORD_AND_SAMPLE for _ in range(40_000))
    assert kept > 0


@pytest.mark.parametrize("arg", ["2", "0", "nan", "0.1,0.05", "lots"])
def test_bad_sampler_arguments_raise_config_error(arg):
    from llm_otel.config import ConfigError

    with pytest.raises(ConfigError, match="OTEL_TRACES_SAMPLER_ARG"):
        traces_sampler_factory(arg)


def test_policy_rejects_negative_hysteresis_or_interval_and_a_base_outside_0_1():
    for kwargs in ({"hysteresis": -1}, {"interval_s": -1}, {"base": 5}, {"base": 0}):
        with pytest.raises(ValueError):
            UtilizationPolicy(**kwargs)


def test_reason_and_threshold_change_together():
    drift = DriftDetector()
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.01, ceiling=0.01), poller=poller_at(1.0), drift=drift)
    decide(sampler, 1)
    drift.boost_until = float("inf")  # boost starts between two policy evaluations
    result = decide(sampler, (1 << 56) - 1)  # kept at any p
    assert result.attributes["llm.sampling.reason"] == "head"
    assert OtelTraceState.parse(result.trace_state).threshold != 0


def test_a_bare_signal_source_is_wrapped_in_a_started_poller():
    """docs/sampling.md: queue depth, KV usage... plug in as a SignalSource with read() -> [0, 1]."""

    class QueueDepth:
        def read(self) -> float:
            return 1.0

    sampler = adaptive_sampler(
        UtilizationPolicy(floor=0.01, ceiling=1.0, interval_s=0.0, hysteresis=0.0), poller=QueueDepth()
    )
    poller = sampler.root.poller
    try:
        assert isinstance(poller, UtilizationPoller) and isinstance(poller.source, QueueDepth)
        assert poller._thread is not None and poller._thread.is_alive()  # started: it will be read
        assert poller.utilization is None
        assert decide(sampler, 1).decision == Decision.RECORD_AND_SAMPLE  # no reading yet: base rate 1
        poller.sample()  # what the poller thread does every period_s
        sampler.root._next_update = 0.0
        assert sampler.root.current_probability() == pytest.approx(0.5, abs=2**-12)  # one step toward floor
        provider = TracerProvider(sampler=sampler)
        with provider.get_tracer("t").start_as_current_span("root"):
            pass  # a span can be created (it used to raise AttributeError: no .utilization)
    finally:
        poller.stop()


@pytest.mark.parametrize("bad", [0.5, "gpu", object(), lambda: 0.5])
def test_a_poller_that_is_neither_a_poller_nor_a_source_is_rejected_at_construction(bad):
    with pytest.raises(TypeError, match="UtilizationPoller .* or a SignalSource"):
        adaptive_sampler(poller=bad)
    with pytest.raises(TypeError):
        AdaptiveRootSampler(poller=bad)


@pytest.mark.parametrize("utilization", [float("nan"), "high", RuntimeError("gone")])
def test_an_unusable_utilization_is_the_base_rate_and_never_raises_from_should_sample(utilization, caplog):
    class Weird:
        @property
        def utilization(self):
            if isinstance(utilization, Exception):
                raise utilization
            return utilization

    sampler = adaptive_sampler(UtilizationPolicy(floor=0.01, ceiling=0.5, base=0.5), poller=Weird())
    with caplog.at_level("WARNING", logger="llm_otel"):
        for _ in range(2):
            sampler.root._next_update = 0.0
            result = decide(sampler, (1 << 56) - 1)  # randomness at the top: kept at any p > 0
            assert result.decision == Decision.RECORD_AND_SAMPLE
            assert probability_of(result) == pytest.approx(0.5)
    warnings = [r for r in caplog.records if "sampler utilisation unusable" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is None


def test_engine_occupancy_is_the_fullest_engines_batch_capped_and_drops_gone_or_broken_engines(caplog):
    occ = EngineOccupancy()
    assert occ.read() == 0.0  # nothing attached: nothing served, the sampler stays at its base rate
    live = {"a": (3, 8)}
    occ.attach(lambda: live.get("a"))
    occ.attach(lambda: (300, 256))  # a queue behind a full batch
    assert occ.read() == 1.0
    occ._sources.pop()
    assert occ.read() == 3 / 8
    del live["a"]  # the engine was collected: its source answers None and is dropped
    assert occ.read() == 0.0 and occ.engines == 0

    def broken():
        raise RuntimeError("engine state changed shape")

    occ.attach(broken)
    occ.attach(lambda: (1, 0))  # no capacity known: ignored, not a division by zero
    with caplog.at_level("WARNING", logger="llm_otel"):
        assert occ.read() == 0.0
    assert occ.engines == 1 and "engine occupancy source failed" in caplog.text


def test_without_nvml_the_default_sampler_follows_engine_occupancy_and_telemetry_attaches_engines():
    from llm_otel.process.providers import build_providers

    tp, mp = build_providers(Settings(console="off"), env={})  # auto, on a machine without a GPU
    poller = tp.sampler.root.poller
    if not isinstance(poller.source, EngineOccupancy):
        pytest.skip("NVML sees a GPU here: the sampler follows GPU utilisation")
    try:
        assert not utilization_is_gpu(poller)
        telemetry = Telemetry(tp, mp, Settings(console="off"))
        assert telemetry.signals.poller is None  # occupancy is not GPU utilisation for the health score
        assert poller._thread is None  # no engine yet: no polling thread
        assert telemetry.attach_engine_load(lambda: (512, 256)) and poller.source.engines == 1
        assert poller._thread.is_alive() and poller._thread.name == "llm-otel-occupancy-poller"
        telemetry.attach_engine_load(lambda: (0, 256))
        thread = poller._thread
        assert [t for t in threading.enumerate() if t.name == thread.name].count(thread) == 1
        root = tp.sampler.root
        root.policy.interval_s = 0.0  # the default halves at most once a second: not in a unit test
        for step in range(12):  # a saturated engine: the probability halves per interval
            poller.sample()
            root._next_update = 0.0
            p = root.current_probability()
        assert poller.utilization > 0.95 and p < 0.05
        ids = [random.getrandbits(128) | 1 for _ in range(2000)]
        kept = sum(decide(tp.sampler, t).decision == Decision.RECORD_AND_SAMPLE for t in ids)
        assert kept < 200
        off, _ = build_providers(Settings(adaptive_sampling="off", console="off"), env={})
        assert not hasattr(off.sampler, "root")
        plain = Telemetry(off, mp, Settings(console="off"))
        assert not plain.attach_engine_load(lambda: (1, 1))
    finally:
        poller.stop()
        tp.shutdown()


def test_the_occupancy_poller_stops_with_its_tracer_provider():
    import gc

    from llm_otel.process.providers import build_providers

    tp, mp = build_providers(Settings(console="off"), env={})
    poller = tp.sampler.root.poller
    if not isinstance(poller.source, EngineOccupancy):
        pytest.skip("NVML sees a GPU here")
    poller.source.attach(lambda: (1, 2))
    assert poller._thread.is_alive()
    tp.shutdown()
    del tp
    gc.collect()
    poller._thread.join(timeout=5)
    assert not poller._thread.is_alive()
