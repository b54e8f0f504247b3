"""Writes the LightLLM contract goldens (tests/contracts/goldens/lightllm-*.json) from LightLLM source.

What a golden holds, for one LightLLM commit, read with ``ast`` (nothing of LightLLM is imported or
copied):

* ``targets``: the signature of every function llm-otel hooks (the table in
  ``llm_otel/instrumentation/lightllm/hooks.py``) plus the engine methods the adapter calls on
  LightLLM's objects - module, class path, name, sync/async, parameter names/kinds/defaults
  (``tests/contracts/signatures.py``, the extractor shared with the vLLM contracts);
* ``types``: what the source fixes about the values the adapter reads: the ctypes field types of
  the shared-memory ``Req`` / ``SamplingParams`` structs, the annotated fields of the
  ``GroupReqIndexes`` / ``GroupReqObjs`` dataclasses, the numpy dtype of ``ReqIDGenerator``'s id
  array (so ids are numpy integers), the expression ``generate_id`` returns, the keys of the
  per-token ``metadata`` dicts ``HttpServerManager`` yields, the instance attributes
  ``InferReq`` / ``InferenceContext`` / ``RouterManager`` / ``HttpServerManagerForPDMaster`` set,
  and the exceptions ``HttpServerManagerForPDMaster`` raises;
* ``modules``: every module under ``lightllm/server`` and ``lightllm/utils`` (the stand-in trees in
  tests/lightllm_layouts may only have modules the real version has).

Regenerate (the goldens in the repo come from ModelTC/lightllm main @ fc72ffab and tag v1.0.1)::

    git clone https://github.com/ModelTC/lightllm /tmp/lightllm
    python tests/contracts/lightllm_goldens.py --git-dir /tmp/lightllm/.git \\
        --ref main=fc72ffab --ref v1.0.1=v1.0.1

The ``pr965`` golden is of the PR's head commit 746bf849, which later clones no longer hold; targets
(and ``types`` entries) added to the hook table since are filled in from the commit that merged the PR (538487aab, whose
files of those targets are the PR's: the merge left them as they were on main), and listed under
``filled_from`` in the golden::

    python tests/contracts/lightllm_goldens.py --git-dir /tmp/lightllm/.git --fill pr965=538487aab

or from a checkout's working tree (the name becomes the file name, ``lightllm-<name>.json``)::

    python tests/contracts/lightllm_goldens.py --checkout /path/to/lightllm --name main

Run from the repository root with llm-otel importable (``PYTHONPATH=src``): the target list is
read from the hook table itself, so a new hook gets a golden entry on the next regeneration, and
tests/contracts/test_lightllm_contract.py fails until it has one.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDENS = os.path.join(HERE, "goldens")
sys.path.insert(0, HERE)

import signatures  # noqa: E402  (tests/contracts/signatures.py)

OBJS = "lightllm.server.core.objs"
HTTP = "lightllm.server.httpserver.manager"
INFER = "lightllm.server.router.model_infer.infer_batch"
ROUTER = "lightllm.server.router.manager"
PD_MASTER = "lightllm.server.httpserver_for_pd_master.manager"

# engine methods the adapter calls (not wrapped) on objects it is handed
CALLED = [
    (f"{OBJS}.req", "FinishStatus.is_finished"),
    (f"{OBJS}.req", "FinishStatus.get_finish_reason"),
    (f"{OBJS}.req", "Req.to_router_rpc_obj"),
    (f"{OBJS}.io_objs.group_req", "GroupReqObjs.to_group_req_index"),
    ("lightllm.server.req_id_generator", "ReqIDGenerator.generate_id"),
    ("lightllm.server.multimodal_params", "MultimodalParams.to_dict"),
    ("lightllm.utils.dist_utils", "get_current_rank_in_dp"),
]
# classes whose fields the adapter reads off instances it is handed (the golden keeps their fields)
READ = [
    ("lightllm.server.pd_io_struct", "KVMoveTask"),
    ("lightllm.server.pd_io_struct", "DecodeNodeInfo"),
]


def hook_targets() -> list[tuple[str, str]]:
    """Every hooked LightLLM target (hooks.py), the carrier's class, :data:`CALLED` and :data:`READ`."""
    from llm_otel.instrumentation.lightllm.hooks import HOOKS, SETSTATE

    seen, out = set(), []
    for module, qualname in (
        [(h.module, h.target) for h in HOOKS] + [(SETSTATE.module, "MultimodalParams")] + CALLED + READ
    ):
        if (module, qualname) not in seen:
            seen.add((module, qualname))
            out.append((module, qualname))
    return out


