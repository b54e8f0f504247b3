"""Ports of a serving topology (issue 16, llm_otel.process.ports): one Prometheus and /healthz port
per request-serving process, none for processes that serve no requests, collisions reported by
``llm-otel doctor``."""

from __future__ import annotations

import io
import socket

import pytest

from llm_otel.process import ports


@pytest.fixture(autouse=True)
def _fresh():
    ports._reset_for_tests()
    yield
    ports._reset_for_tests()


def test_single_frontend_keeps_the_configured_ports():
    rows, problems = ports.scheme(9464, api_servers=1, dp_size=1, health_base=8081)
    assert rows == [
        ("frontend", "prometheus", 9464),
        ("frontend", "healthz", 8081),
        ("engine_core", "prometheus", 9465),
    ]
    assert problems == []


def test_api_servers_count_down_engine_cores_up():
    rows, problems = ports.scheme(9464, api_servers=3, dp_size=2)
    assert rows == [
        ("ApiServer_0", "prometheus", 9464),
        ("ApiServer_1", "prometheus", 9463),
        ("ApiServer_2", "prometheus", 9462),
        ("EngineCore_DP0", "prometheus", 9465),
        ("EngineCore_DP1", "prometheus", 9466),
    ]
    assert problems == []


def test_collisions_are_named():
    _, problems = ports.scheme(8001, api_servers=2, dp_size=1, health_base=8002, serving_ports=(8000,))
    assert "port 8000: the engine's own port 8000 and ApiServer_1 prometheus" in problems
    assert "port 8002: EngineCore_DP0 prometheus" not in problems  # single DP is named engine_core
    assert any(p.startswith("port 8002:") and "engine_core prometheus" in p for p in problems)
    _, problems = ports.scheme(1, api_servers=3)
    assert "ApiServer_1 prometheus port 0 is outside 1..65535" in problems


def test_health_port_zero_stays_a_free_port_for_every_api_server():
    assert ports.frontend_port(0, 3) == 0
    rows, problems = ports.scheme(None, api_servers=2, health_base=0)
    assert rows == [("ApiServer_0", "healthz", 0), ("ApiServer_1", "healthz", 0)] and problems == []


def test_api_server_index_from_vllms_process_name():
    assert ports.api_server_index("ApiServer_3") == 3
    assert ports.api_server_index("MainProcess") == 0
    assert ports.api_server_index("EngineCore_DP1") == 0


def test_deferred_frontend_endpoint_starts_only_when_the_process_serves():
    started = []
    assert ports.when_serving(lambda: started.append(1) or True) is True  # not deferred: now
    ports.defer_frontend_endpoints()
    assert ports.when_serving(lambda: started.append(2) or True) is None
    assert started == [1]
    ports.serving_started()
    assert started == [1, 2]
    ports.serving_started()  # idempotent
    assert started == [1, 2]
    assert ports.when_serving(lambda: started.append(3) or True) is True  # serving: at once


def test_deferred_prometheus_reader_binds_its_api_server_port_when_serving(monkeypatch):
    pytest.importorskip("opentelemetry.exporter.prometheus")
    import multiprocessing

    import httpx

    from llm_otel.process.ports import prometheus_reader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1] + 1  # API server 1 serves on base - 1 = the port just freed
    monkeypatch.setattr(multiprocessing.current_process(), "name", "ApiServer_1")
    ports.defer_frontend_endpoints()
    env = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(base),
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
    }
    reader = prometheus_reader(env, "frontend")
    assert reader is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{base - 1}/metrics", timeout=2)  # bound by nobody yet
    ports.serving_started()
    assert httpx.get(f"http://127.0.0.1:{base - 1}/metrics", timeout=5).status_code == 200


def test_doctor_reports_the_scheme_and_a_collision():
    from llm_otel.cli import doctor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    out = io.StringIO()
    code = doctor(
        {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(base),
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_TRACES_EXPORTER": "none",
        },
        out,
        api_servers=2,
        dp_size=2,
        serve_port=base - 1,
    )
    text = out.getvalue()
    assert code == 1
    assert "ports for 2 API server(s) and 2 engine core(s)" in text
    assert f"port collision: port {base - 1}: the engine's own port {base - 1} and ApiServer_1 prometheus" in text
    assert f"the EngineCore_DP1 process would serve http://127.0.0.1:{base + 2}/metrics" in text
