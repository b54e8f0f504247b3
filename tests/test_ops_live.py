"""Operations kit against a real Prometheus: a tiny vLLM engine configured like an operator would
(``OTEL_METRICS_EXPORTER=prometheus``), scraped by ``prometheus`` on 127.0.0.1 with every rules
file of examples/prometheus/ loaded; then every PromQL expression of those rules and of every
dashboard in examples/grafana/dashboards/ runs through Prometheus's HTTP API.

The session ``engine`` fixture cannot serve here: it passes an in-memory meter provider to the
frontend and an OTLP environment to its engine processes, and a Prometheus reader must be part of
a meter provider when it is built. So this module runs one extra engine (tests/support/ops_engine_app.py)
as a subprocess - the frontend serves on port P, its engine-core process on P + 1.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from conftest import HAS_VLLM, VLLM_ENV
from support import ops_harness as H
from support import tools

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

# absent without NVML (token efficiency divides by GPU memory in use)
GPU_METRICS = (
    "llm_gpu_utilization",
    "llm_gpu_memory_usage_bytes",
    "llm_gpu_memory_limit_bytes",
    "llm_server_token_efficiency",
)
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _free_pair() -> int:
    """A port P with P + 1 free too (frontend and engine-core endpoints)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require(tool: str) -> str:
    """promtool or prometheus: skipped where missing, a failure under CI (support/tools.py)."""
    return tools.binary(tool, "apt-get install prometheus (.ci/install.sh installs Debian's package)")


