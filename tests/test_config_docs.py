"""The documentation states the defaults the settings dataclasses declare.

A setting's default is declared once, on its field of :class:`llm_otel.config.Settings` or
:class:`llm_otel.config.SignalsConfig` (``llm_otel.config.parse.setting``); the exporter variables'
defaults are the constants of :mod:`llm_otel.config.exporters`. Every variable the settings read has
a row with its default in a configuration table of README.md or docs/*.md, and every default the
documentation states - in those tables, in ``VARIABLE (default)`` mentions of the docs, and in the
docstrings that serve as the manual (the settings classes, the instrumentors) - equals the declared
one.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import pytest

import llm_otel.config.exporters as exporters
from llm_otel.config import Settings, SignalsConfig
from llm_otel.config.parse import env_fields, field_default

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SRC = ROOT / "src" / "llm_otel"
#: modules whose docstrings are a manual listing variables with their defaults
MANUALS = [
    SRC / "config" / "settings.py",
    SRC / "config" / "signals.py",
    SRC / "instrumentation" / "vllm" / "__init__.py",
    SRC / "instrumentation" / "lightllm" / "__init__.py",
    SRC / "instrumentation" / "triton" / "__init__.py",
    SRC / "export" / "prometheus.py",
]


def declared() -> dict[str, Any]:
    """variable -> default, for every variable the settings read."""
    out: dict[str, Any] = {}
    for cls in (Settings, SignalsConfig):
        for field in env_fields(cls):
            names = field.metadata["env"]
            for name in (names,) if isinstance(names, str) else names:
                assert name not in out, f"{name} is read by two settings"
                out[name] = field_default(field)
    out.update(
        {
            "OTEL_TRACES_EXPORTER": exporters.DEFAULT_EXPORTER,
            "OTEL_METRICS_EXPORTER": exporters.DEFAULT_EXPORTER,
            "OTEL_EXPORTER_OTLP_PROTOCOL": exporters.DEFAULT_OTLP_PROTOCOL,
            "OTEL_EXPORTER_OTLP_ENDPOINT": None,
            "OTEL_EXPORTER_PROMETHEUS_PORT": exporters.PROMETHEUS_PORT,
            "OTEL_EXPORTER_PROMETHEUS_HOST": exporters.PROMETHEUS_HOST,
        }
    )
    return out


_NUMBER = re.compile(r"[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?")


def matches(text: str, default: Any) -> bool:
    """Whether documented ``text`` states ``default``."""
    text = re.sub(r"^default:? ", "", text.strip()).strip("`").strip()
    if default is None or (isinstance(default, Mapping) and not default):
        return text == "unset" or text.startswith("unset:") or text.startswith("unset ")
    if isinstance(default, bool):
        return text.lower() in ({"true", "on"} if default else {"false", "off"})
    if isinstance(default, (int, float)):
        number, unit = re.fullmatch(r"(.*?)\s*(s|seconds|MiB)?", text).groups()
        if not _NUMBER.fullmatch(number):
            return False
        value = float(number.replace(",", "")) * (1 << 20 if unit == "MiB" else 1)
        return math.isclose(value, float(default), rel_tol=0, abs_tol=1e-12)
    if isinstance(default, Mapping):
        try:
            pairs = dict(entry.split("=") for entry in text.replace(" ", "").split(","))
            return {k: float(v) for k, v in pairs.items()} == dict(default)
        except ValueError:
            return False
    return text == default


def _names(cell: str) -> list[str] | None:
    """The variables a table's first cell names; None for a row that only refers to others (``*``)."""
    out: list[str] = []
    for token in re.findall(r"`([A-Z0-9_\[\]*]+)`", cell):
        if "*" in token:
            return None
        if token.startswith("_") and token.endswith("_"):
            continue  # "(`_TRACES_`/`_METRICS_` variants)": fall back to the general variable
        if token.startswith("_"):
            if not out:
                raise AssertionError(f"{cell!r}: a suffix before any full variable name")
            out.append("_".join(out[0].split("_")[:3]) + token)
            continue
        optional = re.fullmatch(r"([A-Z0-9_]+)\[([A-Z0-9_]+)\]", token)
        out.extend([optional[1], optional[1] + optional[2]] if optional else [token])
    return out


