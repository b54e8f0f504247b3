"""Serving signals without an engine: request classes, tier table, KV maths, VRAM pressure
hysteresis, health-score maths, /healthz, token efficiency, SLO checks (docs/signals.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import make_captured
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import SpanKind
from starlette.datastructures import Headers

from llm_otel.config import ConfigError
from llm_otel.config.classes import parse_class_sources
from llm_otel.config.tiers import TierTable
from llm_otel.gpu.nvml import UtilizationPoller
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.signals import Signals, SignalsConfig
from llm_otel.signals.classes import ClassExtractor
from llm_otel.signals.health import HealthScore, HealthServer, score
from llm_otel.signals.kv import KVSpec
from llm_otel.signals.pressure import PressureMonitor
from llm_otel.telemetry import Telemetry

GIB = 1 << 30


def metric_points(reader: InMemoryMetricReader, name: str) -> list:
    data = reader.get_metrics_data()
    out = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.extend(m.data.data_points)
    return out


def headers(*pairs: tuple[str, str]) -> Headers:
    """A real Starlette ``Headers`` (what vLLM's OpenAI server hands the handler as raw_request.headers)."""
    return Headers(raw=[(k.lower().encode("latin-1"), v.encode("utf-8")) for k, v in pairs])


# --- request classes -----------------------------------------------------------------------------
def extractor(collapses=None, **kwargs) -> ClassExtractor:
    sources = parse_class_sources("tenant:X-Tenant-Id, priority:x-priority, operation:x-op")
    return ClassExtractor(
        sources, on_collapse=lambda d, r: collapses.append((d, r)) if collapses is not None else None, **kwargs
    )


def test_class_headers_are_read_case_insensitively():
    values, labels = extractor().extract(headers(("X-TENANT-ID", "acme"), ("x-priority", "high")))
    assert values == {"tenant": "acme", "priority": "high"} == labels


def test_missing_and_empty_class_headers_are_absent_not_other():
    collapses = []
    values, labels = extractor(collapses).extract(headers(("x-priority", "   "), ("other-header", "x")))
    assert values == {} and labels == {} and collapses == []


def test_duplicated_class_header_with_different_values_collapses_and_is_counted():
    collapses = []
    ex = extractor(collapses)
    values, _ = ex.extract(headers(("x-tenant-id", "acme"), ("x-tenant-id", "evil")))
    assert values == {"tenant": "other"} and collapses == [("tenant", "duplicate")]
    values, _ = ex.extract(headers(("x-tenant-id", "acme"), ("x-tenant-id", " acme ")))
    assert values == {"tenant": "acme"}  # the same value twice is not ambiguous


@pytest.mark.parametrize(
    "value, reason",
    [
        ("a" * 65, "oversized"),
        ("ａｃｍｅ", "invalid"),  # full-width letters: non-ASCII
        ("müller", "invalid"),
        ('acme"} or 1=1 --', "invalid"),  # label/PromQL injection
        ("acme,evil", "invalid"),  # combined duplicate header
        ("acme\r\nx-admin: 1", "invalid"),
        ("${jndi:ldap://x}", "invalid"),
        ("<script>", "invalid"),
    ],
)
def test_hostile_class_values_collapse_to_other(value, reason):
    collapses = []
    ex = extractor(collapses)
    # a plain mapping, as AsyncLLM trace headers arrive; starlette would refuse CR/LF itself
    values, labels = ex.extract({"x-tenant-id": value})
    assert values == {"tenant": "other"} == labels
    assert collapses == [("tenant", reason)]


def test_longest_accepted_value_is_kept():
    assert extractor().extract({"x-tenant-id": "a" * 64})[0] == {"tenant": "a" * 64}


def test_cardinality_bound_collapses_new_values_to_other_and_counts_them():
    collapses = []
    ex = extractor(collapses, max_values=3, reserved={"tenant": {"premium-co"}})
    seen = [ex.extract({"x-tenant-id": f"t{i}"}) for i in range(10)]
    assert [labels["tenant"] for _, labels in seen] == ["t0", "t1", "t2"] + ["other"] * 7
    # the span keeps the (valid) value; only the metric label is bounded
    assert [values["tenant"] for values, _ in seen] == [f"t{i}" for i in range(10)]
    assert collapses == [("tenant", "overflow")] * 7
    assert ex.extract({"x-tenant-id": "t1"})[1] == {"tenant": "t1"}  # admitted values stay
    assert ex.extract({"x-tenant-id": "premium-co"})[1] == {"tenant": "premium-co"}  # tier values always
    assert len({labels["tenant"] for _, labels in seen}) == 4


def test_engine_request_fields_as_class_sources():
    class LoRA:
        lora_name = "canary-7"

    class Request:  # vllm.v1.engine.EngineCoreRequest fields used: priority, lora_request
        priority = 0
        lora_request = LoRA()

    from llm_otel.instrumentation.vllm.fields import class_fields  # the vLLM adapter reads them

    ex = ClassExtractor(parse_class_sources("priority:engine:priority,revision:engine:lora"))
    assert ex.extract(None, class_fields(Request()))[0] == {"priority": "0", "revision": "canary-7"}


@pytest.mark.parametrize(
    "raw", ["tenant", "colour:x-colour", "tenant:bad header", "tenant:engine:foo", "tenant:a,tenant:b"]
)
def test_bad_class_header_config_is_refused(raw):
    with pytest.raises(ConfigError, match="LLM_OTEL_CLASS_HEADERS"):
        parse_class_sources(raw)


# --- tier table ----------------------------------------------------------------------------------
TIERS = """\
# tier     match                  targets
premium    priority=high          ttft=0.3 tpot=0.05
premium    tenant=acme            ttft=0.3 tpot=0.05
free       tenant=free&priority=low   ttft=1.2 e2e=30
standard   *                      ttft=0.8
"""


def test_tier_table_first_matching_rule_wins():
    table = TierTable.parse(TIERS, "test")
    assert table.tier_for({"priority": "high", "tenant": "free"}).name == "premium"
    assert table.tier_for({"tenant": "acme"}).targets == {"ttft": 0.3, "tpot": 0.05}
    assert table.tier_for({"tenant": "free", "priority": "low"}).name == "free"
    assert table.tier_for({"tenant": "free"}).name == "standard"
    assert TierTable.parse("gold tenant=a ttft=1", "t").tier_for({}).name == "default"
    assert table.reserved() == {"priority": {"high", "low"}, "tenant": {"acme", "free"}}


@pytest.mark.parametrize(
    "line, message",
    [
        ("premium priority=high", "expected 'tier match target=seconds"),
        ("premium colour=red ttft=1", "match term 'colour=red'"),
        ("premium tenant=a b ttft=1", "target 'b'"),
        ("premium tenant=a ttft=fast", "'fast' is not a number"),
        ("premium tenant=a ttft=-1", "seconds must be in"),
        ("premium tenant=a ttft=1 ttft=2", "given twice"),
        ('premium tenant="x" ttft=1', "can never occur"),
        ("premium tenant=b ttft=0.5", "other targets on line 2"),
    ],
)
def test_bad_tier_line_fails_naming_the_line(tmp_path, line, message):
    path = tmp_path / "tiers.conf"
    path.write_text("# comment\npremium tenant=a ttft=1\n" + line + "\n")
    with pytest.raises(ConfigError) as info:
        TierTable.from_env({"LLM_OTEL_TIERS_FILE": str(path)})
    assert f"{path} line 3" in str(info.value) and message in str(info.value)


def test_inline_tier_table_names_the_entry_and_both_sources_are_refused(tmp_path):
    assert TierTable.from_env({"LLM_OTEL_TIERS": "a tenant=x ttft=1; b * e2e=9"}).tier_for({}).name == "b"
    with pytest.raises(ConfigError, match="LLM_OTEL_TIERS line 2"):
        TierTable.from_env({"LLM_OTEL_TIERS": "a tenant=x ttft=1;b *"})
    with pytest.raises(ConfigError, match="both set"):
        TierTable.from_env({"LLM_OTEL_TIERS": "a * ttft=1", "LLM_OTEL_TIERS_FILE": "x"})
    with pytest.raises(ConfigError, match="cannot read"):
        TierTable.from_env({"LLM_OTEL_TIERS_FILE": str(tmp_path / "missing")})


def test_misconfigured_tier_table_fails_at_startup(monkeypatch):
    monkeypatch.setenv("LLM_OTEL_TIERS", "premium tenant=a ttft=1;broken")
    with pytest.raises(ConfigError, match="LLM_OTEL_TIERS line 2"):
        Telemetry(make_captured().tracer_provider, MeterProvider())


@pytest.mark.parametrize(
    "env",
    [
        {"LLM_OTEL_VRAM_WARN": "0.95", "LLM_OTEL_VRAM_CRITICAL": "0.9"},
        {"LLM_OTEL_HEALTH_WEIGHTS": "latency=1,cpu=2"},
        {"LLM_OTEL_HEALTH_WEIGHTS": "latency=0"},
        {"LLM_OTEL_MODEL_REVISION": "canary v2"},
        {"LLM_OTEL_VRAM_SOURCE": "disk"},
    ],
)
def test_bad_signal_settings_are_refused(env):
    with pytest.raises(ConfigError):
        SignalsConfig.from_env(env)


# --- KV-cache maths ------------------------------------------------------------------------------
def test_kv_bytes_count_whole_blocks():
    # Llama-2-7B-like: 32 layers, 32 KV heads, head dim 128, fp16, 16-token blocks
    spec = KVSpec(layers=32, kv_heads=32, head_dim=128, dtype_bytes=2, block_size=16, num_blocks=1000)
    assert spec.bytes_per_token == 524288  # 512 KiB per token
    assert spec.blocks(0) == 0 and spec.blocks(1) == 1 and spec.blocks(16) == 1 and spec.blocks(17) == 2
    assert spec.bytes(17) == 2 * 16 * 524288
    assert spec.capacity_bytes == 1000 * 16 * 524288


# --- VRAM pressure -------------------------------------------------------------------------------
def run(monitor: PressureMonitor, series: list[tuple[float, float]], start: float = 0.0) -> list[str]:
    """Feed (usage, seconds) segments at 1 s ticks; returns the level after each tick."""
    levels, t = [], start
    for usage, seconds in series:
        for _ in range(int(seconds)):
            levels.append(monitor.update(usage, t, "nvml"))
            t += 1.0
    return levels


def test_warn_needs_the_hold_time(caplog):
    m = PressureMonitor()
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        levels = run(m, [(0.5, 5), (0.85, 30), (0.85, 10)])
    assert levels[:35] == ["ok"] * 35 and levels[35:] == ["warn"] * 10
    lines = [r.getMessage() for r in caplog.records if "VRAM pressure" in r.getMessage()]
    assert lines == ["llm-otel: VRAM pressure ok -> warn (usage 0.85 from nvml)"]  # logged once


def test_short_spikes_and_flapping_never_raise_the_level():
    m = PressureMonitor()
    assert set(run(m, [(0.95, 9), (0.5, 1)] * 5 + [(0.81, 29), (0.79, 1)] * 3)) == {"ok"}
    assert m.transitions == []


def test_critical_then_recovery_steps_down_with_hysteresis(caplog):
    m = PressureMonitor()
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        levels = run(m, [(0.92, 11), (0.87, 60), (0.84, 35), (0.78, 60), (0.70, 31)])
    assert levels[9] == "ok"  # above critical for 9 s (warn needs 30 s)
    assert levels[10] == "critical"  # held >= 0.90 for 10 s: straight to critical
    assert set(levels[10:101]) == {"critical"}  # 0.87 >= 0.90 - 0.05 does not clear; 0.84 for < 30 s
    assert levels[101] == "warn"  # below 0.85 for 30 s; above warn for > 30 s
    assert set(levels[101:196]) == {"warn"}  # 0.78 is not below 0.80 - 0.05: stays warn
    assert levels[196] == "ok"  # below 0.75 for 30 s
    assert [(a, b) for _, a, b in m.transitions] == [("ok", "critical"), ("critical", "warn"), ("warn", "ok")]
    assert len([r for r in caplog.records if "VRAM pressure" in r.getMessage()]) == 3


def test_unavailable_reading_keeps_level_and_resets_hold():
    m = PressureMonitor(warn_hold_s=3, critical_hold_s=3)
    run(m, [(0.95, 2)])
    assert m.update(None, 2.0) == "ok"
    # the hold restarted after the gap: otherwise the first reading at t=3 would be critical
    assert run(m, [(0.95, 4)], start=3.0) == ["ok", "ok", "ok", "critical"]
    assert m.update(None, 10.0) == "critical"


# --- health score --------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_health_score_weighs_latency_errors_gpu_and_uptime_and_names_the_dominant_factor():
    clock = Clock()
    h = HealthScore(latency_target_s=1.0, max_error_rate=0.05, warmup_s=60, clock=clock)
    # no requests yet, no GPU, just started: (0.4 + 0.3 + 0.1 * 0) / 0.8
    assert h.compute() == (0.875, "uptime", {"latency": 1.0, "errors": 1.0, "gpu": None, "uptime": 0.0})
    clock.t += 120
    assert h.compute()[:2] == (1.0, "none")
    for i in range(40):  # p95 of 1..40 x 0.0375 s is 1.5 s: latency factor 2 - 1.5 = 0.5
        h.observe(0.0375 * (i + 1), error=False)
    h.observe(None, error=True)  # 1 error in 41 requests: rate 0.0244, errors 1 - 0.0244/0.05
    value, dominant, f = h.compute()
    assert f["latency"] == pytest.approx(2 - 0.0375 * (0.95 * 39 + 1) / 1.0)
    assert f["errors"] == pytest.approx(1 - (1 / 41) / 0.05)
    expected = (0.4 * f["latency"] + 0.3 * f["errors"] + 0.1 * 1.0) / 0.8  # gpu absent: renormalised
    assert value == pytest.approx(expected) and dominant == "latency"
    clock.t += 301  # window passed: old requests no longer count
    assert h.compute()[:2] == (1.0, "none")


def test_health_windows_keep_the_newest_samples_in_fixed_memory():
    """The windows are rings of ``max_samples``: the oldest sample is overwritten, and observing
    requests allocates nothing that stays (the engine soak's per-request growth, issue 19)."""
    import gc
    import tracemalloc

    from llm_otel.signals import health as health_module

    clock = Clock()
    h = HealthScore(latency_target_s=1.0, max_error_rate=0.5, warmup_s=0, max_samples=8, clock=clock)
    for _ in range(8):
        h.observe(5.0, error=True)  # errors carry no TTFT: the latency window stays empty
    assert h.factors()["errors"] == 0.0 and h.factors()["latency"] == 1.0
    for _ in range(8):  # eight successes overwrite all eight errors, and fill the latency window
        h.observe(0.5, error=False)
    assert h.factors()["errors"] == 1.0 and h.factors()["latency"] == 1.0
    for _ in range(4):  # half the latency window now 3 s: p95 3 s, factor max(0, 2 - 3) = 0
        h.observe(3.0, error=False)
    assert h.factors()["latency"] == 0.0

    big = HealthScore(clock=clock)  # default 4,096 samples
    for i in range(5000):
        big.observe(0.1, error=False)  # the first pass over the rings writes only preallocated slots
    gc.collect()
    tracemalloc.start()
    try:
        # only what the health module allocates: other threads of the test process (exporters,
        # samplers of earlier tests) allocate meanwhile too, and made a whole-process count flaky
        only_health = [tracemalloc.Filter(True, health_module.__file__)]
        before = tracemalloc.take_snapshot().filter_traces(only_health)
        for i in range(10_000):
            clock.t += 0.01
            big.observe(0.05 + (i % 7) * 1e-3, error=i % 50 == 0)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(only_health)
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 2_000, grown  # a deque of tuples: about 175 bytes per request until full


def test_health_gpu_factor_and_weights():
    util = {"v": 0.925}
    h = HealthScore(weights={"gpu": 1.0}, warmup_s=0, utilization=lambda: util["v"], clock=Clock())
    assert h.compute()[0] == pytest.approx(0.5) and h.compute()[1] == "gpu"  # half-way from knee 0.85 to 1
    util["v"] = 0.5
    assert h.compute()[:2] == (1.0, "none")
    assert score(
        {"latency": None, "errors": None, "gpu": None, "uptime": None},
        {"latency": 1, "errors": 1, "gpu": 1, "uptime": 1},
    ) == (1.0, "none")


# --- /healthz ------------------------------------------------------------------------------------
def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}") if e.code != 404 else {}


