"""LightLLM contract: every hooked target and every type the adapter relies on, against goldens
read from the real LightLLM source (main @ fc72ffab and tag v1.0.1; tests/contracts/goldens,
written by tests/contracts/lightllm_goldens.py), and the stand-in trees (tests/lightllm_layouts)
against the same goldens, so neither the hook table nor the stand-ins can drift from the real code.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from contracts import signatures
from contracts.lightllm_goldens import hook_targets
from lightllm_layouts.layers import build_tree

from llm_otel.instrumentation.lightllm.hooks import HOOKS
from llm_otel.instrumentation.lightllm.requests import request_id

GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens")
# hook-table layout name -> golden; stand-in directory -> golden
VERSIONS = {"main": "main", "v1.0": "v1.0.1", "pr965": "pr965"}
STANDINS = {"main": "main", "v1_0": "v1.0.1", "pr965": "pr965"}


def golden(name: str) -> dict:
    with open(os.path.join(GOLDENS, f"lightllm-{name}.json"), encoding="utf-8") as fh:
        return json.load(fh)


# The parameters each wrapper reads from its call, by name (``_bind(...).get(name)``) or by position
# (index into the parameter list, self included for methods), per layout where they differ.
BY_NAME = {
    "http.init": ["args"],
    "http.generate": ["prompt", "sampling_params", "multimodal_params", "request"],
    "http.transfer": ["group_req_objs"],
    "http.abort": ["group_req_id"],
    "router.add_req": ["group_req_indexes"],
    "worker.add_reqs": ["requests"],
    "worker.filter": ["finished_request_ids"],
    "kv.pd_generate": ["sampling_params", "request"],
    "kv.pd_master": ["sampling_params", "multimodal_params", "request"],
    "kv.send": ["move_tasks"],
    "kv.receive": ["move_tasks"],
}
BY_POSITION = {
    "worker.token": {1: "next_token_id", 2: "logprob"},
    "worker.sample": {0: "logits", 1: "reqs"},
}
# exact parameter lists where the adapter's reading depends on the layout (detect_layout too)
EXACT = {
    ("router.decode_batch", "main"): ["self"],
    ("router.decode_batch", "v1.0"): ["self", "batch"],
    ("http.generate", "main"): ["self", "prompt", "sampling_params", "multimodal_params", "request", "is_health_req"],
    ("http.generate", "v1.0"): ["self", "prompt", "sampling_params", "multimodal_params", "request"],
    **{
        ("kv.pd_generate", layout): ["self", "prompt", "sampling_params", "multimodal_params", "request"]
        for layout in ("main", "v1.0", "pr965")
    },
}


@pytest.mark.parametrize("layout", sorted(VERSIONS))
def test_every_hook_of_a_layout_is_in_that_versions_source_and_no_other(layout):
    """The hook table says which layouts have each target; the real source agrees both ways (a
    target listed for the layout exists with the parameters the wrapper reads; one not listed does
    not exist, so its absence is expected and warns nobody)."""
    targets = golden(VERSIONS[layout])["targets"]
    for hook in HOOKS:
        entry = targets[hook.qualname]
        if layout not in hook.layout:
            assert not entry["found"], f"{hook.qualname} exists in {layout} but the table does not say so"
            continue
        assert entry["found"], f"{hook.qualname}: {entry.get('missing')} missing in {layout}"
        names = [p["name"] for p in entry["params"] or ()]
        for name in BY_NAME.get(hook.factory, ()):
            assert name in names, (hook.qualname, layout, name, names)
        for index, name in BY_POSITION.get(hook.factory, {}).items():
            assert names[index] == name, (hook.qualname, layout, names)
        if (hook.factory, layout) in EXACT:
            assert names == EXACT[hook.factory, layout], (hook.qualname, layout, names)
        assert entry["kind"] in ("function", "async_function"), hook.qualname


def test_goldens_cover_the_hook_table():
    """A hook added to the table without regenerating the goldens fails here."""
    for name in VERSIONS.values():
        assert set(golden(name)["targets"]) == {f"{m}:{q}" for m, q in hook_targets()}, name


@pytest.mark.parametrize("version", sorted(VERSIONS.values()))
def test_the_types_the_adapter_relies_on(version):
    types = golden(version)["types"]
    req = types["Req._fields_"]
    for field in ("request_id", "group_req_id", "input_len", "shm_cur_output_len", "prompt_cache_len"):
        ctype = getattr(ctypes, req[field].removeprefix("ctypes."))
        assert issubclass(ctype, ctypes._SimpleCData) and isinstance(ctype(7).value, int), (field, req[field])
    assert (req["is_aborted"], req["router_aborted"], req["finish_status"]) == (
        "ctypes.c_bool",
        "ctypes.c_bool",
        "FinishStatus",
    )
    assert {"n", "best_of", "max_new_tokens", "temperature", "top_p", "top_k"} <= set(types["SamplingParams._fields_"])
    assert list(types["GroupReqIndexes"]) == ["group_req_id", "multimodal_params", "shm_req_indexes", "time_mark"]
    assert {"group_req_id", "multimodal_params", "shm_req_objs"} <= set(types["GroupReqObjs"])
    # ids are elements of a numpy array of this dtype: the adapter takes them as the ints they are
    generator = types["ReqIDGenerator"]
    assert generator["returns"] == "self.current_id.arr[0]"
    dtype = np.dtype(eval(generator["dtype"], {"np": np}))  # noqa: S307 - a dtype expression from the golden
    element = (np.zeros(1, dtype) + 8)[0]
    assert not isinstance(element, int) and request_id(element) == 8 and type(request_id(element)) is int
    assert request_id(-element) == -8 and request_id(element + 3) == 11
    assert {"id", "count_output_tokens", "prompt_cache_len", "prompt_tokens"} <= set(
        types["HttpServerManager.metadata"]
    )
    assert {"req_id", "shm_req", "finish_status"} <= set(types["InferReq.self"])
    assert "requests_mapping" in types["InferenceContext.self"]
    assert "running_batch" in types["RouterManager.self"]


@pytest.mark.parametrize("version", sorted(VERSIONS.values()))
def test_the_pd_move_task_fields_the_kv_adapter_reads(version):
    """P/D (kv.py): the fields read off a ``KVMoveTask`` and its ``DecodeNodeInfo`` exist; the task
    is a plain ``@dataclass`` (no slots, not frozen), so the carrier set on it in the prefill worker
    travels with its pickled ``__dict__``; ``__post_init__`` takes no argument but self."""
    targets = golden(version)["targets"]
    task = targets["lightllm.server.pd_io_struct:KVMoveTask"]
    assert task["found"] and task["decorators"] == ["dataclass"], task
    assert {"group_request_id", "move_kv_len", "decode_node", "prefill_node_id"} <= set(task["fields"])
    assert "node_id" in targets["lightllm.server.pd_io_struct:DecodeNodeInfo"]["fields"]
    post = targets["lightllm.server.pd_io_struct:KVMoveTask.__post_init__"]
    assert [p["name"] for p in post["params"]] == ["self"]
    # the PD master hands sampling_params (with group_request_id) and multimodal_params to both nodes
    fetch = targets["lightllm.server.httpserver_for_pd_master.manager:HttpServerManagerForPDMaster.fetch_stream"]
    assert fetch["kind"] == "async_function", fetch["kind"]


@pytest.mark.parametrize("version", sorted(VERSIONS.values()))
def test_the_pd_master_fields_and_exceptions_the_master_span_relies_on(version):
    """The PD master's request span (kv.pd_generate): ``generate`` is an async generator the
    wrapper iterates, the model comes from ``self.args``, and the only plain ``Exception`` the class
    raises is the one for a disconnected client (the wrapper reads a plain ``Exception`` ending the
    stream as ``error.type=aborted``; any other class keeps its name)."""
    golden_types = golden(version)["types"]
    assert "args" in golden_types["HttpServerManagerForPDMaster.self"]
    raises = golden_types["HttpServerManagerForPDMaster.raises"]
    plain = [r for r in raises if r.startswith("Exception(")]
    assert plain and all("disconnected" in r for r in plain), raises
    targets = golden(version)["targets"]
    generate = targets["lightllm.server.httpserver_for_pd_master.manager:HttpServerManagerForPDMaster.generate"]
    assert generate["kind"] == "async_function", generate["kind"]


def test_the_pr965_golden_says_where_its_later_targets_were_read():
    """Targets added after the PR #965 head (746bf849) was read come from its merge commit."""
    filled = golden("pr965").get("filled_from")
    assert filled is not None and filled["commit"].startswith("538487aab")
    assert any(t.endswith("KVTransConnectObj._transfer_kv") for t in filled["targets"])


