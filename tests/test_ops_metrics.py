"""Operations metrics: per-request instruments, exemplars, bounded error.type, engine-state metrics
from vLLM's own SchedulerStats, engine phase, GPU gauges (absent without NVML), the sampling
probability gauge, and the Prometheus exposition (names, exemplars, one port per process)."""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import time
import types
import urllib.request

import pytest
from conftest import EXACT, HAS_VLLM, make_captured
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased

from llm_otel.config import ConfigError, Settings
from llm_otel.instrumentation.vllm.carrier import step_has_prefill
from llm_otel.instrumentation.vllm.engine_core import scheduler_state
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.engine_state import DECODE, IDLE, PREFILL, EngineStateMetrics, PhaseClock
from llm_otel.telemetry.metrics import MAX_ERROR_TYPES, OTHER, sampling_probability_reader

prom = pytest.importorskip("opentelemetry.exporter.prometheus")


def _finished(cap, *, steps=((0.0, 1),), arrival_ago=1.0, error=None, reason="stop", model="m"):
    """A request whose tokens came at engine-monotonic offsets ``steps`` (s after `base`, count)."""
    tel = cap.telemetry
    rec = tel.start_request(
        "r",
        operation="text_completion",
        provider="vllm",
        model=model,
        arrival_s=time.time() - arrival_ago,
        input_tokens=5,
    )
    base = time.monotonic() - 0.5
    for offset, n in steps:
        rec.on_tokens(list(range(n)), base + offset)
    rec.finish_reason = reason
    rec.error_type = error
    tel.finish(rec)
    return rec


def _points(cap, name):
    return cap.metric_points(name)


# --- per-request instruments -------------------------------------------------------------------
def test_inter_token_latency_is_one_observation_per_token_step_after_the_first(captured):
    _finished(captured, steps=((0.0, 1), (0.1, 1), (0.3, 2), (0.35, 1)))
    (point,) = _points(captured, M.LLM_SERVER_INTER_TOKEN_LATENCY)
    assert point.count == 3
    assert point.sum == pytest.approx(0.1 + 0.2 / 2 + 0.05)
    assert point.max == pytest.approx(0.1)


def test_inter_token_latency_by_default_keeps_one_gap_in_16_from_a_random_offset():
    """LLM_OTEL_ITL_SAMPLE_EVERY (16): systematic sampling - a request with 32 gaps records exactly
    2, one with 3 gaps 0 or 1 (3/16 on average); every kept value is one of the request's gaps and
    each gap position is kept equally often, so the mean (and any quantile) is unbiased."""
    cap = make_captured(Settings.from_env({}))
    assert cap.telemetry.instruments.itl_every == 16
    # 33 steps, gap i (1-based) is i ms: all gaps distinct
    steps = [(sum(range(i + 1)) / 1000, 1) for i in range(33)]
    n = 320
    for _ in range(n):
        _finished(cap, steps=steps)
    (point,) = _points(cap, M.LLM_SERVER_INTER_TOKEN_LATENCY)
    assert point.count == 2 * n
    # the mean gap is 16.5 ms over all positions; 640 draws of offsets uniform over 16
    assert point.sum / point.count == pytest.approx(0.0165, abs=0.0015)
    assert 0.001 - 1e-9 <= point.min and point.max <= 0.032 + 1e-9
    short = make_captured(Settings.from_env({}))
    for _ in range(1600):
        _finished(short, steps=((0.0, 1), (0.01, 1), (0.02, 1), (0.03, 1)))
    (point,) = _points(short, M.LLM_SERVER_INTER_TOKEN_LATENCY)
    assert 300 - 75 <= point.count <= 300 + 75  # 1600 x 3/16, binomial sd ~16


def test_output_token_rate_is_output_tokens_over_request_duration(captured):
    rec = _finished(captured, steps=((0.0, 1), (0.1, 3)))
    (point,) = _points(captured, M.LLM_SERVER_OUTPUT_TOKEN_RATE)
    (duration,) = _points(captured, M.GEN_AI_SERVER_REQUEST_DURATION)
    assert rec.num_output_tokens == 4
    assert point.count == 1 and point.sum == pytest.approx(4 / duration.sum)