def table_rows() -> list[tuple[str, int, list[str], list[str]]]:
    """``(file, line, variables, documented defaults)`` for each row of a configuration table: a
    Markdown table whose header reads ``variable | default | ...``."""
    rows = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        in_table = False
        for number, line in enumerate(lines, start=1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
            if not cells:
                in_table = False
                continue
            if number < len(lines) and re.fullmatch(r"\|?[\s:|-]+", lines[number].strip()):  # header row
                in_table = [c.lower() for c in cells[:2]] == ["variable", "default"]
                continue
            if not in_table or not re.search(r"`(LLM_OTEL|OTEL)_", cells[0]):
                continue
            names = _names(cells[0])
            if names is None:
                continue
            values = [v.strip() for v in cells[1].split(", ")]
            if len(values) == 1:
                values = values * len(names)
            assert len(values) == len(names), f"{path.name}:{number}: {len(names)} variables, {len(values)} defaults"
            rows.append((path.name, number, names, values))
    return rows


_MENTION = re.compile(r"((?:`{1,2}(?:LLM_OTEL|OTEL)_[A-Z0-9_]+`{1,2}(?:\s*/\s*)?)+)\s+\(([^()]*)\)")
#: ``VARIABLE=value`` (default)
_ASSIGNED = re.compile(r"`{1,2}((?:LLM_OTEL|OTEL)_[A-Z0-9_]+)=([^`]+)`{1,2}\s+\(default\)")
#: ``VARIABLE``, default value
_COMMA_DEFAULT = re.compile(r"`{1,2}((?:LLM_OTEL|OTEL)_[A-Z0-9_]+)`{1,2},\s+default\s+([-\w.]+)")
_LITERAL = re.compile(r"(default:? )?`{0,2}([-+\w.,]+|latency=[\w.=,]+)`{0,2}( s| MiB)?")


def mentions() -> list[tuple[str, int, list[str], str]]:
    """``(file, line, variables, stated default)`` for each ``VARIABLE (default)`` in the docs' prose
    and the manuals' docstrings, where the parenthesis holds a plain value (before any ``:``/``,``
    explanation)."""
    out = []
    for path in DOCS + MANUALS:
        text = path.read_text(encoding="utf-8")
        for match in _MENTION.finditer(text):
            if match.group(0).startswith("|"):
                continue
            stated = re.split(r":|;|, | - ", match[2], maxsplit=1)[0].strip()
            if not _LITERAL.fullmatch(stated) or stated.startswith("e.g"):
                continue
            names = re.findall(r"[A-Z][A-Z0-9_]{4,}", match[1])
            out.append((path.name, text.count("\n", 0, match.start()) + 1, names, stated))
        for pattern in (_ASSIGNED, _COMMA_DEFAULT):
            for match in pattern.finditer(text):
                out.append((path.name, text.count("\n", 0, match.start()) + 1, [match[1]], match[2]))
    return out


def test_every_setting_has_a_documented_default():
    documented = {name for _, _, names, _ in table_rows() for name in names}
    missing = sorted(set(declared()) - documented)
    assert not missing, f"variables the settings read without a row in a configuration table: {missing}"


def test_documented_table_defaults_equal_the_declared_defaults():
    known = declared()
    wrong = [
        f"{file}:{line} {name}: documented {value!r}, declared {known[name]!r}"
        for file, line, names, values in table_rows()
        for name, value in zip(names, values)
        if name in known and not matches(value, known[name])
    ]
    assert not wrong, "\n".join(wrong)


def test_documented_defaults_in_prose_and_docstrings_equal_the_declared_defaults():
    known = declared()
    checked = [
        (file, line, name, stated) for file, line, names, stated in mentions() for name in names if name in known
    ]
    assert len(checked) >= 40, checked  # the check sees the mentions it is meant to see
    wrong = [
        f"{file}:{line} {name}: documented {stated!r}, declared {known[name]!r}"
        for file, line, name, stated in checked
        if not matches(stated, known[name])
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_each_kind_of_table_row():
    rows = {(name, value) for _, _, names, values in table_rows() for name, value in zip(names, values)}
    assert ("LLM_OTEL_CONTENT_MAX_CHARS", "`4096`") in rows
    assert ("LLM_OTEL_VRAM_CRITICAL_HOLD_S", "10") in rows  # suffix expanded from the row's first name
    assert ("LLM_OTEL_TIERS_FILE", "unset") in rows
    assert ("OTEL_EXPORTER_PROMETHEUS_HOST", "`localhost`") in rows


@pytest.mark.parametrize(
    "text, default, expected",
    [
        ("`4096`", 4096, True),
        ("`4.0`", 4.0, True),
        ("30 s", 30.0, True),
        ("2", 2.0, True),
        ("0.80", 0.8, True),
        ("`3145728`", 3 * 1024 * 1024, True),
        ("3 MiB", 3 * 1024 * 1024, True),
        ("default ``localhost``", "localhost", True),
        ("`true`", True, True),
        ("unset", None, True),
        ("`auto`", "auto", True),
        ("latency=0.4,errors=0.3,gpu=0.2,uptime=0.1", {"latency": 0.4, "errors": 0.3, "gpu": 0.2, "uptime": 0.1}, True),
        ("on", True, True),
        ("8", 4096, False),
        ("`false`", True, False),
        ("0", None, False),
        ("`tree`", "auto", False),
    ],
)
def test_matches_reads_the_documented_forms(text, default, expected):
    assert matches(text, default) is expected


def test_settings_defaults_are_what_from_env_reads_from_an_empty_environment():
    assert Settings.from_env({}) == dataclasses.replace(Settings(), signals=SignalsConfig.from_env({}))
    assert SignalsConfig.from_env({}) == SignalsConfig()
