"""`llm-otel demo` as a user runs it: a real vLLM engine in a fresh process, exporting over OTLP."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import HAS_VLLM, record_received

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]


@pytest.mark.case("C04")
def test_demo_exports_its_trace_and_metrics_over_otlp_and_flushes_at_exit(receiver):
    receiver.clear()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.http_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="llm-otel-demo-test",
    )
    done = subprocess.run(
        [sys.executable, "-m", "llm_otel.cli", "demo", "--prompts", "2", "--max-tokens", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    match = re.search(r"look up trace ([0-9a-f]{32})", done.stdout)
    assert match, done.stdout
    spans = receiver.spans(trace_id=match.group(1))  # no wait: the demo flushed before it exited
    record_received(spans)
    names = sorted(s["name"] for s in spans)
    model_spans = [n for n in names if n.startswith(("text_completion ", "chat "))]
    assert len(model_spans) == 3 and names.count("demo batch") == 1
    for child in ("llm.prompt", "llm.token_stream", "llm.logit_dist"):
        assert names.count(child) == 3
    root = next(s for s in spans if s["name"] == "demo batch")
    for s in spans:
        if s["name"] in model_spans:
            assert s["parent_span_id"] == root["span_id"]
            assert s["attributes"]["gen_ai.usage.output_tokens"] == 6
        assert s["resource"]["service.name"] == "llm-otel-demo-test"
    (ttft,) = [
        m
        # the demo's own points: the session's servers export the same instrument here too
        for m in receiver.metrics("gen_ai.server.time_to_first_token", resource={"service.name": "llm-otel-demo-test"})
        if m["attributes"]["gen_ai.operation.name"] == "text_completion"
    ]
    assert ttft["count"] == 2 and ttft["unit"] == "s"