def test_the_id_field_width_differs_between_versions():
    """main widened request ids to 64 bits; v1.0.1's are 32-bit ``c_int`` (the stand-ins follow)."""
    assert golden("main")["types"]["Req._fields_"]["request_id"] == "ctypes.c_int64"
    assert golden("v1.0.1")["types"]["Req._fields_"]["request_id"] == "ctypes.c_int"


# --- the stand-ins -----------------------------------------------------------------------------
# Stand-in signatures that differ from the real ones on purpose, and why (the adapter reads only
# the parameters named in BY_NAME of these).
STANDIN_DIFFERS = {
    "lightllm.server.httpserver.manager:HttpServerManager.__init__": "built with the stand-in's queue and shared block instead of zmq ports; the adapter reads args only",
}


def standin_modules(tree) -> set[str]:
    out = set()
    for dirpath, _dirs, files in os.walk(tree / "lightllm"):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), tree)[:-3].replace(os.sep, ".")
                out.add(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return out - {"lightllm", "lightllm._standin"}


@pytest.mark.parametrize("layout", sorted(STANDINS))
def test_standin_signatures_and_modules_are_the_real_ones(layout, tmp_path):
    real = golden(STANDINS[layout])
    tree = build_tree(layout, tmp_path / layout)
    missing_modules = standin_modules(tree) - set(real["modules"])
    assert not missing_modules, f"the {layout} stand-in has modules {STANDINS[layout]} lacks: {sorted(missing_modules)}"
    source = signatures.Source(str(tree))
    checked = 0
    for key, expected in real["targets"].items():
        module, _, qualname = key.partition(":")
        actual = signatures.signature(source, module, qualname)
        if not actual["found"]:
            continue  # not modelled by this stand-in (P/D queues, ...): its module is absent too
        checked += 1
        assert expected["found"], f"the {layout} stand-in has {key}, {STANDINS[layout]} does not"
        if key in STANDIN_DIFFERS:
            continue
        assert signatures.compare(expected, actual) == [], key
    assert checked >= 15, checked
    # every hooked target of the layout is modelled (the stand-in exercises each wrapper)
    version = {"main": "main", "v1_0": "v1.0", "pr965": "pr965"}[layout]
    modelled = {
        f"{h.module}:{h.target}"
        for h in HOOKS
        if version in h.layout and signatures.signature(source, h.module, h.target)["found"]
    }
    core = {
        "HttpServerManager.generate",
        "HttpServerManager.transfer_to_next_module",
        "HttpServerManager.abort",
        "HttpServerManager.__init__",
        "RouterManager.add_req",
        "RouterManager._decode_batch",
        "Batch.filter_out_finished_req",
        "InferenceContext.add_reqs",
        "InferReq.set_next_gen_token_id",
        "InferenceContext.filter",
        "sample",
        "health_check",
        "ChunkedPrefillQueue.generate_new_batch",
        "ContinuesBatchQueue.generate_new_batch",
    }
    if layout == "pr965":  # the router no longer steps; the stand-in's worker loop does not sample logits
        core -= {"RouterManager.add_req", "RouterManager._decode_batch", "sample"}
        core.add("RouterManager._add_req")
    assert core <= {key.partition(":")[2] for key in modelled}, core - {key.partition(":")[2] for key in modelled}


PROBE = textwrap.dedent("""
    import ctypes, json, multiprocessing
    from lightllm import _standin
    from lightllm.server.core.objs.req import Req
    from lightllm.server.req_id_generator import ReqIDGenerator
    raw = _standin.new_shm(multiprocessing.get_context("spawn"))
    gen = ReqIDGenerator(raw)
    ids = [gen.generate_id() for _ in range(2)]
    fields = {name: t.__name__ for name, t in Req._fields_}
    print(json.dumps({"fields": fields, "id_type": type(ids[0]).__module__ + "." + type(ids[0]).__name__,
                      "ids": [int(i) for i in ids]}))
""")


@pytest.mark.parametrize("layout", sorted(STANDINS))
def test_standins_hand_out_what_the_real_code_hands_out(layout, tmp_path):
    """Ids are numpy integers of the golden's dtype, read from shared memory, in steps of 8; the
    shared-memory struct's id and counter fields have the real ctypes types."""
    real = golden(STANDINS[layout])["types"]
    tree = build_tree(layout, tmp_path / layout)
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    dtype = np.dtype(eval(real["ReqIDGenerator"]["dtype"], {"np": np}))  # noqa: S307
    assert out["id_type"] == f"numpy.{dtype.type.__name__}"
    assert out["ids"] == [8, 16]
    for field in (
        "request_id",
        "group_req_id",
        "input_len",
        "shm_cur_output_len",
        "prompt_cache_len",
        "is_aborted",
        "router_aborted",
    ):
        assert out["fields"][field] == getattr(ctypes, real["Req._fields_"][field].removeprefix("ctypes.")).__name__, (
            field
        )