@pytest.mark.parametrize(
    "report, code, reason",
    [
        ((0.9, "none", {"latency": 1.0}, "ok", True), 200, None),
        ((0.9, "none", {"latency": 1.0}, None, None), 200, None),
        ((0.3, "latency", {"latency": 0.0}, "ok", True), 503, "score 0.300 < 0.5 (dominant factor latency)"),
        ((0.9, "none", {"latency": 1.0}, "critical", True), 503, "VRAM pressure critical"),
        ((0.9, "none", {"latency": 1.0}, "warn", True), 200, None),
        ((0.9, "none", {"latency": 1.0}, "ok", False), 503, "telemetry exporter unreachable"),
    ],
)
def test_healthz_answers_503_with_the_reason_when_unhealthy_and_200_otherwise(report, code, reason):
    server = HealthServer(lambda: report, port=0).start()
    try:
        status, body = get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == code
        assert body["reasons"] == ([] if reason is None else [reason])
        assert body["score"] == report[0] and body["vram_pressure"] == report[3]
        assert get(f"http://127.0.0.1:{server.port}/metrics")[0] == 404
    finally:
        server.stop()


def test_healthz_is_503_when_the_report_fails():
    def broken():
        raise RuntimeError("boom")

    server = HealthServer(broken, port=0).start()
    try:
        assert get(f"http://127.0.0.1:{server.port}/healthz") == (
            503,
            {"status": "unhealthy", "reasons": ["health report failed: RuntimeError"]},
        )
    finally:
        server.stop()


