"""The 2024 layout against real LightLLM code: PyPI ``lightllm==0.0.1`` (installed by .ci/install.sh
with ``--no-deps`` into ``.venv/lightllm-pypi``, kept off the venv's own site-packages so that
``llm_otel.instrument()`` in other tests does not find a LightLLM). Its HTTP manager and router
request objects run on CPU; tests/lightllm_layouts/pypi_driver.py drives one request from the real
``HttpServerManager.generate`` through zmq to the real ``RouterManager.add_req`` in a spawned
process and back (C06: the hook table against a real older layout; C09: exact counts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from support import tools

HERE = os.path.dirname(os.path.abspath(__file__))
PYPI = os.path.join(os.path.dirname(sys.executable), "..", "lightllm-pypi")
TRACE_ID, PARENT = "0000000000000000000000000000c0de", "00000000000000f0"

# the 2024 LightLLM from PyPI runs in two processes (tens of seconds)
pytestmark = pytest.mark.slow


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _run_driver(receiver, tiny_model, service: str, driver: str, spec: dict, timeout: float):
    """Run ``tests/lightllm_layouts/<driver>`` with ``spec`` (JSON argument), PyPI LightLLM on the
    path and OTLP to ``receiver`` under ``service``; (the finished process, its ``RESULT`` dict)."""
    tools.require(
        "PyPI lightllm 0.0.1 in .venv/lightllm-pypi",
        os.path.isdir(os.path.join(PYPI, "lightllm")),
        "bash .ci/install.sh",
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.abspath(PYPI)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        OTEL_SERVICE_NAME=service,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_BSP_SCHEDULE_DELAY="100",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        LIGHTLLM_START_ARGS=json.dumps({"model_dir": str(tiny_model)}),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "lightllm_layouts", driver), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])
    return done, result


@pytest.fixture(scope="module")
def pypi_run(receiver, tiny_model):
    service = f"lightllm-pypi-{os.getpid()}"
    spec = {
        "model_dir": str(tiny_model),
        "prompt": "def main(): return 42",
        "max_new_tokens": 5,
        "traceparent": f"00-{TRACE_ID}-{PARENT}-01",
        "ports": free_ports(2),
    }
    done, result = _run_driver(receiver, tiny_model, service, "pypi_driver.py", spec, timeout=400)
    assert result["router_exitcode"] == 0, done.stderr[-4000:]
    spans = [s for s in receiver.spans() if s["resource"].get("service.name") == service]
    return {"result": result, "spans": spans, "stderr": done.stderr}


@pytest.mark.case("C06")
def test_the_real_2024_lightllm_package_is_imported_and_its_layout_recognised_without_warnings(pypi_run):
    """C06 (an integration broke when the engine renamed an internal module): the run imports the real
    2024 LightLLM from PyPI (not a layout copy) and every hook target of that layout resolves."""
    assert os.path.abspath(pypi_run["result"]["lightllm_file"]).startswith(os.path.abspath(PYPI))
    assert "unknown layout" not in pypi_run["stderr"] and "not found" not in pypi_run["stderr"]


@pytest.mark.case("C06", "C09")
def test_real_2024_layout_traces_the_request_span_tree_with_the_engines_exact_counts(pypi_run):
    result, spans = pypi_run["result"], pypi_run["spans"]
    assert [t[1] for t in result["tokens"]] == [100, 101, 102, 103, 104]
    assert result["tokens"][-1][3] == "length"
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (req,) = by_name["text_completion tiny-llama"]
    assert (req["trace_id"], req["parent_span_id"], req["kind"]) == (TRACE_ID, PARENT, "SPAN_KIND_SERVER")
    assert req["attributes"]["llm.request.id"] == "8"
    assert req["attributes"]["gen_ai.usage.input_tokens"] == result["prompt_ids"]  # LightLLM's tokenizer count
    assert req["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert req["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    for name in ("llm.prompt", "llm.token_stream"):
        (child,) = by_name[name]
        assert child["parent_span_id"] == req["span_id"]
    # the carrier crossed zmq inside LightLLM's own pickled MultimodalParams into the router process
    (router,) = by_name["llm.router.request"]
    assert (router["trace_id"], router["parent_span_id"]) == (TRACE_ID, req["span_id"])
    assert router["attributes"]["gen_ai.usage.input_tokens"] == result["prompt_ids"]
    assert router["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert router["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert [e["name"] for e in router["events"]] == ["llm.request.queued", "llm.request.scheduled"]
    assert req["start_ns"] <= router["start_ns"] <= router["end_ns"]


# --- the 2024 LightLLM's own processes: router and detokenizer started by LightLLM, model faked ---
COMPLETE_TRACE, ABORT_TRACE = "0000000000000000000000000000c0de", "0000000000000000000000000000abcd"
ROUTER_TARGET = "lightllm.server.router.manager:start_router_process"


@pytest.fixture(scope="module")
def pypi_processes(receiver, tiny_model):
    """tests/lightllm_layouts/pypi_processes_driver.py: LightLLM 0.0.1's HttpServerManager here, its
    start_submodule_processes starting its router and detokenizer, only the model backend faked;
    one request completes, one client disconnects after its first token."""
    service = f"lightllm-pypi-processes-{os.getpid()}"
    spec = {
        "model_dir": str(tiny_model),
        "ports": free_ports(6),
        "requests": {"complete": f"00-{COMPLETE_TRACE}-{PARENT}-01", "abort": f"00-{ABORT_TRACE}-{PARENT}-01"},
    }
    done, result = _run_driver(receiver, tiny_model, service, "pypi_processes_driver.py", spec, timeout=300)
    for trace_id in (COMPLETE_TRACE, ABORT_TRACE):  # the router's request spans (flushed at its exit)
        receiver.wait_for_spans(1, timeout=30, name="llm.router.request", trace_id=trace_id)
    spans = [s for s in receiver.spans() if s["resource"].get("service.name") == service]
    return {"result": result, "spans": spans, "stderr": done.stderr}


def _one(spans, name, trace_id):
    (span,) = [s for s in spans if s["name"] == name and s["trace_id"] == trace_id]
    return span


@pytest.mark.case("C06", "C09")
def test_real_2024_processes_one_trace_per_request_with_lightllms_ids_and_each_process_role(pypi_processes):
    """The router LightLLM started is labelled by its real start function, its request span joins
    the HTTP worker's request span (the carrier crossed zmq in LightLLM's own pickling), both carry
    LightLLM's group id, and the router's steps are its own spans linked to the request."""
    result, spans = pypi_processes["result"], pypi_processes["spans"]
    assert os.path.abspath(result["lightllm_file"]).startswith(os.path.abspath(PYPI))
    assert [t[1] for t in result["complete"]["tokens"]] == [100, 101, 102, 103, 104]
    req = _one(spans, "text_completion tiny-llama", COMPLETE_TRACE)
    router = _one(spans, "llm.router.request", COMPLETE_TRACE)
    assert (req["parent_span_id"], req["kind"]) == (PARENT, "SPAN_KIND_SERVER")
    assert router["parent_span_id"] == req["span_id"]  # one trace: HTTP worker -> router
    assert req["attributes"]["llm.request.id"] == router["attributes"]["llm.request.id"] == "8"
    for span in (req, router):
        assert span["attributes"]["gen_ai.usage.output_tokens"] == 5
        assert span["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    children = {int(pid) for pid in result["children"]}
    assert req["resource"]["process.pid"] == result["pid"] and req["resource"]["llm.process.role"] == "frontend"
    assert router["resource"]["llm.process.role"] == "router"
    assert router["resource"]["llm.process.name"] == ROUTER_TARGET and router["resource"]["process.pid"] in children
    assert router["resource"]["service.instance.id"] != req["resource"]["service.instance.id"]
    steps = [s for s in spans if s["name"] == "llm.engine.step"]
    assert steps and {s["resource"]["process.pid"] for s in steps} == {router["resource"]["process.pid"]}
    linked = {(link["trace_id"], link["span_id"]) for s in steps for link in s["links"]}
    assert (COMPLETE_TRACE, router["span_id"]) in linked or (COMPLETE_TRACE, req["span_id"]) in linked, linked
    # the detokenizer LightLLM started makes no spans; nothing comes from a process of no role
    assert {s["resource"]["llm.process.role"] for s in spans} == {"frontend", "router"}
    # each stage left as a multiprocessing child (its finalizers, llm-otel's flush, ran)
    assert len(children) == 2 and all(code is not None for code in result["children"].values())


@pytest.mark.case("C09")
def test_real_2024_client_disconnect_aborts_the_request_in_both_processes(pypi_processes):
    """LightLLM's own disconnect path: generate() sees is_disconnected(), calls abort(), the router
    marks the request FINISHED_ABORT and releases it - both spans end as aborted, in one trace."""
    result, spans = pypi_processes["result"], pypi_processes["spans"]
    # LightLLM checks is_disconnected() between the tokens it has at hand: under load the client can
    # get a second token before the check (seen once in a loaded full run)
    got = len(result["abort"]["tokens"])
    assert result["abort"]["error"] == "req_id 16 disconnected" and got >= 1
    req = _one(spans, "text_completion tiny-llama", ABORT_TRACE)
    router = _one(spans, "llm.router.request", ABORT_TRACE)
    assert router["parent_span_id"] == req["span_id"]
    for span in (req, router):
        assert span["status_code"] == "STATUS_CODE_ERROR" and span["attributes"]["error.type"] == "aborted"
        assert span["attributes"]["llm.request.id"] == "16"
    assert req["attributes"]["gen_ai.usage.output_tokens"] == got  # what the client got
    assert router["attributes"]["gen_ai.usage.output_tokens"] >= got  # what the router had generated
