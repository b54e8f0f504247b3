"""Write an SGLang contract golden: every target of llm-otel's SGLang hook table
(``llm_otel.instrumentation.sglang.hooks.HOOKS``), the SGLang classes whose fields the wrappers read
(:data:`CLASS_FIELDS`), and the import probe (:func:`imports`: the third-party top-level packages
SGLang's server modules import at module level), extracted with ``ast`` from the release's wheel
(nothing is imported; SGLang has no CPU wheel, its wheel is read in place).

    pip download --no-deps 'sglang==0.5.23' -d /tmp/sglang-wheels
    python tests/contracts/sglang_golden.py --source /tmp/sglang-wheels/sglang-0.5.23-*.whl

The golden lands in ``tests/contracts/sglang-<version>.json``; ``test_sglang_contract.py`` checks
every golden against what the wrappers read, the .venv-sglang install against its golden, and
prints, for a new release, the packages it started importing (:func:`new_imports`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import warnings
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ -> `contracts` package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))  # llm_otel of this checkout

from contracts import signatures  # noqa: E402

#: SGLang classes (module, class) -> the data attributes llm-otel's wrappers read from them
CLASS_FIELDS: dict[tuple[str, str], list[str]] = {
    # instrumentation/sglang/tokenizer.py
    # (also read, but assigned outside __init__, where the golden's field list does not look:
    # TokenizerManager.rid_to_state / .served_model_name, GenerateReqInput.parallel_sample_num)
    ("sglang.srt.managers.tokenizer_manager", "TokenizerManager"): ["enable_trace"],
    ("sglang.srt.managers.tokenizer_manager", "ReqState"): ["time_stats"],
    ("sglang.srt.managers.io_struct", "GenerateReqInput"): [
        "external_trace_header",
        "rid",
        "sampling_params",
    ],
    ("sglang.srt.managers.io_struct", "BatchStrOutput"): [
        "cached_tokens",
        "completion_tokens",
        "finished_reasons",
        "output_ids",
        "prompt_tokens",
    ],
    ("sglang.srt.managers.io_struct", "BaseBatchReq"): ["rids"],
    ("sglang.srt.managers.io_struct", "BaseReq"): ["rid"],
    ("sglang.srt.managers.io_struct", "TokenizedGenerateReqInput"): ["time_stats"],
    ("sglang.srt.managers.io_struct", "AbortReq"): ["abort_all"],
    # instrumentation/sglang/scheduler.py
    ("sglang.srt.managers.schedule_batch", "ScheduleBatch"): ["extend_num_tokens", "forward_mode", "reqs"],
    ("sglang.srt.managers.schedule_batch", "Req"): ["finished_reason", "origin_input_ids", "output_ids", "rid"],
    # instrumentation/sglang/logits.py
    ("sglang.srt.layers.logits_processor", "LogitsProcessorOutput"): ["next_token_logits"],
}

#: the modules whose imports the probe reads: what the CPU server loads through its entry point
PROBE_PREFIXES = ("sglang/srt/",)


def targets() -> list[tuple[str, str]]:
    """Every hooked target, every gate (``hooks.SERVING``: the calls that make a process one llm-otel
    serves), then every class of :data:`CLASS_FIELDS` (order kept, no repeats)."""
    from llm_otel.instrumentation.sglang.hooks import HOOKS, SERVING

    seen: list[tuple[str, str]] = []
    for item in [(h.module, h.target) for h in HOOKS] + list(SERVING) + list(CLASS_FIELDS):
        if item not in seen:
            seen.append(item)
    return seen


def _files(path: str):
    """(relpath, text) of every ``sglang/srt/**.py`` of a wheel or a site-packages directory."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                if name.endswith(".py") and name.startswith(PROBE_PREFIXES):
                    yield name, zf.read(name).decode("utf-8", "replace")
        return
    for prefix in PROBE_PREFIXES:
        root = os.path.join(path, *prefix.strip("/").split("/"))
        for folder, _, names in os.walk(root):
            for name in names:
                if name.endswith(".py"):
                    full = os.path.join(folder, name)
                    with open(full, encoding="utf-8", errors="replace") as fh:
                        yield os.path.relpath(full, path), fh.read()


def imports(path: str) -> list[str]:
    """The import probe: third-party top-level packages that ``sglang/srt`` imports at module level
    (outside ``try``: an optional import does not break the server), sorted; stdlib and sglang excluded."""
    found: set[str] = set()
    for _relpath, text in _files(path):
        try:
            with warnings.catch_warnings():  # SGLang's own invalid escape sequences
                warnings.simplefilter("ignore")
                tree = ast.parse(text)
        except SyntaxError:
            continue
        for stmt in tree.body:
            names: list[str] = []
            if isinstance(stmt, ast.Import):
                names = [alias.name for alias in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                names = [stmt.module]
            for name in names:
                top = name.split(".")[0]
                if top != "sglang" and top not in sys.stdlib_module_names and top != "__future__":
                    found.add(top)
    return sorted(found)


def new_imports(previous: dict, current: dict) -> list[str]:
    """Packages ``current`` (a golden) imports at module level that ``previous`` did not."""
    return sorted(set(current.get("imports", [])) - set(previous.get("imports", [])))


def source_version(path: str) -> str:
    """SGLang version of a wheel (its dist-info METADATA) or of a site-packages directory."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            meta = next(n for n in zf.namelist() if re.match(r"sglang-[^/]+\.dist-info/METADATA$", n))
            text = zf.read(meta).decode("utf-8")
    else:
        metas = [n for n in os.listdir(path) if re.match(r"sglang-[^/]+\.dist-info$", n)]
        with open(os.path.join(path, metas[0], "METADATA"), encoding="utf-8") as fh:
            text = fh.read()
    match = re.search(r"^Version: (.+)$", text, re.M)
    if match is None:
        raise LookupError(f"no SGLang version in {path}")
    return match.group(1).strip()


def golden_path(version: str) -> str:
    return os.path.join(HERE, f"sglang-{version.split('+')[0]}.json")


def build(path: str, label: str) -> dict:
    document = signatures.golden(
        label,
        signatures.extract(path, targets()),
        sglang_version=source_version(path),
        generator="tests/contracts/sglang_golden.py",
    )
    document["imports"] = imports(path)
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="an SGLang wheel (.whl) or a site-packages directory")
    parser.add_argument("--out", help="default: tests/contracts/sglang-<version>.json")
    args = parser.parse_args(argv)
    document = build(args.source, os.path.basename(args.source))
    out = args.out or golden_path(document["sglang_version"])
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(document, indent=1, sort_keys=True) + "\n")
    missing = [key for key, entry in document["targets"].items() if not entry["found"]]
    print(
        f"{out}: SGLang {document['sglang_version']}, {len(document['targets'])} targets, "
        f"{len(missing)} not found{': ' + ', '.join(missing) if missing else ''}, "
        f"{len(document['imports'])} imported packages"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