def _class(source: signatures.Source, module: str, name: str) -> ast.ClassDef | None:
    located = source.module_file(module)
    if located is None:
        return None
    for node in ast.parse(located[1]).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def ctypes_fields(source: signatures.Source, module: str, name: str) -> dict[str, str] | None:
    """``{field: type expression}`` of a ctypes struct's ``_fields_`` list literal."""
    cls = _class(source, module, name)
    if cls is None:
        return None
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_fields_" for t in stmt.targets):
            return {
                elt.elts[0].value: ast.unparse(elt.elts[1])
                for elt in stmt.value.elts
                if isinstance(elt, ast.Tuple) and isinstance(elt.elts[0], ast.Constant)
            }
    return None


def dataclass_fields(source: signatures.Source, module: str, name: str) -> dict[str, str] | None:
    cls = _class(source, module, name)
    if cls is None:
        return None
    return {
        stmt.target.id: ast.unparse(stmt.annotation)
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def self_attributes(source: signatures.Source, module: str, name: str) -> list[str] | None:
    """Sorted names assigned as ``self.<name> = ...`` anywhere in the class's methods."""
    cls = _class(source, module, name)
    if cls is None:
        return None
    names = set()
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                    and isinstance(sub.ctx, ast.Store)
                ):
                    names.add(sub.attr)
    return sorted(names)


def id_generator(source: signatures.Source) -> dict[str, Any] | None:
    """The dtype keyword of the array ``ReqIDGenerator.__init__`` keeps its ids in, and what
    ``generate_id`` returns (through the local it assigns)."""
    cls = _class(source, "lightllm.server.req_id_generator", "ReqIDGenerator")
    if cls is None:
        return None
    out: dict[str, Any] = {"dtype": None, "returns": None}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    for kw in node.keywords:
                        if kw.arg == "dtype":
                            out["dtype"] = ast.unparse(kw.value)
        if isinstance(fn, ast.FunctionDef) and fn.name == "generate_id":
            assigned = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    assigned[node.targets[0].id] = ast.unparse(node.value)
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and node.value is not None:
                    text = ast.unparse(node.value)
                    out["returns"] = assigned.get(text, text)
    return out


def metadata_keys(source: signatures.Source) -> list[str] | None:
    """Keys of the per-token ``metadata`` dicts built in ``HttpServerManager`` (dict literals
    assigned to ``metadata`` and ``metadata["key"] = ...``)."""
    cls = _class(source, HTTP, "HttpServerManager")
    if cls is None:
        return None
    keys = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "metadata" and isinstance(node.value, ast.Dict):
                    keys.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "metadata"
                    and isinstance(target.slice, ast.Constant)
                ):
                    keys.add(target.slice.value)
    return sorted(keys)


def raised(source: signatures.Source, module: str, name: str) -> list[str] | None:
    """Sorted source text of every exception a class's methods raise (``raise X(...)``; bare
    re-raises and ``raise e`` of a caught exception left out)."""
    cls = _class(source, module, name)
    if cls is None:
        return None
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            out.add(ast.unparse(node.exc))
    return sorted(out)


def modules(root: str) -> list[str]:
    out = []
    for top in ("lightllm/server", "lightllm/utils"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, top)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
                    out.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(out)


def build(root: str, **meta: Any) -> dict[str, Any]:
    """The golden document of the LightLLM source tree at ``root`` (the directory holding ``lightllm/``)."""
    source = signatures.Source(root)
    return signatures.golden(
        "ModelTC/lightllm",
        signatures.extract(source, hook_targets()),
        types=types_of(source),
        modules=modules(root),
        **meta,
    )


