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


def _tree(tmp_path, real=(), standins=None) -> str | None:
    if not os.path.isdir(GIT_DIR):
        return None
    root = tmp_path / "src"
    for rel in REAL + list(real):
        text = subprocess.run(
            ["git", "--git-dir", GIT_DIR, "show", f"{COMMIT}:{rel}"], capture_output=True, check=True
        ).stdout
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text)
    for rel, text in {**STANDINS, **(standins or {})}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    # package __init__s: empty stand-ins (the real pd_mode ones import the GPU transfer processes)
    for dirpath, _dirs, files in os.walk(root):
        if dirpath != str(root) and "__init__.py" not in files:
            open(os.path.join(dirpath, "__init__.py"), "w").close()
    return str(root)


def _run_in_tree(root: str | None, script: str) -> tuple[dict, str]:
    """Run ``script`` in a fresh interpreter over the LightLLM tree ``root`` (skip without one);
    returns its ``RESULT`` JSON line and its stderr."""
    if root is None:
        pytest.skip(f"no LightLLM git directory at {GIT_DIR} (LIGHTLLM_GIT_DIR)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(HERE, "..", "src")]))
    env.pop("OTEL_TRACES_SAMPLER", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :]), done.stderr


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory):
    return _run_in_tree(_tree(tmp_path_factory.mktemp("lightllm_pd")), SCRIPT)


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
    """The fallback of KVAdapter.pd_master when the PD master has no span of its own (its
    ``generate`` not traced): the client's context, around a function with the real ``fetch_stream``
    parameters (golden: main, v1.0.1, pr965). The real PD master runs in ``master_run`` below."""
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


# --- the PD master's own request span, against LightLLM's REAL PD master -----------------------
# Real, read at fc72ffab like the rest of this file: ``server/httpserver_for_pd_master/manager.py``
# (HttpServerManagerForPDMaster: generate, _wait_to_token_package, fetch_stream, update_req_status,
# abort, handle_loop; ReqStatus) and ``pd_io_struct.py`` (PD_Client_Obj, UpKVStatus, ObjType),
# plus the real prefill/decode ``_transfer_kv`` above. Stand-ins (MASTER_STANDINS): what the PD
# master imports around that code (ujson, SamplingParams/FinishStatus, MultimodalParams, tokenizer,
# metrics client, MovingAverage, ServerBusyError, ReqIDGenerator, AsyncQueue), and the two nodes:
# each node's HTTP worker is a small ``HttpServerManager`` (main layout: generate ->
# transfer_to_next_module -> one item per token) that llm-otel's real HTTP hooks wrap, fed by a fake
# websocket that unpickles what the real master sends (llm-otel's real ``__setstate__`` runs there).
# The client's request is a stand-in (headers, url.path, is_disconnected); the root sampler is a
# switch (ParentBased) that can drop the PD master's roots only, so that the nodes dropping their
# spans shows they follow the master's decision.
MASTER_REAL = ["lightllm/server/httpserver_for_pd_master/manager.py"]
MASTER_STANDINS = {
    "ujson/__init__.py": "from json import *  # noqa\n",
    "lightllm/server/req_id_generator.py": textwrap.dedent("""
        import numpy as np
        def convert_sub_id_to_group_id(i):
            return (i // 8) * 8
        class ReqIDGenerator:
            def __init__(self):
                self.arr = np.zeros(1, dtype=np.int64)
            def generate_id(self):
                self.arr[0] += 8
                return self.arr[0]
    """),
    "lightllm/server/core/objs/__init__.py": textwrap.dedent("""
        class FinishStatus:
            NO_FINISH, FINISHED_STOP, FINISHED_LENGTH, FINISHED_ABORTED = 0, 1, 2, 3
            def __init__(self, status=0):
                self.status = status
            def is_finished(self):
                return self.status != 0
            def is_aborted(self):
                return self.status == 3
            def get_finish_reason(self):
                return {1: "stop", 2: "length"}.get(self.status)
        class _MoveKV:
            exists = False
            def initialize(self, d):
                self.exists, self.d = d is not None, d
        class SamplingParams:
            def __init__(self, max_new_tokens):
                self.max_new_tokens, self.n, self.best_of = max_new_tokens, 1, 1
                self.temperature, self.top_p, self.top_k = 0.5, 0.9, -1
                self.group_request_id, self.suggested_dp_index = None, -1
                self.move_kv_to_decode_node = _MoveKV()
            def to_origin_dict(self):
                return {}
    """),
    "lightllm/server/multimodal_params.py": textwrap.dedent("""
        class MultimodalParams:
            def __init__(self):
                self.images, self.audios = [], []
            def to_dict(self):
                return {}
    """),
    "lightllm/server/tokenizer.py": "def get_tokenizer(*a, **k):\n    return None\n",
    "lightllm/server/metrics/__init__.py": "",
    "lightllm/server/metrics/manager.py": textwrap.dedent("""
        class MetricClient:
            def __init__(self, port): pass
            def counter_inc(self, *a): pass
            def histogram_observe(self, *a): pass
    """),
    "lightllm/utils/statics_utils.py": textwrap.dedent("""
        class MovingAverage:
            def add(self, v): pass
            def print_log(self, s): pass
    """),
    "lightllm/utils/error_utils.py": "class ServerBusyError(Exception):\n    pass\n",
    "lightllm/server/httpserver/manager.py": textwrap.dedent("""
        import asyncio
        from types import SimpleNamespace
        from lightllm.server.core.objs import FinishStatus
        class AsyncQueue:
            def __init__(self):
                self.datas, self.event = [], asyncio.Event()
            async def put(self, obj):
                self.datas.append(obj)
                self.event.set()
            async def wait_to_get_all_data(self):
                while not self.datas:
                    await self.event.wait()
                    self.event.clear()
                out, self.datas = self.datas, []
                return out
        class HttpServerManager:  # a P/D node's HTTP worker, main layout
            def __init__(self, args):
                self.args = args
            async def generate(self, prompt, sampling_params, multimodal_params, request, is_health_req=False):
                gid = sampling_params.group_request_id  # P/D nodes keep the master's group id
                n_in = len(prompt) if isinstance(prompt, list) else 4
                self.transfer_to_next_module(SimpleNamespace(
                    group_req_id=gid, multimodal_params=multimodal_params,
                    shm_req_objs=[SimpleNamespace(input_len=n_in, prompt_cache_len=0)]))
                for i in range(sampling_params.max_new_tokens):
                    await asyncio.sleep(0.002)
                    last = i == sampling_params.max_new_tokens - 1
                    meta = {"id": 7 + i, "prompt_tokens": n_in, "count_output_tokens": i + 1, "prompt_cache_len": 0}
                    if i == 0:  # the prefill node's first item carries the prompt ids (pd mode)
                        meta["prompt_ids"] = list(prompt) if isinstance(prompt, list) else [1]
                    yield gid, "t", meta, FinishStatus(FinishStatus.FINISHED_LENGTH if last else FinishStatus.NO_FINISH)
            def transfer_to_next_module(self, group_req_objs):
                pass
            async def abort(self, group_req_id):
                pass
    """),
}

