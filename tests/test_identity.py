"""Process identity (issue 16, llm_otel.process.identity; vLLM's reader llm_otel.instrumentation.vllm.process): every process of a vLLM topology gets a
resource that tells it apart. The children here are started the way vLLM starts its own
(``multiprocessing`` ``Process(name=..., kwargs=...)``, vllm/v1/engine/utils.py:284 for engine
cores, vllm/v1/executor/multiproc_executor.py:745 for workers, vllm/v1/utils.py:248 for API
servers) and the in-process/Ray path is driven through vLLM's real ``EngineCore`` /
``WorkerWrapperBase`` classes."""

from __future__ import annotations

import logging
import multiprocessing
import os
import types

import pytest

from llm_otel.instrumentation.vllm import process as vllm_process
from llm_otel.instrumentation.vllm.process import vllm_process_identity
from llm_otel.process import identity
from llm_otel.process.identity import inherited_instance_id, process_identity


def _identity_of_child(name: str, kwargs: dict, method: str = "fork", env: dict | None = None) -> dict:
    """The identity a child started like vLLM's (``Process(name=..., kwargs=...)``) reads of itself."""
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        proc = ctx.Process(target=_child_with_kwargs, name=name, args=(queue,), kwargs=kwargs, daemon=True)
        proc.start()
        got = queue.get(timeout=120)
        proc.join(30)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return got


def _child_with_kwargs(queue, **_engine_kwargs):
    queue.put(vllm_process_identity("frontend"))


def _parallel(tp=1, pp=1, dp=1, dp_rank=0, pcp=1):
    """Stand-in for ``VllmConfig`` with the fields the identity reads (vllm/config/parallel.py)."""
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            data_parallel_rank=dp_rank,
            prefill_context_parallel_size=pcp,
        )
    )


def test_identity_has_role_pid_host_and_a_uuid_instance_id():
    attrs = process_identity("engine_core", dp_rank=1, env={})
    assert attrs["llm.process.role"] == "engine_core"
    assert attrs["process.pid"] == os.getpid()
    assert isinstance(attrs["host.name"], str) and attrs["host.name"]
    assert len(attrs["service.instance.id"]) == 36  # uuid4 text form
    assert attrs["llm.process.data_parallel.rank"] == 1
    assert "llm.process.tensor_parallel.rank" not in attrs and "llm.process.inherited_instance_id" not in attrs
    assert process_identity("engine_core", env={})["service.instance.id"] == attrs["service.instance.id"]  # per pid


def test_inherited_instance_id_is_parsed_like_the_sdk():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p,service.instance.id=pod%2F7d9f ,x=y"}
    assert inherited_instance_id(env) == "pod/7d9f"
    assert inherited_instance_id({"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id="}) is None
    assert inherited_instance_id({}) is None


def test_engine_core_children_get_their_dp_rank_and_distinct_instance_ids():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=pod-7d9f"}
    a = _identity_of_child("EngineCore_DP0", {"dp_rank": 0, "local_dp_rank": 0}, env=env)
    b = _identity_of_child("EngineCore_DP1", {"dp_rank": 1, "local_dp_rank": 1}, env=env)
    for got, rank in ((a, 0), (b, 1)):
        assert got["llm.process.role"] == "engine_core"
        assert got["llm.process.data_parallel.rank"] == rank
        assert got["llm.process.name"] == f"EngineCore_DP{rank}"
        assert got["llm.process.inherited_instance_id"] == "pod-7d9f"
        assert got["service.instance.id"] == f"pod-7d9f/engine_core.dp{rank}.{got['process.pid']}"
        assert got["llm.process.ray"] is False
    assert a["service.instance.id"] != b["service.instance.id"] and a["process.pid"] != b["process.pid"]


def test_engine_core_without_dp_is_rank_zero_like_vllms_engine_label():
    got = _identity_of_child("EngineCore", {"dp_rank": 0, "local_dp_rank": 0})
    assert got["llm.process.role"] == "engine_core" and got["llm.process.data_parallel.rank"] == 0


