"""The dependency floors in pyproject.toml are true: llm-otel installed with every direct dependency
pinned to exactly its floor resolves, passes a small test subset, and ``opentelemetry-instrument``
reaches spawned children there.

Two floors were false before (issue 18): ``opentelemetry-sdk`` 1.30 has no
``trace._sampling_experimental`` (``instrument()`` crashed), and ``opentelemetry-instrumentation``
0.51b0-0.62b0 removes its own directory from ``PYTHONPATH`` for good, so a real LightLLM server (all
of whose processes are spawned or ``Popen``ed) emitted nothing.

Needs PyPI (pip resolves and downloads; the second run comes from pip's cache). The venv is
throwaway, under pytest's tmp dir; nothing is installed in the test environment itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a subset that touches what the floors are about: the SDK's experimental samplers (sampling),
# the instrumentor base class and wrapt post-import hooks (LightLLM, in one process)
SUBSET = ["tests/test_sampling.py", "tests/test_lightllm_unit.py"]
# test tools of that subset, unpinned (they are not llm-otel's dependencies)
TEST_TOOLS = ["pytest", "hypothesis", "pyyaml", "jsonschema"]

pytestmark = [
    pytest.mark.floors,
    pytest.mark.skipif(tomllib is None, reason="reads pyproject.toml with tomllib (Python 3.11+)"),
]


def floors() -> dict[str, str]:
    """``{distribution: floor}`` of pyproject.toml's ``[project] dependencies``; every one must be
    ``name>=version`` (a dependency without a floor has nothing to check)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    out = {}
    for dep in deps:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)\s*", dep)
        assert match, f"dependency {dep!r} is not 'name>=floor'"
        out[match.group(1).lower()] = match.group(2)
    return out


def pins() -> list[str]:
    return [f"{name}=={version}" for name, version in floors().items()]


def pip(*args: str, python: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    if python:
        cmd += ["--python", python]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def norm(version: str):
    from packaging.version import Version  # 1.42 == 1.42.0

    return Version(version)


def test_floors_resolve_to_exactly_the_floors(tmp_path):
    report = tmp_path / "report.json"
    done = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), ROOT, *pins())
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for name, floor in floors().items():
        assert norm(chosen[name]) == norm(floor), (name, chosen[name], floor)


@pytest.fixture(scope="module")
def floor_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("floors") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # editable, as .ci/install.sh installs it (the test session reads semconv/model from the checkout)
    done = pip("install", "--quiet", "-e", ROOT, *pins(), *TEST_TOOLS, python=python, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_the_installed_versions_are_the_floors(floor_venv):
    done = pip("list", "--format=json", python=str(floor_venv / "bin" / "python"))
    installed = {d["name"].lower(): d["version"] for d in json.loads(done.stdout)}
    for name, floor in floors().items():
        assert norm(installed[name]) == norm(floor), (name, installed[name], floor)
    assert "vllm" not in installed and "tritonclient" not in installed and "lightllm" not in installed


def test_a_test_subset_passes_at_the_floors(floor_venv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's installed llm-otel
    done = subprocess.run(
        [str(floor_venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert re.search(r"\d+ passed", done.stdout) and "failed" not in done.stdout


CHILD = (
    "import subprocess, sys; "
    "print('CHILD', subprocess.run([sys.executable, '-c', "
    "'from opentelemetry import trace; "
    "from llm_otel.instrumentation.lightllm import LightLLMInstrumentor as I; "
    "print(I().is_instrumented_by_opentelemetry, type(trace.get_tracer_provider()).__name__)'], "
    "capture_output=True, text=True).stdout.strip())"
)


def test_opentelemetry_instrument_reaches_spawned_children_and_is_quiet_at_the_floors(floor_venv):
    """A child the instrumented process starts is instrumented too (its sitecustomize ran
    llm-otel's instrumentors: the LightLLM one, which has no distribution requirement, is active),
    and no vLLM/Triton/LightLLM is installed there: llm-otel says nothing, and builds no providers
    (they come at the first import of a hooked module)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    done = subprocess.run(
        [str(floor_venv / "bin" / "opentelemetry-instrument"), str(floor_venv / "bin" / "python"), "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CHILD True ProxyTracerProvider" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "llm-otel" not in done.stderr and "llm_otel" not in done.stderr, done.stderr[-3000:]
