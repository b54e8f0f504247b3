"""Served vLLM: the real OpenAI server (frontend, engine-core and worker processes), started once
per session zero-code with `opentelemetry-instrument`, exporting to the test's OTLP receiver."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import pytest
from conftest import HAS_VLLM, record_received

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

httpx = pytest.importorskip("httpx")
SERVED = "tiny"


@pytest.fixture(scope="session")
def server(openai_server):
    """The session's instrumented OpenAI server (conftest.openai_server)."""
    return openai_server


@pytest.fixture
def rx(receiver, server):
    receiver.clear()
    yield receiver
    record_received(receiver.spans())


TP_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TP_PARENT = "00f067aa0ba902b7"


def request_spans(rx, trace_id: str, n: int = 1, timeout: float = 20) -> list[dict]:
    return rx.wait_for_spans(n, trace_id=trace_id, kind="SPAN_KIND_SERVER", timeout=timeout)


def children(rx, span: dict, name: str, n: int = 1, timeout: float = 20) -> list[dict]:
    return rx.wait_for_spans(n, name=name, parent_span_id=span["span_id"], timeout=timeout)


def test_completion_joins_the_callers_trace_across_all_three_processes(rx, server):
    body = {"model": SERVED, "prompt": "def main():", "max_tokens": 8, "temperature": 0.7, "ignore_eos": True}
    headers = {"traceparent": f"00-{TP_TRACE}-{TP_PARENT}-01", "tracestate": "vendor=probe"}
    r = httpx.post(server["base"] + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    (root,) = request_spans(rx, TP_TRACE)
    assert root["name"] == f"text_completion {SERVED}"
    assert root["parent_span_id"] == TP_PARENT and root["trace_state"] == "vendor=probe"
    a = root["attributes"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 8
    assert root["resource"]["service.name"] == "vllm-server-test"
    (prompt,) = children(rx, root, "llm.prompt")
    (stream,) = children(rx, root, "llm.token_stream")
    (dist,) = children(rx, root, "llm.logit_dist")
    assert dist["resource"]["llm.process.role"] == "worker" and dist["attributes"]["llm.logit.steps"] == 8
    assert root["start_ns"] <= prompt["start_ns"] <= stream["start_ns"] <= root["end_ns"]
    deadline = time.time() + 20
    while True:  # 8 tokens: one prefill step and 7 decode steps, arriving in export batches
        steps = [
            s
            for s in rx.spans(name="llm.engine.step")
            if any(link["span_id"] == root["span_id"] for link in s["links"])
        ]
        if sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps) >= 7:
            break
        assert time.time() < deadline, f"{len(steps)} llm.engine.step span(s) link to the request"
        time.sleep(0.2)
    assert all(s["resource"]["llm.process.role"] == "engine_core" for s in steps)
    assert all(link["trace_id"] == TP_TRACE for s in steps for link in s["links"] if link["span_id"] == root["span_id"])
    assert sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps) >= 7


