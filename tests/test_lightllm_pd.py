"""LightLLM P/D mode (instrumentation/lightllm/kv.py) against LightLLM's REAL transfer code.

Real, read from a LightLLM git directory at main @ fc72ffab (``LIGHTLLM_GIT_DIR``, default the
local mirror; skipped where there is none - LightLLM is on no registry): ``server/pd_io_struct.py``
(``KVMoveTask``, ``DecodeNodeInfo``, ``KVMoveTaskGroup``), ``pd_mode/prefill_node_impl/
prefill_trans_obj.py`` and ``pd_mode/decode_node_impl/decode_trans_obj.py`` (``KVTransConnectObj``
with its real ``_transfer_kv``, ``KVTransProcess``), ``pd_mode/task_queue.py``, ``pd_mode/utils.py``
(``clear_queue``), ``utils/time_utils.py``. Stand-ins (written below): empty package ``__init__``s
(the real ones import the GPU transfer processes), ``rpyc`` (not installed here; ``obtain`` is
rpyc's pickle round trip, done with ``pickle``), ``log_utils``/``device_utils``/``net_utils``/
``req_id_generator`` one-liners, the kv-move manager modules (only a class name is imported from
them), and the NCCL transfer process: a thread that reads the ``KVMoveTaskGroup`` from the real
``task_in_queue`` and answers on ``task_out_queue`` as ``prefill_trans_process`` /
``decode_trans_process`` do (``"ok"``, or another answer for a failed move).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GIT_DIR = os.environ.get("LIGHTLLM_GIT_DIR", "/work/.mirror/ModelTC+LightLLM/repo")
COMMIT = "fc72ffab"
PD = "lightllm/server/router/model_infer/mode_backend/continues_batch/pd_mode"
REAL = [
    "lightllm/server/pd_io_struct.py",
    f"{PD}/task_queue.py",
    f"{PD}/utils.py",
    f"{PD}/prefill_node_impl/prefill_trans_obj.py",
    f"{PD}/decode_node_impl/decode_trans_obj.py",
    "lightllm/utils/time_utils.py",
]
STANDINS = {
    "rpyc/__init__.py": "",
    "rpyc/utils/__init__.py": "",
    "rpyc/utils/classic.py": "import pickle\ndef obtain(proxy):\n    return pickle.loads(pickle.dumps(proxy))\n",
    "lightllm/utils/log_utils.py": "import logging\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "lightllm/utils/device_utils.py": "def kv_trans_use_p2p():\n    return True\n",
    "lightllm/utils/net_utils.py": "def find_available_port(lo, hi):\n    return lo\n",
    "lightllm/server/req_id_generator.py": "def convert_sub_id_to_group_id(i):\n    return (i // 8) * 8\n",
    f"{PD}/prefill_node_impl/prefill_kv_move_manager.py": "class PrefillKVMoveManager:\n    pass\n",
    f"{PD}/decode_node_impl/decode_kv_move_manager.py": "class DecodeKVMoveManager:\n    pass\n",
}

SCRIPT = textwrap.dedent("""
    import copy, json, pickle, queue, threading, time
    import numpy as np
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor, carrier as C
    from llm_otel.propagation import carrier_from_span

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tp = TracerProvider(); tp.add_span_processor(SimpleSpanProcessor(exporter))
    inst = LightLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(metric_readers=[reader]), settings=Settings())
    from lightllm.server.pd_io_struct import KVMoveTask, DecodeNodeInfo, KVMoveTaskGroup
    PD = "lightllm.server.router.model_infer.mode_backend.continues_batch.pd_mode"
    import importlib
    P = importlib.import_module(PD + ".prefill_node_impl.prefill_trans_obj")
    D = importlib.import_module(PD + ".decode_node_impl.decode_trans_obj")
    from lightllm.server.router.model_infer.mode_backend.continues_batch.pd_mode.task_queue import TaskQueue
    out = {"layouts": {k: v for k, v in inst.layouts.items() if "pd" in k}}

    # the prefill node's request span (HTTP worker) and its carrier, as MultimodalParams' __setstate__
    # registers it in the prefill model-infer worker
    request = tp.get_tracer("t").start_span("text_completion m")
    sampled_ctx = request.get_span_context()
    def register(gid, span_ctx):
        tpv = carrier_from_span(NonRecordingSpan(span_ctx))["traceparent"]
        C.TABLE.put(gid, {"traceparent": tpv, "group_req_id": gid, "choices": [tpv]})
    register(16, sampled_ctx)
    register(24, sampled_ctx)
    unsampled = SpanContext(0xAB, 0xCD, is_remote=False, trace_flags=TraceFlags(0))
    register(32, unsampled)

    def task(gid, n):  # as prefill_impl.prefill_req_frozen_tokens_and_put_to_kvmove_taskqueue builds it
        return KVMoveTask(
            group_request_id=np.int64(gid), input_tokens=list(range(1, n + 1)),
            prefill_token_indexes=list(range(100, 100 + n)), decode_token_indexes=None,
            prefill_node_id=1,
            decode_node=DecodeNodeInfo(node_id=2, ip="10.0.0.2", rpyc_port="9000", max_new_tokens=31,
                                       pd_master_node_id=0),
            move_kv_len=None, prefill_dp_index=0, decode_dp_index=None, mark_start_time=time.time())

    tasks = {gid: task(gid, n) for gid, n in ((16, 9), (24, 5), (32, 7))}
    out["carrier_on_task"] = getattr(tasks[16], "_llm_otel_carrier", None) is not None
    # info_queue (mp.Queue pickles it) to the kv-move manager
    tasks = {gid: pickle.loads(pickle.dumps(t)) for gid, t in tasks.items()}
    out["carrier_after_pickle"] = getattr(tasks[16], "_llm_otel_carrier", {}).get("group_req_id") == 16
    # request_kv_trans_loop: the decode node answered how many tokens it takes (prefix cached there)
    for gid, t in tasks.items():
        t.move_kv_len = {16: 6, 24: 5, 32: 7}[gid]

    class Manager:  # the kv-move manager's queues the transfer object hands tasks back to
        released = []
        def put_to_release_task_queue(self, ts): self.released.append(len(ts) if isinstance(ts, list) else 1)
        put_to_fail_release_task_queue = put_to_release_task_queue

    def trans_process(mod, answers):
        # stand-in of {prefill,decode}_trans_process: one KVMoveTaskGroup in, one answer out
        proc = mod.KVTransProcess(device_lock=threading.Lock(), task_in_queue=queue.Queue(),
                                  task_out_queue=queue.Queue(), device_id=0)
        def run():
            for answer in answers:
                group = proc.task_in_queue.get()
                assert isinstance(group, KVMoveTaskGroup)
                time.sleep(0.02)
                proc.task_out_queue.put(answer)
        threading.Thread(target=run, daemon=True).start()
        return proc

    def conn(mod, answers, **fields):
        obj = mod.KVTransConnectObj(connect_id="c-1", device_index=0, manager=Manager(), **fields)
        obj.kv_trans_process = trans_process(mod, answers)
        return obj

    # prefill node: a group of two moves that succeed, then one that fails
    sender = conn(P, ["ok", "nccl error"], decode_node_id=2)
    batch = [tasks[16], tasks[24]]
    sender._transfer_kv(batch)
    out["cleared_by_lightllm"] = batch == []
    try:
        sender._transfer_kv([copy.copy(tasks[32])])
        out["failure_raised"] = None
    except AssertionError as exc:
        out["failure_raised"] = type(exc).__name__

    # the decode node: the tasks arrive through rpyc (exposed_request_data_transfer obtains them)
    arrived = [pickle.loads(pickle.dumps(copy.copy(tasks[16])))]
    receiver = conn(D, ["ok"], prefill_node_id=1)
    receiver.move_finished_queue = TaskQueue(get_func=lambda d: d, fail_func=None)
    receiver._transfer_kv(arrived)
    out["finished_queue"] = receiver.move_finished_queue.size()

    request.end()
    spans = [s for s in exporter.get_finished_spans() if s.name == "llm.kv_transfer"]
    out["request"] = {"trace": format(sampled_ctx.trace_id, "032x"), "span": format(sampled_ctx.span_id, "016x")}
    out["spans"] = [
        {"attrs": dict(s.attributes), "parent": format(s.parent.span_id, "016x") if s.parent else None,
         "trace": format(s.context.trace_id, "032x"), "status": s.status.status_code.name,
         "duration_ms": (s.end_time - s.start_time) / 1e6}
        for s in spans
    ]
    points = []
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name.startswith("llm.kv_transfer"):
                    for p in m.data.data_points:
                        points.append({"name": m.name, "attrs": dict(p.attributes), "count": p.count})
    out["metrics"] = points
    print("RESULT " + json.dumps(out))