@pytest.mark.parametrize(
    "report, code",
    [((0.9, "none", {"latency": 1.0}, "ok", True), 200), ((0.9, "none", {"latency": 1.0}, "critical", True), 503)],
)
def test_healthz_head_has_the_get_status_and_no_body(report, code):
    import http.client

    server = HealthServer(lambda: report, port=0).start()
    try:
        for path, want in (("/healthz", code), ("/health", code), ("/", code), ("/metrics", 404)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request("HEAD", path)
                resp = conn.getresponse()
                assert resp.status == want, path
                assert resp.read() == b""
                if want != 404:
                    get_len = len(json.dumps(server.response()[1]).encode())
                    assert resp.getheader("Content-Type") == "application/json"
                    assert int(resp.getheader("Content-Length")) == get_len
            finally:
                conn.close()
        assert get(f"http://127.0.0.1:{server.port}/healthz")[0] == code  # the connection still serves GET
    finally:
        server.stop()


@pytest.mark.parametrize("port", [-1, 65536, 99999, True, "80"])
def test_health_server_rejects_a_bad_port(port):
    with pytest.raises(ValueError, match="0..65535"):
        HealthServer(lambda: (1.0, "none", {}, None, None), port=port)


def test_signals_with_a_bad_health_port_log_and_run_without_endpoint(caplog):
    config = dataclasses.replace(SignalsConfig.from_env({}), health_port=99999)  # bypasses from_env's check
    signals = Signals(MeterProvider().get_meter("t"), config, poller=UtilizationPoller(None))
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        signals.start()
    try:
        assert signals.health_server is None
        assert [r.getMessage() for r in caplog.records if "health endpoint not started" in r.getMessage()]
    finally:
        signals.stop()


@pytest.mark.parametrize(
    "port, message",
    [
        ("99999", "invalid port 99999: must be 0..65535"),
        ("-1", "invalid port -1: must be 0..65535"),
        ("65536", "invalid port 65536"),
        ("http", "invalid port 'http': not an integer"),
    ],
)
def test_cli_serve_health_rejects_a_bad_port(port, message, capsys):
    from llm_otel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve-health", "--port", port])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("llm-otel serve-health: error: argument --port:")


@pytest.mark.parametrize("warmup, code", [("0", 200), ("3600", 503)])
def test_cli_serve_health_answers_healthz_with_the_warmup_applied(warmup, code):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(LLM_OTEL_HEALTH_WARMUP_S=warmup, LLM_OTEL_HEALTH_WEIGHTS="gpu=1,uptime=1", OTEL_TRACES_EXPORTER="none")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llm_otel.cli", "serve-health", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "healthz on http://127.0.0.1:" in line, line
        url = line.strip().split(" on ", 1)[1]
        status, body = get(url)
        assert status == code
        if code == 503:
            assert body["dominant_factor"] == "uptime" and body["score"] == 0.0
        assert body["exporter"] == "not configured"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- signals on the telemetry core ---------------------------------------------------------------
def signals_captured(env: dict):
    cap = make_captured()
    reader = InMemoryMetricReader()
    signals = Signals(
        MeterProvider(metric_readers=[reader]).get_meter("t"),
        SignalsConfig.from_env(env),
        poller=UtilizationPoller(None),
    )
    cap.telemetry.signals = signals
    return cap, signals, reader


def start(cap, signals, hdrs, kv=None, input_tokens=40):
    span_attrs, labels, tier = signals.classify(hdrs)
    rec = cap.telemetry.start_request(
        "r1",
        operation="text_completion",
        provider="vllm",
        model="m",
        arrival_s=1000.0,
        input_tokens=input_tokens,
        kind=SpanKind.SERVER,
        request_attributes=span_attrs,
    )
    signals.admit(rec, labels, tier, kv)
    return rec


def test_classes_and_tier_on_span_and_genai_metrics_and_slo_checks():
    cap, signals, reader = signals_captured(
        {
            "LLM_OTEL_CLASS_HEADERS": "tenant:x-tenant-id",
            "LLM_OTEL_TIERS": "premium tenant=acme ttft=0.3 tpot=0.05",
            "LLM_OTEL_MODEL_REVISION": "canary",
        }
    )
    rec = start(cap, signals, headers(("x-tenant-id", "acme")))
    t0 = rec.arrival_s - rec.mono_offset_ns / 1e9  # engine monotonic time of arrival
    rec.on_tokens([1], t0 + 0.2)
    rec.on_tokens([2], t0 + 0.3)  # TPOT 0.1 > 0.05
    rec.finish_reason = "stop"
    cap.telemetry.finish(rec, end_ns=rec.arrival_ns + 400_000_000)
    (span,) = [s for s in cap.finished() if s.name == "text_completion m"]
    assert span.attributes[A.LLM_REQUEST_TENANT] == "acme"
    assert span.attributes[A.LLM_REQUEST_TIER] == "premium"
    assert span.attributes[A.LLM_REQUEST_MODEL_REVISION] == "canary"
    (ttft,) = cap.metric_points(M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
    assert {
        k: ttft.attributes[k] for k in (A.LLM_REQUEST_TENANT, A.LLM_REQUEST_TIER, A.LLM_REQUEST_MODEL_REVISION)
    } == {A.LLM_REQUEST_TENANT: "acme", A.LLM_REQUEST_TIER: "premium", A.LLM_REQUEST_MODEL_REVISION: "canary"}
    checks = {
        (p.attributes[A.LLM_SLO_OBJECTIVE], p.attributes[A.LLM_SLO_OUTCOME]): p.value
        for p in metric_points(reader, M.LLM_SERVER_SLO_CHECKS)
    }
    assert checks == {("availability", "met"): 1, ("ttft", "met"): 1, ("tpot", "breached"): 1}


def test_failed_request_counts_against_availability_only():
    cap, signals, reader = signals_captured({"LLM_OTEL_TIERS": "free * ttft=1"})
    rec = start(cap, signals, None)
    rec.error_type = "EngineDeadError"
    cap.telemetry.finish(rec)
    checks = {
        (p.attributes[A.LLM_SLO_OBJECTIVE], p.attributes[A.LLM_SLO_OUTCOME], p.attributes[A.LLM_REQUEST_TIER]): p.value
        for p in metric_points(reader, M.LLM_SERVER_SLO_CHECKS)
    }
    assert checks == {("availability", "breached", "free"): 1}
    assert signals.health.factors()["errors"] < 1.0


def test_client_disconnect_is_not_a_server_failure():
    """Review finding: one impatient client took a replica out of rotation (/healthz 503)."""
    cap, signals, reader = signals_captured({"LLM_OTEL_TIERS": "free * ttft=1"})
    for _ in range(3):
        rec = start(cap, signals, None)
        rec.error_type = "aborted"
        cap.telemetry.finish(rec)
    assert metric_points(reader, M.LLM_SERVER_SLO_CHECKS) == []
    assert signals.health.factors()["errors"] == 1.0


def test_collapsed_class_values_are_counted_in_a_metric():
    cap, signals, reader = signals_captured(
        {"LLM_OTEL_CLASS_HEADERS": "tenant:x-tenant-id", "LLM_OTEL_CLASS_MAX_VALUES": "1"}
    )
    for value in ("a", "b", "c", "bad value"):
        signals.classify(headers(("x-tenant-id", value)))
    counts = {
        p.attributes[A.LLM_REQUEST_CLASS_REASON]: p.value
        for p in metric_points(reader, M.LLM_OTEL_REQUEST_CLASS_COLLAPSED)
    }
    # every reason's series exists from the start (at 0), so alerts can rate() the first collapse
    assert counts == {"overflow": 2, "invalid": 1, "duplicate": 0, "oversized": 0}


def test_request_admitted_under_pressure_gets_an_event_and_kv_attributes():
    cap, signals, reader = signals_captured({"LLM_OTEL_VRAM_WARN_HOLD_S": "0", "LLM_OTEL_VRAM_CRITICAL_HOLD_S": "0"})
    spec = KVSpec(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, block_size=32, num_blocks=10)
    live = {"blocks": 9}
    signals._kv_sources.append(lambda: (live["blocks"], 10))
    assert signals.tick(now=0.0) == "critical"
    rec = start(cap, signals, None, kv=spec, input_tokens=40)
    live["blocks"] = 1
    assert signals.tick(now=1.0) == "critical"  # clearing needs 30 s below 0.85
    rec.on_tokens([5, 6, 7], rec.arrival_s - rec.mono_offset_ns / 1e9 + 0.1)
    cap.telemetry.finish(rec)
    (span,) = [s for s in cap.finished() if s.name == "text_completion m"]
    (event,) = [e for e in span.events if e.name == "llm.vram.pressure"]
    assert dict(event.attributes) == {
        A.LLM_VRAM_PRESSURE_LEVEL: "critical",
        A.LLM_VRAM_USAGE: 0.9,
        A.LLM_VRAM_SOURCE: "kv_cache",
    }
    per_block = 32 * 2 * 2 * 2 * 16 * 4
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_PROMPT_BYTES] == 2 * per_block  # 40 tokens: 2 blocks
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_FINAL_BYTES] == 2 * per_block  # 42 tokens written: 2 blocks
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_BLOCKS] == 2
    sizes = {
        p.attributes[A.LLM_KV_CACHE_PHASE]: (p.count, p.sum)
        for p in metric_points(reader, M.LLM_SERVER_REQUEST_KV_CACHE_SIZE)
    }
    assert sizes == {"admission": (1, 2 * per_block), "finish": (1, 2 * per_block)}
    (level,) = metric_points(reader, M.LLM_SERVER_VRAM_PRESSURE)
    assert level.value == 2 and level.attributes == {
        A.LLM_VRAM_PRESSURE_LEVEL: "critical",
        A.LLM_VRAM_SOURCE: "kv_cache",
    }