def test_workers_get_tp_and_pp_rank_from_their_rank_and_the_parallel_config():
    # TP=2 x PP=2 in DP rank 1: rank 3 is TP 1 of PP stage 1 (vllm/distributed/parallel_state.py layout)
    got = _identity_of_child(
        "VllmWorker-3", {"rank": 3, "local_rank": 3, "vllm_config": _parallel(tp=2, pp=2, dp=2, dp_rank=1)}
    )
    assert got["llm.process.role"] == "worker"
    assert (
        got["llm.process.tensor_parallel.rank"],
        got["llm.process.pipeline_parallel.rank"],
        got["llm.process.data_parallel.rank"],
    ) == (1, 1, 1)
    assert got["llm.process.name"] == "VllmWorker-3"


def test_dense_dp_worker_reads_the_dp_index_not_its_process_group_rank():
    """vLLM runs dense-model DP engines as independent engines: their workers' process-group DP
    rank is 0, ``data_parallel_index`` keeps the engine's rank (vllm/v1/engine/core.py:1472)."""
    config = _parallel(dp=1, dp_rank=0)
    config.parallel_config.data_parallel_index = 1
    got = _identity_of_child("VllmWorker-0", {"rank": 0, "vllm_config": config})
    assert got["llm.process.data_parallel.rank"] == 1


@pytest.mark.slow
def test_worker_identity_survives_spawn():
    """vLLM on CPU spawns: the child's Process object (and its kwargs) is unpickled from the parent's."""
    got = _identity_of_child("VllmWorker-1", {"rank": 1, "vllm_config": _parallel(tp=2)}, method="spawn")
    assert got["llm.process.role"] == "worker" and got["llm.process.tensor_parallel.rank"] == 1
    assert got["llm.process.pipeline_parallel.rank"] == 0


def test_api_servers_get_their_index():
    got = _identity_of_child("ApiServer_1", {})
    assert got["llm.process.role"] == "frontend" and got["llm.process.api_server.index"] == 1


def test_unreadable_worker_config_leaves_ranks_out_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        got = _identity_of_child("VllmWorker-1", {"rank": 1})  # no vllm_config: layout unknown
    assert got["llm.process.role"] == "worker" and "llm.process.tensor_parallel.rank" not in got
    # the child logs; here the same path in-process (its log line is ours to read)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llm_otel"):
        got = vllm_process._worker_ranks(1, None, why := [])
    assert got == (None, None, None) and why == ["no vllm_config.parallel_config"]


def test_main_process_frontend_has_no_index():
    got = vllm_process_identity("frontend", env={})
    assert got["llm.process.role"] == "frontend"
    assert "llm.process.api_server.index" not in got and "llm.process.name" not in got


vllm = pytest.importorskip("vllm")