def test_requests_counted_by_finish_reason_and_error_type(captured):
    _finished(captured, reason="length")
    _finished(captured, reason="length")
    _finished(captured, reason="abort", error="aborted")
    counts = {
        (p.attributes.get(A.LLM_RESPONSE_FINISH_REASON), p.attributes.get(A.ERROR_TYPE)): p.value
        for p in _points(captured, M.LLM_SERVER_REQUESTS)
    }
    assert counts == {("length", None): 2, ("abort", "aborted"): 1}
    for p in _points(captured, M.LLM_SERVER_REQUESTS):
        assert A.LLM_REQUEST_ID not in p.attributes and A.GEN_AI_RESPONSE_MODEL not in p.attributes
    # failed requests record no ITL / token rate
    assert len(_points(captured, M.LLM_SERVER_OUTPUT_TOKEN_RATE)) == 1


def test_rejected_request_counted_with_error_type_and_no_finish_reason(captured):
    captured.telemetry.reject(
        operation="text_completion",
        provider="vllm",
        model="m",
        arrival_s=time.time(),
        error=ValueError("prompt too long"),
    )
    (point,) = _points(captured, M.LLM_SERVER_REQUESTS)
    assert point.value == 1 and point.attributes[A.ERROR_TYPE] == "ValueError"
    assert A.LLM_RESPONSE_FINISH_REASON not in point.attributes


@pytest.mark.case("C26")
def test_error_type_cardinality_is_bounded(captured, caplog):
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        for i in range(MAX_ERROR_TYPES + 5):
            _finished(captured, reason="error", error=f"Error{i}")
    types_seen = {p.attributes[A.ERROR_TYPE] for p in _points(captured, M.LLM_SERVER_REQUESTS)}
    assert len(types_seen) == MAX_ERROR_TYPES + 1 and OTHER in types_seen
    other = [p for p in _points(captured, M.LLM_SERVER_REQUESTS) if p.attributes[A.ERROR_TYPE] == OTHER]
    assert other[0].value == 5
    assert sum("distinct error.type" in r.getMessage() for r in caplog.records) == 1