def test_no_event_while_pressure_is_ok():
    cap, signals, _ = signals_captured({})
    rec = start(cap, signals, None)
    cap.telemetry.finish(rec)
    assert all(not s.events or all(e.name != "llm.vram.pressure" for e in s.events) for s in cap.finished())


def test_nvml_signals_are_absent_on_cpu_not_zero():
    cap, signals, reader = signals_captured({})
    signals.poller = None
    assert metric_points(reader, M.LLM_SERVER_HEALTH_SCORE) == []  # not serving (e.g. an engine-core process)
    signals.start()  # no GPU here: an unavailable NVML poller
    try:
        signals.on_tokens(100, 0.0)
        assert signals.poller.source is None
        assert signals.token_efficiency() is None and signals.usage() == (None, None)
        signals.tick(now=0.0)
        assert metric_points(reader, M.LLM_SERVER_TOKEN_EFFICIENCY) == []
        assert metric_points(reader, M.LLM_SERVER_VRAM_USAGE) == []
        assert metric_points(reader, M.LLM_SERVER_VRAM_PRESSURE) == []
        (health,) = metric_points(reader, M.LLM_SERVER_HEALTH_SCORE)
        assert health.attributes == {A.LLM_HEALTH_FACTOR: "uptime"}  # just started: warming up
    finally:
        signals.stop()