def test_streaming_chat_without_traceparent_is_a_new_root_shared_by_every_process(rx, server):
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chunks = []
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    usage = chunks[-1]["usage"]
    (root,) = rx.wait_for_spans(1, name=f"chat {SERVED}", timeout=20)
    assert root["kind"] == "SPAN_KIND_SERVER" and root["parent_span_id"] == ""
    assert root["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    (dist,) = children(rx, root, "llm.logit_dist")
    assert dist["trace_id"] == root["trace_id"]


@pytest.mark.case("C02")
def test_client_disconnect_mid_stream_ends_the_spans_with_error_and_partial_counts(rx, server):
    """C02: a client that disconnects mid-decode ends the request span and ``llm.token_stream`` with
    error.type=aborted and the tokens produced so far; the engine keeps serving."""
    # 2000 tokens (the server's max_model_len is 2048) keep the engine decoding for seconds after the
    # client has gone, so the abort has to be what ends the request. Whether the server notices the
    # disconnect before the request ends is up to uvicorn/starlette/vLLM, not llm-otel (starlette does
    # not close the stream's generator when its cancellation lands outside it; vLLM aborts when that
    # generator is closed or collected). A request that ran to max_tokens with finish_reason=length is
    # that case and is retried with a new trace; every other outcome is judged below.
    for attempt in range(3):
        tid = f"abcdef0123456789abcdef012345678{attempt}"
        body = {"model": SERVED, "prompt": "import os", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        received = 0
        with httpx.stream(
            "POST",
            server["base"] + "/v1/completions",
            json=body,
            timeout=60,
            headers={"traceparent": f"00-{tid}-{TP_PARENT}-01"},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 5:
                    break  # closing the response disconnects the client mid-decode
        (root,) = request_spans(rx, tid)
        attrs = root["attributes"]
        if not (
            root["status_code"] == "STATUS_CODE_UNSET"
            and attrs.get("gen_ai.usage.output_tokens") == 2000
            and list(attrs.get("gen_ai.response.finish_reasons", ())) == ["length"]
        ):
            break
    assert root["status_code"] == "STATUS_CODE_ERROR", json.dumps(attrs)
    assert attrs["error.type"] == "aborted"
    assert 5 <= attrs["gen_ai.usage.output_tokens"] < 2000
    (stream,) = children(rx, root, "llm.token_stream")
    assert stream["status_code"] == "STATUS_CODE_ERROR"
    # the engine keeps serving and the next request is traced normally
    r = httpx.post(
        server["base"] + "/v1/completions",
        json={"model": SERVED, "prompt": "x", "max_tokens": 3, "ignore_eos": True},
        headers={"traceparent": f"00-{'1' * 32}-{TP_PARENT}-01"},
        timeout=60,
    )
    assert r.status_code == 200
    (ok,) = request_spans(rx, "1" * 32)
    assert ok["status_code"] == "STATUS_CODE_UNSET" and ok["attributes"]["gen_ai.usage.output_tokens"] == 3


@pytest.mark.parametrize(
    "body, what",
    [
        ({"prompt": "word " * 2600, "max_tokens": 4}, "prompt too long"),
        ({"prompt": "hi", "max_tokens": 4, "temperature": -1.0}, "invalid temperature"),
    ],
)
@pytest.mark.case("C03", "C26")
def test_rejected_requests_yield_an_error_span_and_the_duration_metric(rx, server, body, what):
    """error.type: the exception vLLM raised in the handler (its HTTP error type when it returned one)."""
    tid = ("c03" + "0" * 29) if "long" in what else ("c03" + "1" * 29)
    r = httpx.post(
        server["base"] + "/v1/completions",
        json={"model": SERVED, **body},
        timeout=60,
        headers={"traceparent": f"00-{tid}-{TP_PARENT}-01"},
    )
    assert r.status_code == 400, r.text
    (span,) = request_spans(rx, tid)
    assert span["name"] == f"text_completion {SERVED}"
    assert span["status_code"] == "STATUS_CODE_ERROR"
    etype = span["attributes"]["error.type"]
    assert etype in ("VLLMValidationError", r.json()["error"]["type"])
    assert [e["name"] for e in span["events"]] == ["llm.request.rejected"]
    points = rx.wait_for_metric(
        "gen_ai.server.request.duration",
        timeout=20,
        resource={"service.name": "vllm-server-test"},  # this server's, not another test's process
        predicate=lambda p: p["attributes"].get("error.type") == etype,
    )
    assert points and all(p["count"] >= 1 and p["unit"] == "s" for p in points)


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-" + "0" * 32 + "-" + TP_PARENT + "-01",
        "00-" + "A" * 32 + "-" + TP_PARENT + "-01",
        "00-" + "a" * 32 + "-" + TP_PARENT + "-01-extra",
        "00-" + "a" * 1000,
    ],
)
def test_malformed_traceparent_is_ignored_and_the_request_served_as_a_new_root(rx, server, traceparent):
    r = httpx.post(
        server["base"] + "/v1/completions",
        json={"model": SERVED, "prompt": "x", "max_tokens": 2},
        headers={"traceparent": traceparent, "tracestate": "x" * 5000},
        timeout=60,
    )
    assert r.status_code == 200
    (root,) = rx.wait_for_spans(1, name=f"text_completion {SERVED}", timeout=20)
    # a new root: none of the inbound tracestate, only the adaptive sampler's own threshold
    assert root["parent_span_id"] == "" and re.fullmatch(r"(ot=th:[0-9a-f]+)?", root["trace_state"])


@pytest.mark.case("C10")
def test_concurrent_requests_keep_their_own_parents(rx, server):
    def one(i: int):
        tid = f"{i + 1:032x}"
        r = httpx.post(
            server["base"] + "/v1/completions",
            json={"model": SERVED, "prompt": f"item {i}", "max_tokens": 4 + i % 3, "ignore_eos": True},
            headers={"traceparent": f"00-{tid}-{i + 1:016x}-01"},
            timeout=120,
        )
        return tid, i, r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    for tid, i, completion_tokens in results:
        (root,) = request_spans(rx, tid)
        assert root["parent_span_id"] == f"{i + 1:016x}"
        assert root["attributes"]["gen_ai.usage.output_tokens"] == completion_tokens == 4 + i % 3
        for name in ("llm.prompt", "llm.token_stream", "llm.logit_dist"):
            (child,) = children(rx, root, name)
            assert child["trace_id"] == tid
    log = server["log"].read_text()
    assert "Failed to detach context" not in log and "llm-otel: hook" not in log


def test_signals_from_http_headers_and_in_process_healthz(rx, server):
    """Request classes from the inbound HTTP headers (sanitised: an injection-looking priority is
    ``other``), the tier and revision on the SERVER span, and LLM_OTEL_HEALTH_PORT's /healthz."""
    trace = "5cf92f3577b34da6a3ce929d0e0e4737"
    headers = {"traceparent": f"00-{trace}-{TP_PARENT}-01", "x-tenant-id": "acme", "x-priority": 'high"} or 1'}
    body = {"model": SERVED, "prompt": "signals", "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(server["base"] + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    (root,) = request_spans(rx, trace)
    a = root["attributes"]
    assert (
        a["llm.request.tenant"],
        a["llm.request.priority"],
        a["llm.request.tier"],
        a["llm.request.model.revision"],
    ) == ("acme", "other", "premium", "stable")
    assert a["llm.request.kv_cache.prompt_bytes"] > 0 and a["llm.request.kv_cache.blocks"] >= 1
    health = httpx.get(f"http://127.0.0.1:{server['health_port']}/healthz", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["status"] == "ok" and health.json()["factors"]["uptime"] == 1.0


def test_only_the_frontend_runs_an_exporter_process(server):
    """docs/architecture.md: the frontend exports through one exporter process; the engine-core and
    worker processes export in process. Under ``opentelemetry-instrument`` every installed
    instrumentor runs in every process; the Triton and LightLLM ones used to install global
    providers in the engine core and the worker too, where vLLM's own start-up spans then started
    an exporter process each (~63 MB each, for the server's life: fresh-install review of issue 19,
    F2; fails on the old code)."""
    import psutil

    frontend = psutil.Process(server["proc"].pid)  # opentelemetry-instrument execs the server
    found = []
    for proc in [frontend] + frontend.children(recursive=True):
        try:
            if "llm_otel.export.offload" in " ".join(proc.cmdline()):
                found.append((proc.pid, proc.ppid()))
        except psutil.Error:
            continue
    assert [ppid for _, ppid in found] == [frontend.pid], f"exporter processes (pid, parent): {found}"


@pytest.mark.parametrize(
    "path, body, prefix",
    [
        ("/v1/completions", {"prompt": "def main():"}, "cmpl-"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chatcmpl-"),
    ],
    ids=["completion", "chat"],
)
def test_request_span_carries_the_response_body_id(rx, server, path, body, prefix):
    """A support ticket quoting the completion id finds the trace: ``gen_ai.response.id`` is the
    ``id`` of the response body."""
    trace_id = f"{int(time.time_ns()):032x}"
    headers = {"traceparent": f"00-{trace_id}-{TP_PARENT}-01"}
    payload = {"model": SERVED, "max_tokens": 4, "ignore_eos": True, **body}
    r = httpx.post(server["base"] + path, json=payload, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    assert response_id.startswith(prefix)
    (root,) = request_spans(rx, trace_id)
    assert root["attributes"]["gen_ai.response.id"] == response_id


def test_beam_search_completion_is_one_request_span_with_its_usage(rx, server):
    """``use_beam_search``: one SERVER request span under the caller's trace (not one per beam and
    step), with the response's id and usage; the engine steps of its beams link to it."""
    trace_id = f"{int(time.time_ns()) + 1:032x}"
    body = {
        "model": SERVED,
        "prompt": "def main():",
        "max_tokens": 5,
        "use_beam_search": True,
        "n": 2,
        "ignore_eos": True,
    }
    r = httpx.post(
        server["base"] + "/v1/completions",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{TP_PARENT}-01"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    response = r.json()
    (root,) = request_spans(rx, trace_id)
    a = root["attributes"]
    assert root["name"] == f"text_completion {SERVED}"
    assert a["gen_ai.response.id"] == response["id"]
    assert a["llm.request.beam_width"] == 2
    assert a["gen_ai.usage.input_tokens"] == response["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 5  # the best beam's tokens
    deadline = time.time() + 20
    while True:
        steps = [
            s for s in rx.spans(name="llm.engine.step") if any(ln["span_id"] == root["span_id"] for ln in s["links"])
        ]
        if steps or time.time() > deadline:
            break
        time.sleep(0.2)
    assert steps, "no llm.engine.step linked to the beam search's span"
    assert len(rx.spans(trace_id=trace_id, kind="SPAN_KIND_SERVER")) == 1