# --- exemplars ----------------------------------------------------------------------------------
def test_latency_histograms_carry_the_sampled_requests_trace_id(captured):
    rec = _finished(captured, steps=((0.0, 1), (0.1, 1)))
    trace_id = rec.span.get_span_context().trace_id
    data = captured.metrics.get_metrics_data()  # one collection: the SDK resets exemplars after each
    points = {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    for name in (
        M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
        M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
        M.GEN_AI_SERVER_REQUEST_DURATION,
        M.LLM_SERVER_INTER_TOKEN_LATENCY,
        M.LLM_SERVER_OUTPUT_TOKEN_RATE,
    ):
        (point,) = points[name]
        assert point.exemplars, name
        assert {e.trace_id for e in point.exemplars} == {trace_id}, name


def test_unsampled_requests_leave_no_exemplars_but_are_measured():
    cap = make_captured(sampler=ALWAYS_OFF)
    rec = _finished(cap, steps=((0.0, 1), (0.1, 1)))
    assert not rec.recording
    (point,) = _points(cap, M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
    assert point.count == 1 and not point.exemplars


def test_itl_exemplar_is_the_requests_largest_gap(captured):
    rec = _finished(captured, steps=((0.0, 1), (0.01, 1), (0.02, 1), (0.32, 1), (0.33, 1)))
    (point,) = _points(captured, M.LLM_SERVER_INTER_TOKEN_LATENCY)
    assert point.count == 4
    assert [e.value for e in point.exemplars] == [pytest.approx(0.3)]
    assert point.exemplars[0].trace_id == rec.span.get_span_context().trace_id


def test_unsampled_request_finished_inside_another_sampled_span_takes_no_exemplar_from_it():
    from opentelemetry import trace

    cap = make_captured(sampler=ALWAYS_OFF)
    app = TracerProvider().get_tracer("app").start_span("app work")  # sampled, current at finish
    with trace.use_span(app, end_on_exit=True):
        _finished(cap, steps=((0.0, 1), (0.1, 1)))
    data = cap.metrics.get_metrics_data()
    exemplars = [
        e
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
        for e in getattr(p, "exemplars", ())
    ]
    assert exemplars == []


# --- sampling probability -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampler, expected",
    [(TraceIdRatioBased(0.25), 0.25), (ParentBased(TraceIdRatioBased(0.1)), 0.1), (ParentBased(ALWAYS_OFF), 0.0)],
)
def test_sampling_probability_gauge_reports_the_sdk_samplers_probability(sampler, expected):
    cap = make_captured(sampler=sampler)
    assert cap.telemetry.instruments.observe_sampling(cap.tracer_provider)
    assert [p.value for p in _points(cap, M.LLM_OTEL_SAMPLING_PROBABILITY)] == [expected]


def test_sampling_probability_of_the_adaptive_sampler_follows_its_policy():
    from llm_otel.sampling import UtilizationPolicy, adaptive_sampler

    class Poller:
        utilization = None

    sampler = adaptive_sampler(UtilizationPolicy(floor=0.05, ceiling=0.5), poller=Poller())
    read = sampling_probability_reader(sampler)
    assert read() == pytest.approx(0.5, abs=1e-3)


def test_unknown_sampler_probability_is_absent_not_zero():
    class Custom(Sampler):
        def should_sample(self, *a, **k):
            raise NotImplementedError

        def get_description(self):
            return "custom"

    cap = make_captured(sampler=Custom())
    assert not cap.telemetry.instruments.observe_sampling(cap.tracer_provider)
    assert _points(cap, M.LLM_OTEL_SAMPLING_PROBABILITY) == []


# --- engine state from vLLM's SchedulerStats ----------------------------------------------------
def _engine_metrics():
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    return EngineStateMetrics(mp.get_meter("t")), reader


def _values(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = [(dict(p.attributes), p.value) for p in m.data.data_points]
    return out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_engine_state_from_real_vllm_scheduler_stats():
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    metrics, reader = _engine_metrics()
    first = PrefixCacheStats()
    first.record(num_tokens=64, num_hits=32, preempted=False)
    metrics.on_step_state(
        scheduler_state(
            SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.4, prefix_cache_stats=first)
        ),
        "tiny",
    )
    second = PrefixCacheStats()
    second.record(num_tokens=100, num_hits=0, preempted=False)
    second.record(num_tokens=50, num_hits=50, preempted=True)  # re-admitted after preemption: not counted
    metrics.on_step_state(
        scheduler_state(
            SchedulerStats(num_running_reqs=4, num_waiting_reqs=0, kv_cache_usage=0.5, prefix_cache_stats=second)
        ),
        "tiny",
    )
    attrs = {A.GEN_AI_PROVIDER_NAME: "vllm", A.GEN_AI_REQUEST_MODEL: "tiny"}
    values = _values(reader)
    assert values[M.LLM_SERVER_PREFIX_CACHE_QUERIES] == [(attrs, 164)]
    assert values[M.LLM_SERVER_PREFIX_CACHE_HITS] == [(attrs, 32)]
    assert values[M.LLM_SERVER_KV_CACHE_USAGE] == [(attrs, 0.5)]
    assert values[M.LLM_SERVER_REQUESTS_RUNNING] == [(attrs, 4)]
    assert values[M.LLM_SERVER_REQUESTS_WAITING] == [(attrs, 0)]


def test_engine_without_scheduler_stats_leaves_metrics_absent_with_one_log_line(caplog):
    metrics, reader = _engine_metrics()
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        for _ in range(5):
            metrics.on_step_state(scheduler_state(None), "tiny")
    assert _values(reader) == {}
    assert sum("no scheduler statistics" in r.getMessage() for r in caplog.records) == 1


def test_older_stats_without_kv_or_prefix_fields_leave_only_those_absent(caplog):
    @dataclasses.dataclass
    class OldSchedulerStats:  # shape of a stats object lacking kv_cache_usage and prefix_cache_stats
        num_running_reqs: int = 1
        num_waiting_reqs: int = 0

    metrics, reader = _engine_metrics()
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        metrics.on_step_state(scheduler_state(OldSchedulerStats()), "tiny")
        metrics.on_step_state(scheduler_state(OldSchedulerStats()), "tiny")
    values = _values(reader)
    assert M.LLM_SERVER_KV_CACHE_USAGE not in values and M.LLM_SERVER_PREFIX_CACHE_HITS not in values
    assert values[M.LLM_SERVER_REQUESTS_RUNNING][0][1] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("kv_cache_usage" in m for m in messages) == 1
    assert sum("prefix_cache_stats" in m for m in messages) == 1


# --- engine phase ------------------------------------------------------------------------------
def test_phase_is_what_covered_most_of_the_last_second():
    clock = PhaseClock(window_s=1.0)
    assert clock.phase(now=100.0) == IDLE
    clock.on_step(99.0, 99.3, prefill=True)
    clock.on_step(99.3, 99.9, prefill=False)
    assert clock.phase(now=99.9) == DECODE  # 0.6 decode, 0.3 prefill, 0.1 idle
    clock.on_step(99.9, 100.5, prefill=True)
    assert clock.phase(now=100.5) == PREFILL  # window 99.5-100.5: 0.4 decode, 0.6 prefill
    assert clock.phase(now=102.0) == IDLE


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_step_has_prefill_on_real_scheduler_outputs():
    from vllm.v1.core.sched.output import SchedulerOutput

    decode = SchedulerOutput.make_empty()
    decode.num_scheduled_tokens = {"a": 1, "b": 1}
    decode.total_num_scheduled_tokens = 2
    assert not step_has_prefill(decode)
    chunk = SchedulerOutput.make_empty()
    chunk.num_scheduled_tokens = {"a": 1, "b": 96}  # b continues a chunked prefill
    chunk.total_num_scheduled_tokens = 97
    assert step_has_prefill(chunk)
    spec = SchedulerOutput.make_empty()
    spec.num_scheduled_tokens = {"a": 4}
    spec.total_num_scheduled_tokens = 4
    spec.scheduled_spec_decode_tokens = {"a": [7, 8, 9]}  # 1 + 3 draft tokens: decode
    assert not step_has_prefill(spec)
    new = SchedulerOutput.make_empty()
    new.scheduled_new_reqs = [object()]
    assert step_has_prefill(new)


# --- GPU gauges ----------------------------------------------------------------------------------
class FakeNvml(types.ModuleType):
    """Stands in for ``pynvml`` (nvidia-ml-py: nvmlInit, nvmlDeviceGetCount,
    nvmlDeviceGetHandleByIndex, nvmlDeviceGetUtilizationRates(h).gpu in %,
    nvmlDeviceGetMemoryInfo(h).used/.total in bytes) - no GPU on CI machines."""

    def __init__(self, util=(30, 90), used=(1 << 30, 3 << 30), total=(8 << 30, 8 << 30)):
        super().__init__("pynvml")
        self.util, self.used, self.total = list(util), list(used), list(total)
        self.fail = False

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.util)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.fail:
            raise RuntimeError("NVMLError_GpuIsLost")
        return types.SimpleNamespace(gpu=self.util[h], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=self.used[h], total=self.total[h], free=self.total[h] - self.used[h])