def _stop(proc: subprocess.Popen, close_stdin: bool = False) -> None:
    if proc.poll() is not None:
        return
    if close_stdin and proc.stdin:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def ops_engine(tiny_model, tmp_path_factory):
    """The instrumented engine subprocess, once it has served its first batch."""
    port = _free_pair()
    log_path = tmp_path_factory.mktemp("ops_engine") / "engine.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(VLLM_ENV)
    env.update(
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        OTEL_TRACES_EXPORTER="none",
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.5",
        OTEL_SERVICE_NAME="llm-otel-ops-test",
        LLM_OTEL_CONSOLE="off",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        # a catch-all tier so the signals rules and panels (SLO checks by tier) have data
        LLM_OTEL_TIERS="free * ttft=1.2 tpot=0.5",
        LLM_OTEL_MODEL_REVISION="stable",
        LLM_OTEL_CLASS_HEADERS="priority:engine:priority",
    )
    log = open(log_path, "w")
    app = os.path.join(os.path.dirname(__file__), "support", "ops_engine_app.py")
    proc = subprocess.Popen(
        [sys.executable, app, str(tiny_model)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        line = ""
        while time.time() < deadline:
            line = proc.stdout.readline()
            if line.strip() == "READY" or not line:
                break
        if line.strip() != "READY":
            pytest.fail(f"engine did not start (exit {proc.poll()}):\n{log_path.read_text()[-4000:]}")
        yield {"frontend": port, "engine_core": port + 1, "log": log_path, "proc": proc}
    finally:
        _stop(proc, close_stdin=True)
        log.close()


@pytest.fixture(scope="module")
def prom(ops_engine, tmp_path_factory):
    """A real Prometheus scraping both engine processes every second, every rules file loaded."""
    binary = _require("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in H.rules_files()],
        "scrape_configs": [
            {
                "job_name": "llm",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{ops_engine['frontend']}"], "labels": {"process": "frontend"}},
                    {"targets": [f"127.0.0.1:{ops_engine['engine_core']}"], "labels": {"process": "engine_core"}},
                ],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=base, timeout=10)
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited {proc.returncode}:\n{(work / 'prometheus.log').read_text()[-3000:]}")
            try:
                if client.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("prometheus not ready in 60 s")
            time.sleep(0.5)
        # wait until every recording rule has produced a value from scraped data
        recorded = [r["record"] for f in H.rules_files() for r in H.rules(f) if "record" in r]
        deadline = time.time() + 120
        missing = recorded
        while time.time() < deadline:
            missing = [name for name in recorded if not _query(client, name)]
            if not missing:
                break
            time.sleep(2)
        yield {"client": client, "missing_recordings": missing, "log": work / "prometheus.log"}
    finally:
        client.close()
        _stop(proc)
        log.close()


def _query(client, expr: str) -> list:
    body = client.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    return body["data"]["result"]


def _gpu_present(client) -> bool:
    return bool(_query(client, "llm_gpu_utilization"))


def test_every_recording_rule_returns_data(prom):
    assert prom["missing_recordings"] == [], f"recording rules without data: {prom['missing_recordings']}"


def test_every_alert_expression_runs_and_every_series_it_reads_has_data(prom):
    client = prom["client"]
    gpu = _gpu_present(client)
    checked = 0
    for path in H.rules_files():
        for rule in H.rules(path):
            if "alert" not in rule:
                continue
            _query(client, rule["expr"])  # runs without error (firing or not)
            for name in H.metric_names(rule["expr"]):
                if name.startswith(GPU_METRICS) and not gpu:
                    continue
                assert _query(client, name), f"{path.name}: alert {rule['alert']} reads {name}, which has no data"
            checked += 1
    assert checked >= 7


def test_every_dashboard_query_returns_data(prom):
    client = prom["client"]
    gpu = _gpu_present(client)
    checked = 0
    for path in H.dashboards():
        variables = H.template_values(path)
        for title, expr in H.dashboard_queries(path):
            expr = H.concrete(expr, variables)
            result = _query(client, expr)
            reads_gpu = any(n.startswith(GPU_METRICS) for n in H.metric_names(expr))
            if reads_gpu and not gpu:
                # NVML missing: the GPU metrics are absent, not zero
                assert result == [], f"{path.name}: panel {title!r} shows data without NVML: {result}"
            else:
                assert result, f"{path.name}: panel {title!r} query returns no data: {expr}"
            checked += 1
    assert checked >= 20


def test_latency_histograms_carry_exemplars_with_trace_ids(prom):
    client = prom["client"]
    now = time.time()
    for metric in (
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "llm_server_inter_token_latency_seconds_bucket",
        "gen_ai_server_request_duration_seconds_bucket",
    ):
        body = client.get(
            "/api/v1/query_exemplars", params={"query": metric, "start": now - 600, "end": now + 60}
        ).json()
        assert body["status"] == "success", body
        exemplars = [e for series in body["data"] for e in series["exemplars"]]
        assert exemplars, f"no exemplars stored for {metric}"
        for e in exemplars:
            assert re.fullmatch(r"[0-9a-f]{32}", e["labels"]["trace_id"])
            assert re.fullmatch(r"[0-9a-f]{16}", e["labels"]["span_id"])


def test_sampling_probability_is_the_configured_ratio(prom):
    result = _query(prom["client"], "llm_otel_sampling_probability")
    assert [float(r["value"][1]) for r in result] == [0.5]
    assert result[0]["metric"]["process"] == "frontend"


def _scrape(port: int) -> str:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": OPENMETRICS}, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    return response.text


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_frontend_process_serves_request_metrics_only(ops_engine):
    families = _families(_scrape(ops_engine["frontend"]))
    for name in (
        "gen_ai_server_time_to_first_token_seconds",
        "gen_ai_server_time_per_output_token_seconds",
        "gen_ai_server_request_duration_seconds",
        "llm_server_inter_token_latency_seconds",
        "llm_server_output_token_rate_per_second",
        "llm_server_request_queue_time_seconds",
        "llm_server_token_usage",
        "llm_server_requests",
        "llm_otel_sampling_probability",
    ):
        assert name in families, name
    assert not families & {"llm_server_kv_cache_usage", "llm_server_prefix_cache_hits", "llm_gpu_utilization"}


def test_engine_core_process_serves_engine_state_only(ops_engine):
    text = _scrape(ops_engine["engine_core"])
    families = _families(text)
    for name in (
        "llm_server_kv_cache_usage",
        "llm_server_prefix_cache_hits",
        "llm_server_prefix_cache_queries",
        "llm_server_requests_running",
        "llm_server_requests_waiting",
    ):
        assert name in families, name
    assert "gen_ai_server_time_to_first_token_seconds" not in families
    assert 'llm_process_role="engine_core"' in text  # target_info carries the process role
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llm_server_prefix_cache_hits_total{")
    ]
    assert hits and hits[0] > 0  # the shared prompt prefix is served from the cache


@pytest.mark.case("C26")
def test_rejected_requests_are_counted_by_error_type(prom):
    result = _query(prom["client"], 'llm_server_requests_total{error_type!=""}')
    assert result, "the over-long prompts vLLM rejects are not counted"
    assert all("llm_response_finish_reason" not in r["metric"] for r in result)
