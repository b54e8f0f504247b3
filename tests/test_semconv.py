"""The registry in semconv/ is valid, the generated code is current, and names come only from it."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml
from support.semconv_live import SpanLog, check

from llm_otel._semconv_registry import generated_files, load_registry, validate

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_registry_is_valid():
    assert validate(load_registry()) == []


def test_generated_code_and_docs_are_up_to_date():
    reg = load_registry()
    stale = [
        str(p.relative_to(REPO))
        for p, content in generated_files(reg).items()
        if not p.exists() or p.read_text() != content
    ]
    assert stale == [], "run `python -m llm_otel._semconv_registry` to regenerate"


def test_semconv_check_command_passes():
    done = subprocess.run([sys.executable, "-m", "llm_otel.cli", "semconv-check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_official_names_are_mirrored_with_their_official_types():
    reg = load_registry()
    assert reg.attributes["gen_ai.usage.input_tokens"].type == "int"
    assert reg.attributes["gen_ai.response.finish_reasons"].type == "string[]"
    assert reg.attributes["gen_ai.request.top_k"].type == "double"
    assert reg.attributes["gen_ai.provider.name"].origin == "official"
    assert "gen_ai.usage.prompt_tokens" not in reg.attributes and "gen_ai.system" not in reg.attributes
    metrics = reg.metric_names()
    ttft = metrics["gen_ai.server.time_to_first_token"]
    assert ttft["instrument"] == "histogram" and ttft["unit"] == "s"
    assert ttft["annotations"]["bucket_boundaries"][:3] == [0.001, 0.005, 0.01]


@pytest.fixture
def registry_copy(tmp_path):
    root = tmp_path / "model"
    shutil.copytree(load_registry().root, root)
    return root


def _edit(path: pathlib.Path, fn) -> None:
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.mark.parametrize(
    "mutation, expected",
    [
        (
            lambda d: d["groups"][0]["attributes"].append(dict(d["groups"][0]["attributes"][0])),
            "duplicate attribute id",
        ),
        (lambda d: d["groups"][0]["attributes"][0].update(type="float"), "unknown type"),
        (lambda d: d["groups"][0]["attributes"][0].pop("examples"), "string attributes need examples"),
        (
            lambda d: d["groups"][0]["attributes"].append(
                {"id": "vendor.thing", "type": "int", "stability": "development", "brief": "x", "examples": [1]}
            ),
            "live under 'llm.'",
        ),
    ],
)
def test_validator_rejects_broken_registries(registry_copy, mutation, expected):
    _edit(registry_copy / "llm" / "registry.yaml", mutation)
    problems = validate(load_registry(registry_copy))
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    "mutation, expected",
    [
        (
            lambda d: d["groups"][0]["attributes"].append({"ref": "llm.nope", "requirement_level": "required"}),
            "does not resolve",
        ),
        (lambda d: d["groups"][0]["attributes"][0].update(requirement_level="sometimes"), "unknown requirement_level"),
        (lambda d: d["groups"][0].update(span_kind="sideways"), "span_kind"),
        # a second group for an existing span name would silently replace the first generated constant
        (lambda d: d["groups"].append(dict(d["groups"][0], id=d["groups"][0]["id"] + ".again")), "already declared"),
    ],
)
def test_validator_rejects_broken_span_groups(registry_copy, mutation, expected):
    _edit(registry_copy / "llm" / "spans.yaml", mutation)
    assert any(expected in p for p in validate(load_registry(registry_copy)))


def test_validator_rejects_bad_metric_units_and_buckets(registry_copy):
    def mutate(d):
        d["groups"][0]["unit"] = "seconds"
        d["groups"][1]["annotations"]["bucket_boundaries"] = [1, 0.5]

    _edit(registry_copy / "llm" / "metrics.yaml", mutate)
    problems = validate(load_registry(registry_copy))
    assert any("UCUM" in p for p in problems) and any("strictly increasing" in p for p in problems)


def test_live_check_flags_undeclared_names_and_wrong_types():
    log = SpanLog()
    log.add(
        "llm_otel.instrumentation.vllm",
        "llm.prompt",
        {"gen_ai.usage.input_tokens": "12", "llm.made_up": 1},
        [("llm.token", {"llm.token.index": 0.5})],
    )
    log.add("llm_otel", "llm.mystery", {}, [("llm.nope", {})])
    log.add("someone.else", "whatever", {"x": 1}, [])  # not our scope: ignored
    log.add("llm_otel", "chat tiny", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny"}, [])
    problems = check(log, load_registry())
    assert problems == sorted(
        [
            "event 'llm.token': attribute 'llm.token.index' emitted as double, declared int",
            "span 'llm.mystery' is not declared in semconv/",
            "span 'llm.mystery': event 'llm.nope' is not declared in semconv/",
            "span 'llm.prompt': attribute 'gen_ai.usage.input_tokens' emitted as string, declared int",
            "span 'llm.prompt': attribute 'llm.made_up' is not declared in semconv/",
        ]
    )


@pytest.mark.case("C07")
def test_names_come_only_from_our_generated_module():
    """No llm-otel module imports a third-party semconv constants package, and no module outside
    the generated one spells an attribute or metric name as a string literal."""
    src = REPO / "src" / "llm_otel"
    reg = load_registry()
    names = set(reg.attributes) | set(reg.metric_names()) | set(reg.event_names())
    offenders = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for m in mods:
                    if m.startswith(
                        ("opentelemetry.semconv", "opentelemetry_semantic_conventions", "opentelemetry.semconv_ai")
                    ):
                        offenders.append(f"{rel}: imports {m}")
            if (
                rel.parts[0] != "semconv"
                and isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in names
            ):
                offenders.append(f"{rel}:{node.lineno}: literal {node.value!r}")
    assert offenders == []
