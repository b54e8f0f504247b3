"""Prometheus rules and Grafana dashboards of examples/: promtool validates every rules file and
runs every unit-test file; every alert is proven both to fire and to stay silent by some test;
dashboards are wired to a Prometheus data source with exemplars linked to Jaeger."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from support import ops_harness as H
from support import tools


def _promtool() -> str:
    return tools.binary("promtool", "apt-get install prometheus (.ci/install.sh installs Debian's package)")


def test_alert_rules_rule_tests_and_dashboards_are_shipped():
    assert H.rules_files() and H.rule_test_files() and H.dashboards()


@pytest.mark.parametrize("path", H.rules_files(), ids=lambda p: p.name)
def test_alert_rules_pass_promtool_check(path):
    run = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path", H.rule_test_files(), ids=lambda p: p.name)
def test_alert_rule_unit_tests_pass_under_promtool(path):
    run = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True, cwd=path.parent)
    assert run.returncode == 0, run.stdout + run.stderr


def test_example_prometheus_config_passes_promtool_check():
    path = H.PROMETHEUS_DIR / "prometheus.yml"
    run = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _alert_expectations() -> dict[str, dict[str, int]]:
    """alertname -> {"fires": n, "silent": n} over every promtool unit-test file."""
    seen: dict[str, dict[str, int]] = {}
    for path in H.rule_test_files():
        for test in yaml.safe_load(path.read_text()).get("tests", []):
            for case in test.get("alert_rule_test", []):
                entry = seen.setdefault(case["alertname"], {"fires": 0, "silent": 0})
                entry["fires" if case.get("exp_alerts") else "silent"] += 1
    return seen


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    alerts = {r["alert"] for p in H.rules_files() for r in H.rules(p) if "alert" in r}
    seen = _alert_expectations()
    missing = {
        a: seen.get(a, {"fires": 0, "silent": 0})
        for a in alerts
        if not (seen.get(a, {}).get("fires") and seen.get(a, {}).get("silent"))
    }
    assert not missing, f"alerts without both a firing and a silent promtool case: {missing}"


def test_every_alert_has_severity_and_summary():
    for path in H.rules_files():
        for rule in H.rules(path):
            if "alert" in rule:
                assert rule.get("labels", {}).get("severity") in ("page", "ticket", "info"), rule["alert"]
                assert rule.get("annotations", {}).get("summary"), rule["alert"]


def test_slo_parameters_are_single_series_the_alerts_read():
    rules = [r for p in H.rules_files() for r in H.rules(p)]
    params = {r["record"] for r in rules if r.get("record", "").startswith("llm_otel:slo_param:")}
    assert {
        "llm_otel:slo_param:ttft_objective",
        "llm_otel:slo_param:availability_objective",
        "llm_otel:slo_param:itl_drift_factor",
    } <= params
    read = set().union(*(H.metric_names(r["expr"]) for r in rules if "alert" in r))
    assert params <= read, f"parameters no alert reads: {params - read}"


@pytest.mark.parametrize("path", H.dashboards(), ids=lambda p: p.name)
def test_dashboard_panels_query_prometheus_through_the_datasource_variable(path):
    doc = json.loads(path.read_text())
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in doc["templating"]["list"])
    queries = H.dashboard_queries(path)
    assert queries
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_latency_panels_show_exemplars():
    doc = json.loads((H.DASHBOARD_DIR / "llm-otel.json").read_text())
    latency = [p for p in doc["panels"] if p.get("fieldConfig", {}).get("defaults", {}).get("unit") == "s"]
    assert len(latency) >= 5
    for panel in latency:
        assert all(t.get("exemplar") is True for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"] for p in doc["panels"])
    for needed in (
        "Time to first token",
        "Time per output token",
        "Queue time",
        "Tokens/s",
        "Prefix-cache",
        "KV-cache",
        "GPU utilisation by phase",
        "sampling probability",
        "burn rate",
        "Errors",
    ):
        assert needed in titles, needed


def test_grafana_exemplars_link_to_the_jaeger_datasource():
    doc = yaml.safe_load((H.ROOT / "examples/grafana/provisioning/datasources/llm-otel.yml").read_text())
    by_uid = {d["uid"]: d for d in doc["datasources"]}
    prometheus = next(d for d in doc["datasources"] if d["type"] == "prometheus")
    links = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert [link["name"] for link in links] == ["trace_id"]  # the label llm-otel's exemplars carry
    assert by_uid[links[0]["datasourceUid"]]["type"] == "jaeger"


def test_metric_names_finds_series_not_functions_labels_or_keywords():
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(foo_bucket{le="0.5", a=~"x|y"}[5m]))) '
        "> on() group_left() 14.4 * (1 - scalar(llm_otel:slo_param:x)) and bar offset 1h or vector(0)"
    )
    assert H.metric_names(expr) == {"foo_bucket", "llm_otel:slo_param:x", "bar"}