MASTER_SCRIPT = textwrap.dedent("""
    import asyncio, importlib, json, pickle, queue, threading, time
    from types import SimpleNamespace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, SamplingResult, Decision
    from opentelemetry.trace import SpanKind
    from starlette.datastructures import Headers
    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor

    class Switch(Sampler):
        # the root decision: off drops the PD master's roots (SERVER) only; a node's request span
        # that started a root of its own would be sampled, so only following the master drops it
        on = True
        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, *a, **k):
            drop = not Switch.on and kind == SpanKind.SERVER
            return SamplingResult(Decision.DROP if drop else Decision.RECORD_AND_SAMPLE, attributes)
        def get_description(self):
            return "switch"

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tp = TracerProvider(sampler=ParentBased(Switch())); tp.add_span_processor(SimpleSpanProcessor(exporter))
    inst = LightLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(metric_readers=[reader]), settings=Settings())
    from lightllm.server.httpserver_for_pd_master.manager import HttpServerManagerForPDMaster
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.pd_io_struct import PD_Client_Obj, UpKVStatus, ObjType, KVMoveTask, DecodeNodeInfo
    from lightllm.server.core.objs import SamplingParams
    from lightllm.server.multimodal_params import MultimodalParams
    PD = "lightllm.server.router.model_infer.mode_backend.continues_batch.pd_mode"
    P = importlib.import_module(PD + ".prefill_node_impl.prefill_trans_obj")
    D = importlib.import_module(PD + ".decode_node_impl.decode_trans_obj")
    from lightllm.server.router.model_infer.mode_backend.continues_batch.pd_mode.task_queue import TaskQueue

    class Manager:
        def put_to_release_task_queue(self, ts): pass
        put_to_fail_release_task_queue = put_to_release_task_queue

    def conn(mod, **fields):  # a kv-move connection whose transfer process answers "ok" to every group
        obj = mod.KVTransConnectObj(connect_id="c", device_index=0, manager=Manager(), **fields)
        obj.kv_trans_process = mod.KVTransProcess(device_lock=threading.Lock(), task_in_queue=queue.Queue(),
                                                  task_out_queue=queue.Queue(), device_id=0)
        def run(p=obj.kv_trans_process):
            while True:
                p.task_in_queue.get(); time.sleep(0.005); p.task_out_queue.put("ok")
        threading.Thread(target=run, daemon=True).start()
        return obj
    sender, receiver = conn(P, decode_node_id=2), conn(D, prefill_node_id=1)
    receiver.move_finished_queue = TaskQueue(get_func=lambda d: d, fail_func=None)

    args = SimpleNamespace(model_name="m", model_dir="/x/m", tokenizer_mode="fast", trust_remote_code=False,
                           pd_node_id=0, config_server_host=None, config_server_port=None)
    master = HttpServerManagerForPDMaster(args, metric_port=0)
    aborts = []

    class NodeSocket:  # the node end of the master's websocket
        def __init__(self, role):
            self.role, self.node = role, HttpServerManager(args)
        async def send_bytes(self, data):
            kind, payload = pickle.loads(data)  # llm-otel's MultimodalParams.__setstate__ runs here
            if kind == ObjType.REQ:
                asyncio.ensure_future(self.serve(*payload))
            else:
                aborts.append((self.role, int(payload)))
        async def serve(self, prompt, sp, mm):
            async for item in self.node.generate(prompt, sp, mm, None):
                await master.put_to_handle_queue((ObjType.TOKEN_PACKS, [item]))
            if self.role == "prefill" and sp.move_kv_to_decode_node.exists:
                gid = int(sp.group_request_id)
                pickle.loads(pickle.dumps(mm))  # router -> model-infer worker: the node's carrier arrives
                task = KVMoveTask(group_request_id=gid, input_tokens=[1, 2, 3, 4], prefill_token_indexes=[0, 1, 2, 3],
                                  decode_token_indexes=None, prefill_node_id=1,
                                  decode_node=DecodeNodeInfo(node_id=2, ip="d", rpyc_port="1", max_new_tokens=3,
                                                             pd_master_node_id=0),
                                  move_kv_len=4, prefill_dp_index=0, decode_dp_index=0, mark_start_time=time.time())
                task = pickle.loads(pickle.dumps(task))  # info_queue to the kv-move manager
                sender._transfer_kv([task])
                receiver._transfer_kv([pickle.loads(pickle.dumps(task))])  # rpyc obtain on the decode node
                await master.update_req_status(UpKVStatus(group_request_id=gid, dp_index=0, pd_master_node_id=0))

    p_node = PD_Client_Obj(node_id=1, client_ip_port="p:1", mode="prefill", start_args={}, websocket=NodeSocket("prefill"))
    d_node = PD_Client_Obj(node_id=2, client_ip_port="d:1", mode="decode",
                           start_args={"pd_node_id": 2, "host": "d", "pd_decode_rpyc_port": 1}, websocket=NodeSocket("decode"))
    master.prefill_nodes, master.decode_nodes = [p_node], [d_node]

    class Request:  # the client's HTTP request (fastapi Request's parts the master reads)
        def __init__(self, headers):
            self.headers, self.url = Headers(headers), SimpleNamespace(path="/generate")
            self.gone = False
        async def is_disconnected(self):
            return self.gone

    def counts():
        out = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name in ("gen_ai.server.request.duration", "llm.kv_transfer.duration"):
                        out[m.name] = sum(p.count for p in m.data.data_points)
        return out

    def spans():
        out = [{"name": s.name, "kind": s.kind.name, "trace": format(s.context.trace_id, "032x"),
                "span": format(s.context.span_id, "016x"),
                "parent": format(s.parent.span_id, "016x") if s.parent else None,
                "attrs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.attributes.items()},
                "status": s.status.status_code.name} for s in exporter.get_finished_spans()]
        exporter.clear()
        return out

    async def case(headers, tokens=4, disconnect_after=None, close_after=None):
        request = Request(headers)
        agen = master.generate([1, 2, 3, 4], SamplingParams(tokens), MultimodalParams(), request)
        got, error = 0, None
        try:
            async for _item in agen:
                got += 1
                if disconnect_after is not None and got >= disconnect_after:
                    request.gone = True
                if close_after is not None and got >= close_after:
                    await agen.aclose()
                    break
        except Exception as exc:
            error = type(exc).__name__
        await asyncio.sleep(0.1)  # let the nodes' streams end
        return {"items": got, "error": error}

    async def main():
        loop_task = asyncio.ensure_future(master.handle_loop())
        out = {}
        out["root"] = await case({})
        out["root"]["spans"] = spans()
        inbound = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        out["inbound"] = await case({"traceparent": inbound})
        out["inbound"]["spans"] = spans()
        before = counts()
        Switch.on = False
        out["unsampled"] = await case({})
        Switch.on = True
        out["unsampled"]["spans"] = spans()
        after = counts()
        out["unsampled"]["metrics"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        out["disconnect"] = await case({}, disconnect_after=1)
        out["disconnect"]["spans"] = spans()
        out["closed"] = await case({}, close_after=1)
        out["closed"]["spans"] = spans()
        out["aborts"] = aborts
        out["live"] = inst.adapter.kv.live if getattr(inst, "adapter", None) else None
        out["left"] = len(master.req_id_to_out_inf)
        loop_task.cancel()
        return out

    print("RESULT " + json.dumps(asyncio.run(main())))
""")


