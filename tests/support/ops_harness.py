"""Discovery and PromQL helpers shared by the operations-kit tests.

Every Prometheus rules file ``examples/prometheus/**/*.rules.yml``, every promtool unit-test file
``examples/prometheus/**/tests/*.test.yml`` and every Grafana dashboard
``examples/grafana/dashboards/*.json`` is picked up automatically - add a file and the promtool
checks and the live Prometheus test run its expressions too.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "examples" / "prometheus"
DASHBOARD_DIR = ROOT / "examples" / "grafana" / "dashboards"

# Grafana's built-in variables, replaced by values Prometheus accepts when a test runs a panel query.
GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

# PromQL words that are not metric names
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
}


def rules_files() -> list[pathlib.Path]:
    return sorted(p for p in PROMETHEUS_DIR.rglob("*.rules.yml"))


def rule_test_files() -> list[pathlib.Path]:
    return sorted(p for p in PROMETHEUS_DIR.rglob("*.test.yml"))


def dashboards() -> list[pathlib.Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def rules(path: pathlib.Path) -> list[dict]:
    """Every rule of a rules file, each with its ``group`` name added."""
    doc = yaml.safe_load(path.read_text())
    out = []
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            out.append({**rule, "group": group["name"]})
    return out


def dashboard_queries(path: pathlib.Path) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel, nested rows included."""
    doc = json.loads(path.read_text())
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(doc.get("panels", []))
    return out


def template_values(path: pathlib.Path) -> dict[str, str]:
    """Dashboard variable -> a value matching everything (``.*``; the data source variable is dropped)."""
    doc = json.loads(path.read_text())
    values = {}
    for var in doc.get("templating", {}).get("list", []):
        values["$" + var["name"]] = "" if var.get("type") == "datasource" else ".*"
    return values


def concrete(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's variables replaced (longest names first)."""
    for name, value in sorted({**GRAFANA_BUILTINS, **variables}.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names a PromQL expression selects: identifiers that are not
    functions, keywords, label names inside ``{...}`` or grouping clauses, strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range / subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        rest = text[match.end() :].lstrip()
        if rest.startswith("("):  # function call
            continue
        if word.lower() in _KEYWORDS:
            continue
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # 1e3, 14.4x
        names.add(word)
    return names


def which(tool: str) -> str | None:
    return shutil.which(tool)
