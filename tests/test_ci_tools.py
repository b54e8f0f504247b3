"""A tool a test needs and CI lacks fails the run instead of skipping in silence: tests ask
support/tools.py, which reads ``CI``, and ``.ci/run`` sets ``CI`` before the suite runs."""

from __future__ import annotations

import pathlib
import re

import pytest
from support import tools

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("ci", [None, "", "0", "false", "no"])
def test_a_missing_tool_skips_outside_ci(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="promtool is not available: apt-get install prometheus"):
        tools.require("promtool", None, "apt-get install prometheus")
    assert tools.require("promtool", "/usr/bin/promtool", "") == "/usr/bin/promtool"


@pytest.mark.parametrize("ci", ["true", "1", "yes", "TRUE"])
def test_a_missing_tool_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="no-such-tool-7f3a is not available: .*CI must not skip"):
        tools.binary("no-such-tool-7f3a", "the CUDA toolkit")
    with pytest.raises(pytest.fail.Exception, match="the NVTX 3 headers is not available"):
        tools.require("the NVTX 3 headers", [], "the CUDA toolkit")
    assert tools.binary("sh", "") == tools.require("sh", tools.binary("sh", ""), "")  # found: no failure


def test_ci_run_sets_ci_before_it_runs_the_suite():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    export = [i for i, line in enumerate(lines) if re.fullmatch(r'export CI="\$\{CI:-true\}"', line.strip())]
    suite = [i for i, line in enumerate(lines) if re.search(r"-m pytest\b", line)]
    assert export and suite and export[0] < suite[0], lines


def test_no_test_skips_for_a_missing_tool_on_its_own():
    """Skips for a tool, a compiler, headers or an environment .ci/install.sh builds go through
    support/tools.py (vLLM itself: .ci/install.sh fails when it cannot import it)."""
    own = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pytest\.skip\(|skipif\(", line) and re.search(
                r"not installed|not on PATH|apt-get|install\.sh|nvcc|headers|compiler", line
            ):
                if "vLLM is not installed" not in line:
                    own.append(f"{path.name}:{n}: {line.strip()}")
    assert own == []