class MemorySource:
    """A pluggable :class:`llm_otel.gpu.nvml.SignalSource` with NvmlSource's memory fields."""

    memory_used_bytes = 2 * GIB
    memory_total_bytes = 8 * GIB

    def read(self) -> float:
        return 0.5


def test_token_efficiency_per_gib_in_use():
    cap, signals, reader = signals_captured({"LLM_OTEL_EFFICIENCY_WINDOW_S": "10"})
    poller = UtilizationPoller(MemorySource())
    poller.sample()
    signals.poller = poller
    for t in range(20):  # 15 tokens per 0.5 s step for 10 s = 300 tokens in the window
        signals.on_tokens(15, 100.0 + 0.5 * t)
    signals.on_tokens(999, 80.0)  # outside the window
    assert signals.token_efficiency(now=109.6) == pytest.approx(300 / 10 / 2)
    assert signals.usage() == (0.25, "nvml")


def test_token_efficiency_counts_any_token_rate_in_fixed_memory():
    """Fresh-install review of issue 21: the signals kept the last 16,384 step updates, so a
    per-token reporter (LightLLM) read at most ~1,638 tokens/s over the default 10 s window."""
    cap, signals, reader = signals_captured({"LLM_OTEL_EFFICIENCY_WINDOW_S": "10"})
    poller = UtilizationPoller(MemorySource())
    poller.sample()
    signals.poller = poller
    for k in range(50_000):  # one token at a time, 5,000 per second for 10 s
        signals.on_tokens(1, 1000.0 + k / 5000)
    signals.on_tokens(7, 900.0)  # older than the window: not counted, nothing overwritten
    assert signals.token_efficiency(now=1000.0 + 49_999 / 5000) == pytest.approx(5000 / 2, rel=0.002)
    assert len(signals._bucket_ids) == 2048  # the ring does not grow