""")


def _tree(tmp_path) -> str | None:
    if not os.path.isdir(GIT_DIR):
        return None
    root = tmp_path / "src"
    for rel in REAL:
        text = subprocess.run(
            ["git", "--git-dir", GIT_DIR, "show", f"{COMMIT}:{rel}"], capture_output=True, check=True
        ).stdout
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
    for rel, text in STANDINS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    # package __init__s: empty stand-ins (the real pd_mode ones import the GPU transfer processes)
    for dirpath, _dirs, files in os.walk(root):
        if dirpath != str(root) and "__init__.py" not in files:
            open(os.path.join(dirpath, "__init__.py"), "w").close()
    return str(root)


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory):
    root = _tree(tmp_path_factory.mktemp("lightllm_pd"))
    if root is None:
        pytest.skip(f"no LightLLM git directory at {GIT_DIR} (LIGHTLLM_GIT_DIR)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(HERE, "..", "src")]))
    env.pop("OTEL_TRACES_SAMPLER", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :]), done.stderr


def test_the_real_transfer_modules_are_hooked_without_warnings(pd_run):
    out, stderr = pd_run
    assert {k.rsplit(".", 1)[1]: v for k, v in out["layouts"].items() if "pd_mode" in k} == {
        "prefill_trans_obj": "main",
        "decode_trans_obj": "main",
        "prefill_kv_move_manager": "main",
        "decode_kv_move_manager": "main",
    }, out["layouts"]
    assert "llm-otel" not in stderr, stderr[-2000:]


def test_the_carrier_travels_on_the_real_move_task(pd_run):
    out, _ = pd_run
    assert out["carrier_on_task"] and out["carrier_after_pickle"]
    assert out["cleared_by_lightllm"] and out["finished_queue"] == 1  # LightLLM's own behaviour, untouched


def test_send_and_receive_spans_are_children_of_the_prefill_request_span(pd_run):
    out, _ = pd_run
    spans = {
        (s["attrs"]["llm.kv_transfer.direction"], s["attrs"]["llm.request.id"], s["status"]): s for s in out["spans"]
    }
    # 16 and 24 sent, 32 failed (unsampled: no span), 16 received
    assert set(spans) == {("send", "16", "UNSET"), ("send", "24", "UNSET"), ("receive", "16", "UNSET")}, list(spans)
    for (direction, rid, _), s in spans.items():
        assert s["trace"] == out["request"]["trace"] and s["parent"] == out["request"]["span"]
        a = s["attrs"]
        assert a["llm.kv_transfer.connector"] == "lightllm-nccl" and a["llm.kv_transfer.asynchronous"] is True
        assert a["llm.disaggregation.role"] == ("prefill" if direction == "send" else "decode")
        assert a["llm.kv_transfer.remote_engine"] == ("2" if direction == "send" else "1")
        assert a["llm.kv_transfer.tokens"] == {"16": 6, "24": 5}[rid]  # move_kv_len, not the prompt length
        assert s["duration_ms"] >= 15  # the stand-in transfer process answers after 20 ms
        assert "error.type" not in a


def test_a_failed_move_is_an_error_in_the_metrics_and_raises_unchanged(pd_run):
    out, _ = pd_run
    assert out["failure_raised"] == "AssertionError"  # LightLLM's own exception, not swallowed
    failed = [p for p in out["metrics"] if p["attrs"].get("error.type") == "AssertionError"]
    assert failed and all(p["attrs"]["llm.kv_transfer.direction"] == "send" for p in failed)
    ok = [p for p in out["metrics"] if p["name"] == "llm.kv_transfer.duration" and "error.type" not in p["attrs"]]
    assert {p["attrs"]["llm.kv_transfer.direction"]: p["count"] for p in ok} == {"send": 2, "receive": 1}


def test_the_pd_master_puts_the_clients_context_on_what_both_nodes_receive():
    """KVAdapter.pd_master around a function with the real ``fetch_stream`` parameters (golden:
    main, v1.0.1, pr965); the PD master itself (websockets to the nodes) is not run here."""
    import pickle
    from types import SimpleNamespace

    import numpy as np
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import carrier as C
    from llm_otel.instrumentation.lightllm.kv import KVAdapter
    from llm_otel.telemetry import Telemetry

    telemetry = Telemetry(TracerProvider(), MeterProvider(), Settings())
    seen = []

    def fetch_stream(p_node, d_node, prompt, sampling_params, multimodal_params, request):  # bound: no self
        seen.append(pickle.loads(pickle.dumps(multimodal_params)))  # as pickled to the prefill node

    wrapper = KVAdapter(telemetry).pd_master("kv.pd_master")
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    for headers in ({"traceparent": tp, "tracestate": "k=v"}, {}, {"traceparent": "garbage"}):
        mm = SimpleNamespace()
        sp = SimpleNamespace(group_request_id=np.int64(40))
        args = (None, None, [1, 2], sp, mm, SimpleNamespace(headers=headers))
        wrapper(fetch_stream, None, args, {})
    assert getattr(seen[0], C.CARRIER_ATTR) == {
        "traceparent": tp,
        "tracestate": "k=v",
        "group_req_id": 40,
        "choices": [],
    }
    assert C.valid(getattr(seen[0], C.CARRIER_ATTR))
    assert not hasattr(seen[1], C.CARRIER_ATTR) and not hasattr(seen[2], C.CARRIER_ATTR)
