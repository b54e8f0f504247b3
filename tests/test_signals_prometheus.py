"""The signals alert rules and dashboard: promtool validates and unit-tests the rules, every
dashboard query parses as PromQL, and every metric they name is one llm-otel exports (names as
the OpenTelemetry Prometheus exporter writes them, derived from the semconv registry)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

import pytest
import yaml
from support import tools

from llm_otel._semconv_registry import load_registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "examples" / "prometheus" / "signals.rules.yml"
RULE_TESTS = ROOT / "examples" / "prometheus" / "tests" / "signals.test.yml"
DASHBOARD = ROOT / "examples" / "grafana" / "dashboards" / "llm-otel-signals.json"


@pytest.fixture
def promtool() -> str:
    """promtool: skipped where missing, a failure under CI (support/tools.py)."""
    return tools.binary("promtool", "apt-get install prometheus (.ci/install.sh installs Debian's package)")


# OpenTelemetry Prometheus exporter: dots -> "_", unit suffix, "_total" for counters
_UNIT_SUFFIX = {
    "s": "_seconds",
    "ms": "_milliseconds",
    "By": "_bytes",
    "KiBy": "_kibibytes",
    "MiBy": "_mebibytes",
    "1": "",
    "%": "_percent",
}
_METRIC_TOKEN = re.compile(r"\b((?:gen_ai_server|gen_ai_client|llm_server|llm_otel)_[a-zA-Z0-9_]+)")


def exported_prometheus_names() -> set[str]:
    names = set()
    for name, group in load_registry().metric_names().items():
        unit = group["unit"]
        base = name.replace(".", "_") + ("" if unit.startswith("{") else _UNIT_SUFFIX[unit])
        kind = group["instrument"]
        if kind == "counter":
            names.add(base + "_total")
        elif kind == "histogram":
            names.update(base + s for s in ("_bucket", "_count", "_sum"))
        else:
            names.add(base)
    return names


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_exporter_naming_of_signal_metrics():
    names = exported_prometheus_names()
    assert {
        "llm_server_slo_checks_total",
        "llm_server_request_kv_cache_size_bytes_bucket",
        "llm_server_vram_pressure",
        "llm_server_vram_usage",
        "llm_server_health_score",
        "llm_server_token_efficiency",
        "llm_otel_request_class_collapsed_total",
        "gen_ai_server_time_to_first_token_seconds_bucket",
    } <= names


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_metric_named_is_one_llm_otel_exports(source):
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    used = {m for e in exprs for m in _METRIC_TOKEN.findall(e)}
    assert used and used <= exported_prometheus_names(), sorted(used - exported_prometheus_names())


def test_dashboard_panels_have_queries_and_a_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 10
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])


def test_signal_rules_pass_promtool_check(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in result.stdout


def test_signal_alerts_fire_and_stay_silent_per_promtool_unit_tests(promtool):
    result = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=300, cwd=RULE_TESTS.parent
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_parses_as_promql(tmp_path, promtool):
    # Grafana's $__rate_interval becomes a concrete range; promtool parses each as a recording rule
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m")}
                    for i, e in enumerate(dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