@pytest.fixture(scope="module")
def master_run(tmp_path_factory):
    return _run_in_tree(
        _tree(tmp_path_factory.mktemp("lightllm_pd_master"), MASTER_REAL, MASTER_STANDINS), MASTER_SCRIPT
    )


def _by_role(spans):
    """The PD master's span (SERVER), the two nodes' request spans and the transfer spans."""
    master = [s for s in spans if s["kind"] == "SERVER"]
    nodes = [s for s in spans if s["name"] == "text_completion m" and s["kind"] == "INTERNAL"]
    moves = [s for s in spans if s["name"] == "llm.kv_transfer"]
    return master, nodes, moves


def test_without_traceparent_the_pd_master_span_is_the_root_of_one_trace(master_run):
    out, stderr = master_run
    assert out["root"]["error"] is None and out["root"]["items"] == 4  # LightLLM's stream, untouched
    spans = out["root"]["spans"]
    master, nodes, moves = _by_role(spans)
    assert len(master) == 1 and master[0]["parent"] is None, master
    m = master[0]
    assert {s["trace"] for s in spans} == {m["trace"]}, spans  # router/worker-less stand-in nodes: all spans
    assert len(nodes) == 2 and all(s["parent"] == m["span"] for s in nodes), nodes  # prefill and decode
    prefill = [s for s in nodes if s["attrs"]["gen_ai.usage.output_tokens"] == 1]
    assert len(prefill) == 1, nodes
    # the transfer spans are children of the prefill node's request span: in the master's trace
    assert {s["attrs"]["llm.kv_transfer.direction"] for s in moves} == {"send", "receive"}
    assert all(s["parent"] == prefill[0]["span"] for s in moves), moves
    a = m["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "lightllm"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.request.max_tokens"] == 4
    assert a["llm.request.id"] == nodes[0]["attrs"]["llm.request.id"]  # the group id, as on the nodes
    assert a["gen_ai.usage.input_tokens"] == 4 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["llm.time_to_first_token"] > 0
    assert "error.type" not in a and m["status"] == "UNSET"
    assert "llm-otel" not in stderr, stderr[-2000:]