def test_stop_ends_the_thread_and_the_health_endpoint():
    _, signals, _ = signals_captured({"LLM_OTEL_HEALTH_PORT": "0"})
    signals.start()
    port = signals.health_server.port
    assert get(f"http://127.0.0.1:{port}/healthz")[0] in (200, 503)
    signals.stop()
    signals._thread.join(timeout=30)
    assert not signals._thread.is_alive() and signals.health_server is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)


def test_a_failing_signal_never_reaches_the_engine_and_the_span_still_ends(monkeypatch):
    cap, signals, _ = signals_captured({})
    rec = start(cap, signals, None)

    def broken(*args, **kwargs):
        raise ValueError("signal bug")

    monkeypatch.setattr(signals, "on_finish", broken)
    cap.telemetry.finish(rec)  # does not raise
    assert [s.name for s in cap.finished()].count("text_completion m") == 1
    assert cap.telemetry.errors.counts == {"telemetry.signals": 1}


def test_doctor_names_the_bad_tier_line():
    import io

    from llm_otel.cli import doctor

    out = io.StringIO()
    assert doctor(env={"LLM_OTEL_TIERS": "premium tenant=a ttft=1; free * ttft=soon"}, out=out) == 1
    assert "LLM_OTEL_TIERS line 2" in out.getvalue() and "'soon' is not a number" in out.getvalue()
