"""Contract: every SGLang function llm-otel hooks, and every SGLang field its wrappers read, held to
SGLang's real source - the committed goldens of the supported releases (tests/contracts/sglang-<version>.json,
written by tests/contracts/sglang_golden.py from each release's wheel) and the SGLang installed in
.venv-sglang. The import probe (the third-party packages SGLang's server modules import at module
level) names what a release started importing, so the CPU environment (tests/support/sglang_env)
can follow."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
from contracts import sglang_golden, signatures
from support import sglang_server

from llm_otel.instrumentation.sglang.hooks import HOOKS, SERVING

HERE = os.path.dirname(os.path.abspath(__file__))


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(path)))


GOLDENS = sorted(glob.glob(os.path.join(HERE, "sglang-*.json")), key=_version_key)

# What each wrapper factory reads from the hooked call, by position after ``self``.
# Source: instrumentation/sglang/tokenizer.py, scheduler.py, logits.py, adapter.py.
READS: dict[str, dict] = {
    "tokenizer.init_req_state": {"at": {0: "obj", 1: "request"}},
    "tokenizer.generate_request": {"at": {0: "obj"}},
    "tokenizer.batch_output": {"at": {0: "recv_obj"}},
    "tokenizer.abort": {"at": {0: "rid"}},
    "carrier_getstate": {},
    "scheduler.init": {},
    "scheduler.handle_generate_request": {"at": {0: "recv_req"}},
    "scheduler.run_batch": {"at": {0: "batch"}},
    "scheduler.batch_result": {"at": {0: "batch"}},
    "scheduler.abort": {"at": {0: "recv_req"}},
    "scheduler.abort_output": {"at": {0: "abort_req", 1: "req"}},
    "scheduler.logits.sampler": {"at": {0: "logits_output"}},
}

# Packages a release started importing at module level, with what the CPU environment does about
# them (requirements.txt, a stand-in, or why nothing is needed). Empty between 0.5.22 and 0.5.23.
KNOWN_NEW_IMPORTS: dict[str, dict[str, str]] = {}


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def reads_problems(document: dict) -> list[str]:
    """What the wrappers read that the source in ``document`` does not offer."""
    problems = []
    targets = document["targets"]
    version = document.get("sglang_version")
    for hook in HOOKS:
        if version and version not in [v.strip() for v in hook.layout.split(",")]:
            continue  # a hook of later releases only (hooks.py says what the earlier ones do)
        entry = targets[f"{hook.module}:{hook.target}"]
        if not entry["found"]:
            problems.append(f"{hook.qualname}: not found ({entry['missing']})")
            continue
        params = entry["params"]
        if params is None:
            problems.append(f"{hook.qualname}: not a function ({entry['kind']})")
            continue
        after_self = params[1:] if entry["classes"] else params
        names = [p["name"] for p in params]
        for position, name in READS[hook.factory].get("at", {}).items():
            if (
                position >= len(after_self)
                or after_self[position]["name"] != name
                or after_self[position]["kind"] == "KEYWORD_ONLY"
            ):
                problems.append(
                    f"{hook.qualname}: expected parameter {position} after self to be {name!r}, source has {names}"
                )
    for (module, cls), fields in sglang_golden.CLASS_FIELDS.items():
        entry = targets[f"{module}:{cls}"]
        if not entry["found"]:
            problems.append(f"{module}:{cls}: not found ({entry['missing']})")
            continue
        gone = sorted(set(fields) - set(entry["fields"]))
        if gone:
            problems.append(f"{module}:{cls}: no field(s) {', '.join(gone)}")
    return problems


def test_every_hook_factory_has_its_reads_listed():
    assert {h.factory for h in HOOKS} <= set(READS)


def test_goldens_of_the_last_two_releases_cover_every_hooked_target_and_field_class():
    assert len(GOLDENS) >= 2, "goldens of at least the last two SGLang releases"
    wanted = {f"{m}:{q}" for m, q in sglang_golden.targets()}
    for path in GOLDENS:
        assert set(load(path)["targets"]) == wanted, f"{os.path.basename(path)} is stale: run sglang_golden.py"


@pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p) for p in GOLDENS])
def test_every_serving_gate_is_a_function_in_each_golden_release(path):
    """hooks.SERVING decides which SGLang processes get providers: a gate a release renamed would
    leave that process kind uninstrumented (the scheduler, or --enable-trace's provider first)."""
    targets = load(path)["targets"]
    missing = [
        f"{m}:{t}" for m, t in SERVING if not targets[f"{m}:{t}"]["found"] or targets[f"{m}:{t}"]["params"] is None
    ]
    assert missing == []


@pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p) for p in GOLDENS])
def test_wrappers_read_what_each_golden_release_has(path):
    assert reads_problems(load(path)) == []


def test_the_import_probe_names_what_each_release_started_importing():
    """Between consecutive goldens, every package a release started importing at module level is
    known (KNOWN_NEW_IMPORTS says what the CPU environment does about it)."""
    for previous, current in zip(GOLDENS, GOLDENS[1:]):
        new = sglang_golden.new_imports(load(previous), load(current))
        version = load(current)["sglang_version"]
        unknown = sorted(set(new) - set(KNOWN_NEW_IMPORTS.get(version, {})))
        assert unknown == [], f"SGLang {version} started importing {unknown}: see tests/support/sglang_env"


def test_the_import_probe_sees_a_new_import(tmp_path):
    """The probe is not vacuous: a module-level import added to a copy of the newest golden's source
    set shows up as new."""
    newest = load(GOLDENS[-1])
    grown = {**newest, "imports": sorted([*newest["imports"], "brand_new_kernel_pkg"])}
    assert sglang_golden.new_imports(newest, grown) == ["brand_new_kernel_pkg"]
    pkg = tmp_path / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "import os\nimport brand_new_kernel_pkg.ops\ntry:\n    import optional_pkg\nexcept ImportError:\n    pass\n"
    )
    assert sglang_golden.imports(str(tmp_path)) == ["brand_new_kernel_pkg"]


def test_installed_sglang_matches_its_golden_exactly():
    """The SGLang in .venv-sglang (the one the server tests run) against its golden; outside CI
    skipped when the environment is absent."""
    if sglang_server.unavailable_reason() and not os.environ.get("CI"):
        pytest.skip(sglang_server.unavailable_reason())
    (root,) = sorted(str(p.parent) for p in sglang_server.VENV.glob("lib/python3*/site-packages/sglang"))
    current = sglang_golden.build(root, "installed")
    path = sglang_golden.golden_path(current["sglang_version"])
    assert os.path.exists(path), f"no golden for SGLang {current['sglang_version']}"
    golden = load(path)
    assert signatures.compare_all(golden["targets"], current["targets"]) == []
    assert golden["imports"] == current["imports"]
    assert reads_problems(current) == []


def test_a_drifted_target_is_reported():
    """reads_problems is not vacuous: a golden whose scheduler renamed run_batch's ``batch`` and whose
    ScheduleBatch lost ``reqs`` is reported for both."""
    document = load(GOLDENS[-1])
    entry = document["targets"]["sglang.srt.managers.scheduler:Scheduler.run_batch"]
    entry["params"][1]["name"] = "schedule_batch"
    fields = document["targets"]["sglang.srt.managers.schedule_batch:ScheduleBatch"]["fields"]
    fields.remove("reqs")
    problems = reads_problems(document)
    assert any("run_batch" in p and "'batch'" in p for p in problems)
    assert any("ScheduleBatch" in p and "reqs" in p for p in problems)
