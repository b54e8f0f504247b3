"""LightLLM process identity outside the stand-in topology: the gunicorn master and the HTTP
workers it forks (each worker its own pid, parent pid, instance id and role ``frontend``), and the
role table against multiprocessing ``Process`` objects shaped as LightLLM builds them.

The gunicorn case runs a program named ``gunicorn`` with LightLLM's app argument under
``opentelemetry-instrument`` (the real ``sitecustomize`` path) that forks two workers with
``os.fork`` as gunicorn's arbiter does (``Arbiter.spawn_worker``), each loading the app's
``HttpServerManager`` module from the ``main`` stand-in tree - in the worker, as gunicorn does
without ``--preload`` (LightLLM's normal start), or in the master before the forks with
``--preload`` (its P/D starts); gunicorn itself is not installed here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
from lightllm_layouts.layers import build_tree

PROGRAM = r"""
import json, os, sys
from opentelemetry import trace

def load_app():  # lightllm.server.api_http imports HttpServerManager
    import lightllm.server.httpserver.manager

def identity():
    provider = trace.get_tracer_provider()
    if not hasattr(provider, "resource"):
        return {"provider": type(provider).__name__}
    attrs = dict(provider.resource.attributes)
    return {k: attrs.get(k) for k in ("llm.process.role", "process.pid", "process.parent_pid",
                                      "service.instance.id", "llm.process.inherited_instance_id")}

if "--preload" in sys.argv:
    load_app()
out = {"master": identity(), "master_pid": os.getpid(), "workers": []}
for _ in range(2):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker: load the app, report and leave as gunicorn workers do (os._exit)
        os.close(read)
        load_app()
        os.write(write, json.dumps(identity()).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out["workers"].append(json.loads(f.read()))
    os.waitpid(pid, 0)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("preload", [False, True])
def test_gunicorn_http_workers_carry_their_own_pid_instance_and_role(tmp_path, preload):
    """Each HTTP worker: role ``frontend``, its own pid and instance id, the master as parent. The
    master (``http_master``) has providers only when it loads the app itself (``--preload``): the
    LightLLM instrumentation builds them at the first LightLLM import of a process."""
    program = tmp_path / "gunicorn"  # sys.orig_argv: [python, .../gunicorn, ..., lightllm.server.api_http:app]
    program.write_text(PROGRAM)
    tree = build_tree("main", tmp_path / "tree")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="vllm",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        OTEL_RESOURCE_ATTRIBUTES="service.instance.id=pod-1",
    )
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    argv = [instrument, sys.executable, str(program), "--workers", "2"] + (["--preload"] if preload else [])
    done = subprocess.run(argv + ["lightllm.server.api_http:app"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])
    master, workers = out["master"], out["workers"]
    if preload:
        assert master["llm.process.role"] == "http_master"
        assert master["service.instance.id"] == f"pod-1/http_master.{master['process.pid']}"
    else:
        assert master == {"provider": "ProxyTracerProvider"}
    pids = {w["process.pid"] for w in workers}
    assert len(pids) == 2 and out["master_pid"] not in pids
    for worker in workers:
        assert worker["llm.process.role"] == "frontend"
        assert worker["process.parent_pid"] == out["master_pid"]
        assert worker["service.instance.id"] == f"pod-1/frontend.{worker['process.pid']}"
        assert worker["llm.process.inherited_instance_id"] == "pod-1"


def _target(module: str, name: str):
    def function(*args):
        pass

    function.__module__, function.__name__ = module, name
    return function


def test_model_infer_ranks_per_version():
    """main / v1.0.1 pass (args, rank, rank_in_node, node_world_size, ...); v1.0.0 (args, tp_rank, ...)."""
    from llm_otel.instrumentation.lightllm import process

    target = _target("lightllm.server.router.model_infer.model_rpc", "_init_env")
    queue = object()
    main = multiprocessing.Process(target=target, args=({"tp": 4, "dp": 2}, 3, 3, 4, queue))
    role, extra = process.classify(main)
    assert (role, extra["tp_rank"], extra["dp_rank"], extra["master"]) == ("worker", 1, 1, False)
    assert extra["process_name"] == "lightllm.server.router.model_infer.model_rpc:_init_env"
    for rank, master in ((0, True), (1, False)):
        v100 = multiprocessing.Process(target=target, args=({"tp": 2, "dp": 1}, rank, queue, queue))
        role, extra = process.classify(v100)
        assert (role, extra["tp_rank"], extra["master"]) == ("worker", rank, master)
    router = multiprocessing.Process(target=_target("lightllm.server.router.manager", "start_router_process"))
    assert process.classify(router)[0] == "router"
    assert process.classify(multiprocessing.Process(target=_target("app", "main"))) is None
    assert (
        process.classify(
            multiprocessing.current_process(), argv=[sys.executable, "-m", "lightllm.server.api_server", "--tp", "1"]
        )[0]
        == "launcher"
    )
