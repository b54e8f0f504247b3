"""benchmarks/gpu/device_check.py in its CPU dry run: every check's code path runs (NumPy ring,
host timers, small vocabulary) and the report is one table whose rows the docs explain
(docs/gpu.md, "Device check"). The numbers mean nothing here; only a GPU run measures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_device_check_dry_run_passes_and_prints_one_table(tmp_path):
    out = tmp_path / "device_check.md"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "gpu", "device_check.py"),
            "--cpu-dry-run",
            "--steps",
            "16",
            "--captures",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    table = [line for line in out.read_text().splitlines() if line.startswith("|")]
    assert table[0] == "| check | result |"
    rows = {line.split(" | ")[0].lstrip("| ") for line in table[2:]}
    for label in (
        "steps complete (begin+end records)",
        "MRv2 sampler hook: spans / chosen, step us bare / hooked",
        "MRv2 spec decode: spans / chosen, wrong step counts, sampled log-prob err",
        "overlap: sampler call host us behind 2 ms of device work, none / one chosen",
        "NVTX",
        "NVML",
        "graph capture while drain polls (gate)",
    ):
        assert label in rows
    results = json.loads((tmp_path / "device_check.json").read_text())
    assert results["failures"] == []
    assert results["mrv2_hook"]["spans"] == results["mrv2_hook"]["chosen"] == 32
    spec = results["spec_decode_overlap"]
    assert spec["spans"] == spec["chosen"] == 8 and spec["wrong_step_counts"] == []
    assert spec["sampled_logprob_max_abs_err"] < 1e-5 and set(spec["overlap"]) == {"none", "one"}
    assert results["logit_reduction"]["top1_matches"] and results["logit_reduction"]["nonfinite_row_flagged"]
    assert sorted(results["logit_reduction"]["rows"]) == ["256", "64", "8"]


def test_the_shell_wrapper_says_it_cannot_run_without_cuda(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the wrapper would run the real check")
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu", "device_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot run here" in done.stderr
    assert "cuda stack:" in (tmp_path / "device_env.txt").read_text()