def test_an_inbound_traceparent_is_the_pd_master_spans_parent(master_run):
    out, _ = master_run
    spans = out["inbound"]["spans"]
    master, nodes, moves = _by_role(spans)
    assert len(master) == 1 and master[0]["trace"] == "ab" * 16 and master[0]["parent"] == "cd" * 8
    # the nodes continue under the master's span, not the client's
    assert len(nodes) == 2 and all(s["parent"] == master[0]["span"] for s in nodes)
    assert len(moves) == 2 and {s["trace"] for s in spans} == {"ab" * 16}


def test_an_unsampled_pd_master_decision_holds_on_both_nodes_and_metrics_still_count(master_run):
    out, _ = master_run
    assert out["unsampled"]["error"] is None and out["unsampled"]["items"] == 4
    assert out["unsampled"]["spans"] == []  # no master, node, or transfer span
    # the nodes' request metrics (prefill and decode) and both transfer sides are still recorded
    assert out["unsampled"]["metrics"] == {"gen_ai.server.request.duration": 2, "llm.kv_transfer.duration": 2}


def test_a_disconnected_or_closed_client_ends_the_pd_master_span_as_aborted(master_run):
    out, _ = master_run
    # LightLLM's own handling is unchanged: its "disconnected" Exception reaches the caller, and the
    # master sent ABORT to both nodes for it
    assert out["disconnect"]["error"] == "Exception" and out["disconnect"]["items"] == 1
    for name in ("disconnect", "closed"):
        master, _nodes, _ = _by_role(out[name]["spans"])
        assert len(master) == 1, (name, out[name]["spans"])
        assert master[0]["attrs"]["error.type"] == "aborted" and master[0]["status"] == "ERROR", master
        assert master[0]["attrs"]["gen_ai.usage.output_tokens"] == 1
    assert {role for role, _gid in out["aborts"]} == {"prefill", "decode"}
    assert out["left"] == 0  # LightLLM freed its request state; llm-otel keeps none either