def test_gpu_gauges_per_device_with_phase(monkeypatch):
    from llm_otel.gpu.metrics import register_gpu_metrics
    from llm_otel.gpu.nvml import NvmlSource

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    assert register_gpu_metrics(mp.get_meter("t"), lambda: DECODE, NvmlSource()) is not None
    values = _values(reader)
    assert sorted(values[M.LLM_GPU_UTILIZATION], key=lambda v: v[0][A.HW_ID]) == [
        ({A.HW_ID: "0", A.LLM_ENGINE_PHASE: DECODE}, 0.3),
        ({A.HW_ID: "1", A.LLM_ENGINE_PHASE: DECODE}, 0.9),
    ]
    assert sorted(v for _a, v in values[M.LLM_GPU_MEMORY_USAGE]) == [1 << 30, 3 << 30]
    assert sorted(v for _a, v in values[M.LLM_GPU_MEMORY_LIMIT]) == [8 << 30, 8 << 30]


def test_gpu_read_failure_gives_no_points_and_one_log_line(monkeypatch, caplog):
    from llm_otel.gpu.metrics import register_gpu_metrics
    from llm_otel.gpu.nvml import NvmlSource

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    register_gpu_metrics(mp.get_meter("t"), lambda: IDLE, NvmlSource())
    fake.fail = True
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        reader.get_metrics_data()
        values = _values(reader)
    assert not values.get(M.LLM_GPU_UTILIZATION)
    assert sum("NVML read failed" in r.getMessage() for r in caplog.records) == 1


