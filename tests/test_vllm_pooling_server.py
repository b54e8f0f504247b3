"""Pooling through the OpenAI server (issue 28, item 4): the tiny Llama served as an embedding
model (``--runner pooling``), one real server for this module, zero-code under
``opentelemetry-instrument``. ``/v1/embeddings`` gets a SERVER request span ``embeddings <model>``
under the caller's trace, with the response's ``id`` and ``usage.prompt_tokens``, queue and
prefill times; no token stream."""

from __future__ import annotations

import pytest
from conftest import HAS_VLLM, record_received
from support.vllm_servers import start_server

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

httpx = pytest.importorskip("httpx")
SERVED = "tiny-embed"
TRACE = "6cf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def server(tiny_model, receiver, tmp_path_factory):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "OTEL_SERVICE_NAME": "vllm-pooling-test",
    }
    log = tmp_path_factory.mktemp("pooling") / "server.log"
    srv = start_server(tiny_model, log, env, served=SERVED, args=("--runner", "pooling"))
    yield srv
    srv.kill()


def test_embeddings_request_gets_a_server_span_with_the_response_id_and_usage(receiver, server):
    receiver.clear()
    body = {"model": SERVED, "input": ["def main():", "import os"]}
    headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
    r = httpx.post(server.base + "/v1/embeddings", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    response = r.json()
    assert len(response["data"]) == 2
    roots = receiver.wait_for_spans(2, trace_id=TRACE, kind="SPAN_KIND_SERVER", timeout=20)
    assert len(roots) == 2  # one engine request per input
    for root in roots:
        assert root["name"] == f"embeddings {SERVED}"
        assert root["parent_span_id"] == PARENT
        a = root["attributes"]
        assert a["gen_ai.operation.name"] == "embeddings"
        assert a["gen_ai.response.id"] == response["id"]
        assert "gen_ai.usage.output_tokens" not in a
    assert sum(r["attributes"]["gen_ai.usage.input_tokens"] for r in roots) == response["usage"]["prompt_tokens"]
    prompts = []
    for root in roots:
        kids = receiver.wait_for_spans(1, parent_span_id=root["span_id"], timeout=20)
        assert [k["name"] for k in kids] == ["llm.prompt"]
        pa = kids[0]["attributes"]
        assert pa["llm.request.queue.duration"] >= 0 and pa["llm.request.prefill.duration"] > 0
        prompts.extend(kids)
    record_received([*roots, *prompts])