def types_of(source: signatures.Source) -> dict[str, Any]:
    """The ``types`` section of a golden (see the module docstring)."""
    return {
        "Req._fields_": ctypes_fields(source, f"{OBJS}.req", "Req"),
        "FinishStatus._fields_": ctypes_fields(source, f"{OBJS}.req", "FinishStatus"),
        "SamplingParams._fields_": ctypes_fields(source, f"{OBJS}.sampling_params", "SamplingParams"),
        "GroupReqIndexes": dataclass_fields(source, f"{OBJS}.io_objs.group_req", "GroupReqIndexes"),
        "GroupReqObjs": dataclass_fields(source, f"{OBJS}.io_objs.group_req", "GroupReqObjs"),
        "ReqIDGenerator": id_generator(source),
        "HttpServerManager.metadata": metadata_keys(source),
        "InferReq.self": self_attributes(source, INFER, "InferReq"),
        "InferenceContext.self": self_attributes(source, INFER, "InferenceContext"),
        "RouterManager.self": self_attributes(source, ROUTER, "RouterManager"),
        "HttpServerManagerForPDMaster.self": self_attributes(source, PD_MASTER, "HttpServerManagerForPDMaster"),
        "HttpServerManagerForPDMaster.raises": raised(source, PD_MASTER, "HttpServerManagerForPDMaster"),
    }


def write(document: dict[str, Any], name: str) -> str:
    os.makedirs(GOLDENS, exist_ok=True)
    path = os.path.join(GOLDENS, f"lightllm-{name}.json")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(document, indent=1, sort_keys=True) + "\n")
    return path


def from_git(git_dir: str, ref: str) -> tuple[str, dict[str, str]]:
    """Export ``lightllm/`` at ``ref`` into a temporary directory; returns it and the commit facts."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True).stdout

    commit = git("rev-parse", f"{ref}^{{commit}}").decode().strip()
    date = git("show", "-s", "--format=%cs", commit).decode().strip()
    tmp = tempfile.mkdtemp(prefix="lightllm-golden-")
    archive = os.path.join(tmp, "src.tar")
    with open(archive, "wb") as fh:
        fh.write(git("archive", "--format=tar", commit, "lightllm"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)  # noqa: S202
    return tmp, {"commit": commit, "commit_date": date, "ref": ref}


def fill(git_dir: str, name: str, ref: str) -> str:
    """Add to golden ``name`` the hook targets it lacks, read from the source at ``ref``."""
    with open(os.path.join(GOLDENS, f"lightllm-{name}.json"), encoding="utf-8") as fh:
        document = json.load(fh)
    root, meta = from_git(git_dir, ref)
    missing = [(m, q) for m, q in hook_targets() if f"{m}:{q}" not in document["targets"]]
    source = signatures.Source(root)
    document["targets"].update(signatures.extract(source, missing))
    new_types = {k: v for k, v in types_of(source).items() if k not in document["types"]}
    document["types"].update(new_types)
    filled = document.setdefault("filled_from", {"commit": meta["commit"], "ref": ref, "targets": []})
    filled["targets"] = sorted(set(filled["targets"]) | {f"{m}:{q}" for m, q in missing})
    if new_types:
        filled["types"] = sorted(set(filled.get("types", [])) | set(new_types))
    return write(document, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--git-dir", help="a LightLLM git directory (bare or .git)")
    where.add_argument("--checkout", help="a LightLLM working tree (the directory holding lightllm/)")
    parser.add_argument("--ref", action="append", default=[], help="NAME=REF (with --git-dir; repeatable)")
    parser.add_argument("--name", help="golden name (with --checkout)")
    parser.add_argument(
        "--fill", action="append", default=[], help="NAME=REF: add the golden's missing targets, read at REF"
    )
    args = parser.parse_args(argv)
    for item in args.fill:
        name, _, ref = item.partition("=")
        print(fill(args.git_dir, name, ref))
    if args.fill:
        return 0
    if args.checkout:
        if not args.name:
            parser.error("--checkout needs --name")
        print(write(build(args.checkout, ref="working tree"), args.name))
        return 0
    for item in args.ref or ["main=main"]:
        name, _, ref = item.partition("=")
        root, meta = from_git(args.git_dir, ref or name)
        print(write(build(root, **meta), name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