def test_without_nvml_gpu_metrics_are_absent_with_one_log_line(monkeypatch, caplog):
    from llm_otel.gpu.metrics import register_gpu_metrics

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        assert register_gpu_metrics(mp.get_meter("t"), lambda: IDLE) is None
    assert _values(reader) == {}
    assert sum("GPU metrics absent" in r.getMessage() for r in caplog.records) == 1


# --- Prometheus exposition ----------------------------------------------------------------------
def _exposition(telemetry_setup, openmetrics=True) -> str:
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    registry = telemetry_setup
    return (generate_openmetrics if openmetrics else generate_latest)(registry).decode()


@pytest.fixture
def prom_telemetry():
    from prometheus_client import CollectorRegistry

    from llm_otel.export.prometheus import ExemplarPrometheusMetricReader

    registry = CollectorRegistry(auto_describe=False)
    reader = ExemplarPrometheusMetricReader(registry=registry)
    mp = MeterProvider(metric_readers=[reader])
    tp = TracerProvider()
    telemetry = Telemetry(tp, mp, Settings.from_env(EXACT))
    cap = types.SimpleNamespace(telemetry=telemetry)
    yield registry, cap
    mp.shutdown()


DOCUMENTED_NAMES = [  # docs/operations.md, "Metrics" - as Prometheus shows them
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
    "llm_server_request_queue_time_seconds",
    "llm_server_inter_token_latency_seconds",
    "llm_server_output_token_rate_per_second",
    "llm_server_token_usage",
    "llm_server_requests",
]


def test_prometheus_names_and_exemplar_on_the_bucket_holding_the_value(prom_telemetry):
    registry, cap = prom_telemetry
    rec = cap.telemetry.start_request(
        "r", operation="text_completion", provider="vllm", model="m", arrival_s=time.time() - 0.3, input_tokens=2
    )
    base = time.monotonic()
    rec.on_tokens([1], base - 0.2)
    rec.on_tokens([2], base - 0.14)  # ITL 0.06 s -> bucket le=0.075
    rec.queued_mono, rec.scheduled_mono = base - 0.29, base - 0.28
    rec.finish_reason = "stop"
    cap.telemetry.finish(rec)
    text = _exposition(registry)
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert set(DOCUMENTED_NAMES) <= families
    trace_id = f"{rec.span.get_span_context().trace_id:032x}"
    itl = [line for line in text.splitlines() if line.startswith("llm_server_inter_token_latency_seconds_bucket")]
    with_exemplar = [line for line in itl if "# {" in line]
    assert len(with_exemplar) == 1
    assert 'le="0.075"' in with_exemplar[0] and f'trace_id="{trace_id}"' in with_exemplar[0]
    # the classic text format has no exemplars
    assert "trace_id" not in _exposition(registry, openmetrics=False)


def _itl_exemplar_lines(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line.startswith("llm_server_inter_token_latency_seconds_bucket") and "# {" in line
    ]


def _finish_with_itl(cap, gap_s: float):
    rec = cap.telemetry.start_request(
        "r", operation="text_completion", provider="vllm", model="m", arrival_s=time.time() - 0.3, input_tokens=2
    )
    base = time.monotonic()
    rec.on_tokens([1], base - 0.2)
    rec.on_tokens([2], base - 0.2 + gap_s)
    rec.finish_reason = "stop"
    cap.telemetry.finish(rec)
    return f"{rec.span.get_span_context().trace_id:032x}"


