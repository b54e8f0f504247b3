"""SGLang's own tracing (``--enable-trace``) beside llm-otel on the real SGLang 0.5.23 server on CPU:
SGLang's request root (``Req <rid>``) and its stage spans (``tokenize``, ``prefill_forward``,
``decode_loop``, ...) nest under llm-otel's request span, in the trace of the inbound traceparent,
through llm-otel's provider (SGLang's ``set_tracer_provider`` is refused: no span goes to a second
global provider), with 128-bit trace ids. A second server (``--enable-trace``); the module
test_sglang_server.py covers the server with it off.
"""

from __future__ import annotations

import secrets
import time
import urllib.error

import pytest
from support import sglang_server, tools
from support.otlp_receiver import OTLPReceiver

from llm_otel.demo.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.sglang

_REASON = sglang_server.unavailable_reason()
if _REASON and not tools.in_ci():  # under CI the fixture fails instead (support/tools.py)
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    assert _REASON is None, _REASON
    rx = OTLPReceiver().start()
    server = sglang_server.start(
        str(ensure_tiny_model()),
        rx.grpc_endpoint,
        tmp_path_factory.mktemp("sglang-trace") / "server.log",
        (
            "--enable-trace",
            "--otlp-traces-endpoint",
            rx.grpc_endpoint.replace("http://", ""),
            # a request with a priority is rejected by the scheduler (priority scheduling is off)
            "--abort-on-priority-when-disabled",
        ),
    )
    try:
        yield server, rx
    finally:
        server.stop()
        rx.stop()


def _ancestors(span: dict, by_id: dict[str, dict]) -> list[str]:
    names = []
    while span["parent_span_id"] in by_id:
        span = by_id[span["parent_span_id"]]
        names.append(span["name"])
    return names


def test_sglang_stage_spans_nest_under_the_llm_otel_request_span(traced):
    server, rx = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    out = server.post(
        "/generate",
        {"text": "Hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        {"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    rid = out["meta_info"]["id"]
    (request,) = rx.wait_for_spans(1, timeout=30, trace_id=trace_id, kind="SPAN_KIND_SERVER")
    assert request["parent_span_id"] == parent_id
    assert request["attributes"]["gen_ai.usage.output_tokens"] == out["meta_info"]["completion_tokens"]
    # SGLang's root for this request, under ours (SGLang names it after the rid's first 8 characters)
    (root,) = rx.wait_for_spans(1, timeout=30, trace_id=trace_id, name=f" Req {rid[:8]}")
    assert root["parent_span_id"] == request["span_id"]
    wanted = {"tokenize", "prefill_forward", "decode_loop"}

    def nested() -> tuple[list[dict], list[str]]:
        spans = rx.spans(trace_id=trace_id)
        by_id = {s["span_id"]: s for s in spans}
        stages = [s for s in spans if s["name"] in wanted]
        loose = [s["name"] for s in stages if request["name"] not in _ancestors(s, by_id)]
        return stages, loose

    deadline = time.monotonic() + 30  # a stage's parent (SGLang's per-process span) may come later
    stages, loose = nested()
    while time.monotonic() < deadline and (loose or not wanted <= {s["name"] for s in stages}):
        time.sleep(0.2)
        stages, loose = nested()
    assert wanted <= {s["name"] for s in stages}
    assert loose == []  # every SGLang stage span hangs under llm-otel's request span
    # SGLang's scheduler-side spans come from the scheduler process, through llm-otel's provider
    roles = {s["resource"].get("llm.process.role") for s in stages}
    assert roles == {"frontend", "engine_core"}
    # no 64-bit (top half zero) trace id anywhere: SGLang's own id generator is not in use
    assert not [s for s in rx.spans() if s["trace_id"].startswith("0" * 16)]


def test_a_request_the_scheduler_rejects_ends_its_scheduler_records(traced):
    """SGLang rejects a request in ``_add_request_to_queue`` (here: a priority while priority
    scheduling is off; also a full queue) and reports it with ``send_abort_output``, never through a
    batch result or ``abort_request``: llm-otel's scheduler entries for it (the rid table, the
    ``llm.infer.request`` of a request chosen for logit statistics) end there - before, they stayed
    until the tables' caps and then no request got step spans or logit statistics."""
    server, rx = traced
    trace_id = secrets.token_hex(16)
    with pytest.raises(urllib.error.HTTPError):
        server.post(
            "/generate",
            {"text": "x y", "priority": 3, "sampling_params": {"max_new_tokens": 2}},
            {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
        )
    (infer,) = rx.wait_for_spans(1, timeout=30, trace_id=trace_id, name="llm.infer.request")
    assert infer["status_code"] == "STATUS_CODE_ERROR", infer
    assert infer["resource"]["llm.process.role"] == "engine_core"