def test_ray_style_worker_found_through_vllms_worker_wrapper(monkeypatch):
    """A Ray actor's multiprocessing name is ``MainProcess``: the identity comes from vLLM's real
    ``WorkerWrapperBase`` calling ``load_general_plugins`` from ``init_worker``."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    monkeypatch.setattr(vllm_process, "in_ray_worker", lambda: True)  # tests/test_ray.py: the real detection

    class Probe(WorkerWrapperBase):
        def init_worker(self, all_kwargs):  # same locals as vLLM's (kwargs = all_kwargs[self.rpc_rank])
            kwargs = all_kwargs[self.rpc_rank]
            self.vllm_config = kwargs["vllm_config"]
            return vllm_process_identity("frontend", env={})

    wrapper = Probe(rpc_rank=0, global_rank=0)
    got = wrapper.init_worker([{"rank": 5, "vllm_config": _parallel(tp=4, pp=2)}])
    assert got["llm.process.role"] == "worker" and got["llm.process.ray"] is True
    assert got["llm.process.name"] == "RayWorkerWrapper"
    assert (got["llm.process.tensor_parallel.rank"], got["llm.process.pipeline_parallel.rank"]) == (1, 1)


def test_ray_style_engine_core_found_through_vllms_engine_core(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(vllm_process, "in_ray_worker", lambda: True)

    class Probe(EngineCore):
        def __init__(self, vllm_config):  # EngineCore.__init__ loads the plugins first thing
            self.vllm_config = vllm_config
            self.got = vllm_process_identity("frontend", env={})

    config = _parallel(dp=2, dp_rank=0)
    config.parallel_config.data_parallel_index = 1  # EngineCoreActorMixin sets it before EngineCore.__init__
    got = Probe(config).got
    assert got["llm.process.role"] == "engine_core" and got["llm.process.data_parallel.rank"] == 1
    assert got["llm.process.name"] == "DPEngineCoreActor_DP1"
    monkeypatch.setattr(vllm_process, "in_ray_worker", lambda: False)  # an engine core inside the frontend
    assert Probe(config).got["llm.process.role"] == "frontend"


def test_identity_never_raises(monkeypatch, caplog):
    monkeypatch.setattr(vllm_process, "_vllm_process_identity", lambda *a: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        got = vllm_process_identity("worker", env={})
    assert got["llm.process.role"] == "worker" and got["process.pid"] == os.getpid()
    assert "process identity incomplete" in caplog.text


def test_relabel_gives_the_tracked_providers_a_new_role_and_keeps_the_rest(monkeypatch):
    """identity.relabel: the providers llm-otel built (tracked) get the new role, indices and an
    inherited-form instance id made again; other attributes stay, stale indices go; providers not
    tracked (the application's) are never touched."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-9")
    monkeypatch.setattr(identity, "_TRACKED", [])
    pid = os.getpid()
    ours = TracerProvider(resource=Resource.create(process_identity("worker", tp_rank=3)), shutdown_on_exit=False)
    theirs = TracerProvider(resource=Resource.create({"service.name": "app"}), shutdown_on_exit=False)
    tracer = ours.get_tracer("t")  # made before the relabel: it sees the new label too
    identity.track(ours)
    made = identity.relabel("router", process_name="lightllm.server.router.manager:start_router_process")
    assert made["service.instance.id"] == f"pod-9/router.{pid}"
    attrs = dict(ours.resource.attributes)
    assert attrs["llm.process.role"] == "router" and attrs["service.instance.id"] == f"pod-9/router.{pid}"
    assert "llm.process.tensor_parallel.rank" not in attrs  # the worker's index is gone
    assert attrs["telemetry.sdk.language"] == "python"  # kept from Resource.create
    with tracer.start_as_current_span("s") as span:
        assert span.resource.attributes["llm.process.role"] == "router"
    assert dict(theirs.resource.attributes).get("llm.process.role") is None
    monkeypatch.setattr(identity, "_TRACKED", [])
    assert identity.relabel("router") is None  # nothing of llm-otel's here: nothing to re-label


def test_a_forked_child_that_learns_its_own_role_gets_an_instance_id_of_that_role(monkeypatch):
    """vLLM under ``fork``: the frontend's providers are tracked, so the fork hook re-labels the
    child as ``frontend``; the engine core it becomes then builds its own identity, whose inherited-
    form instance id must say ``engine_core`` (it kept ``frontend.<pid>`` when ids were cached per pid,
    which the whole suite found once providers built by an earlier test were tracked)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from llm_otel.process import identity

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7d9f")
    provider = TracerProvider(resource=Resource.create(identity.process_identity("frontend")))
    identity.track(provider)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the fork hook has re-labelled it as a frontend
        try:
            relabelled = provider.resource.attributes["service.instance.id"]
            own = identity.process_identity("engine_core", dp_rank=1)["service.instance.id"]
            os.write(write, f"{relabelled}|{own}|{os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    data = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    relabelled, own, child = data.split("|")
    assert relabelled == f"pod-7d9f/frontend.{child}"
    assert own == f"pod-7d9f/engine_core.dp1.{child}"


def test_the_identity_providers_get_is_the_engine_adapters_reading_else_the_generic_one(monkeypatch):
    """process/ knows no engine: an adapter reports how to read its process (vLLM's reader is
    registered when llm_otel.instrumentation.vllm.process is imported); without one, role, the
    multiprocessing name (none for MainProcess) and Ray are what any process can tell."""
    from llm_otel.instrumentation.vllm import process as vllm_reader  # noqa: F401 - registers vLLM's

    assert identity._READER == [vllm_process_identity]
    monkeypatch.setattr(identity, "_READER", [])
    got = identity.current_process_identity(env={})
    assert got["llm.process.role"] == "frontend" and got["llm.process.ray"] is False
    assert "llm.process.name" not in got and got["process.pid"] == os.getpid()
    assert identity.current_process_identity("router", env={})["llm.process.role"] == "router"
    identity.read_identity_with(lambda role, env: {"llm.process.role": role or "engine"})
    assert identity.current_process_identity("worker", env={}) == {"llm.process.role": "worker"}