def test_exemplars_survive_repeated_scrapes_of_either_format(prom_telemetry):
    """Every scrape collects (and the SDK then empties its reservoirs); exemplars are state of the
    histogram, not consumed by a scrape: a second scraper or a plain-text `curl` takes none away."""
    registry, cap = prom_telemetry
    first = _finish_with_itl(cap, 0.06)  # bucket le=0.075
    for _ in range(2):  # OpenMetrics twice
        lines = _itl_exemplar_lines(_exposition(registry))
        assert len(lines) == 1 and 'le="0.075"' in lines[0] and f'trace_id="{first}"' in lines[0]
    second = _finish_with_itl(cap, 0.06)  # same bucket: the newer exemplar replaces the older
    assert "trace_id" not in _exposition(registry, openmetrics=False)  # text first: shows none, takes none
    lines = _itl_exemplar_lines(_exposition(registry))
    assert len(lines) == 1 and f'trace_id="{second}"' in lines[0]
    third = _finish_with_itl(cap, 0.35)  # another bucket (le=0.4): both buckets carry their latest
    assert "trace_id" not in _exposition(registry, openmetrics=False)
    for _ in range(2):
        lines = _itl_exemplar_lines(_exposition(registry))
        by_le = {line.split('le="')[1].split('"')[0]: line for line in lines}
        assert set(by_le) == {"0.075", "0.4"}, lines
        assert f'trace_id="{second}"' in by_le["0.075"] and f'trace_id="{third}"' in by_le["0.4"]


def test_prometheus_port_per_process_role():
    from llm_otel.process.ports import prometheus_port

    env = {"OTEL_EXPORTER_PROMETHEUS_PORT": "9500"}
    assert prometheus_port(env, "frontend") == 9500
    assert prometheus_port(env, "engine_core", "EngineCore_DP0") == 9501
    assert prometheus_port(env, "engine_core", "EngineCore_DP3") == 9504
    assert prometheus_port(env, "engine_core", "EngineCore") == 9501
    assert prometheus_port(env, "worker", "VllmWorker-0") is None
    assert prometheus_port({}, "frontend") == 9464
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_PROMETHEUS_PORT"):
        prometheus_port({"OTEL_EXPORTER_PROMETHEUS_PORT": "http"}, "frontend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_build_providers_serves_prometheus_when_asked():
    from llm_otel.process.providers import build_providers

    port = _free_port()
    env = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_TRACES_EXPORTER": "none",
    }
    tp, mp = build_providers(Settings.from_env({}), env)
    try:
        mp.get_meter("t").create_counter("llm_otel.test.probe").add(3)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "llm_otel_test_probe_total" in body and " 3.0" in body
    finally:
        tp.shutdown()
        mp.shutdown()


def test_busy_port_is_logged_and_leaves_metrics_unexposed(caplog):
    from llm_otel.process.ports import prometheus_reader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="llm_otel"):
            reader = prometheus_reader(
                {"OTEL_EXPORTER_PROMETHEUS_PORT": str(port), "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"}, "frontend"
            )
    assert reader is None
    assert sum("cannot serve Prometheus metrics" in r.getMessage() for r in caplog.records) == 1


def test_instrument_rejects_a_bad_prometheus_port():
    import llm_otel

    with pytest.raises(ConfigError, match="prometheus_port"):
        llm_otel.instrument(prometheus_port=70000)


def test_doctor_reports_the_prometheus_ports_and_a_busy_one():
    import io

    from llm_otel.cli import doctor

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1] - 1  # the engine core's port (port + 1) is taken
        out = io.StringIO()
        code = doctor(
            {
                "OTEL_METRICS_EXPORTER": "prometheus",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
                "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                "OTEL_TRACES_EXPORTER": "none",
            },
            out,
        )
    text = out.getvalue()
    assert code == 1
    assert f"frontend process would serve http://127.0.0.1:{port}/metrics" in text
    assert f"127.0.0.1:{port + 1} for the engine_core process is not available" in text
