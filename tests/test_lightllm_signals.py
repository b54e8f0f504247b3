"""LightLLM's HTTP worker feeds the serving signals like vLLM does: its requests get request
classes, a tier, SLO checks and the tier label on the GenAI metrics, and its streamed tokens reach
the signals' token count - through the telemetry core's request lifecycle, not through calls of
the adapter's own (issue 21). Runs against the `main` stand-in tree (tests/lightllm_layouts/) in a
fresh interpreter where that tree is `lightllm`, like test_lightllm_unit.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from lightllm_layouts.layers import build_tree

SCRIPT = textwrap.dedent("""
    import asyncio, json, multiprocessing
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import LightLLMInstrumentor
    exporter = InMemorySpanExporter()
    tp = TracerProvider(); tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    inst = LightLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(metric_readers=[reader]),
                    settings=Settings.from_env())
    from lightllm import _standin
    from lightllm.server.core.objs import FinishStatus, SamplingParams
    from lightllm.server.httpserver.manager import HttpServerManager
    from lightllm.server.multimodal_params import MultimodalParams

    class URL:
        path = "/generate"

    class Request:  # the Starlette request LightLLM's API server hands to generate()
        def __init__(self, tenant):
            self.headers = {"x-tenant-id": tenant, "content-type": "application/json"}
            self.url = URL()
        async def is_disconnected(self):
            return False

    raw = _standin.new_shm(multiprocessing.get_context("spawn"))
    m = HttpServerManager({"model_name": "tiny"}, type("Q", (), {"put": lambda self, obj: None})(), raw)
    async def three_tokens(self, start_time, prompt_ids, gid, sampling_params, req_status, request):
        for i, status in enumerate((0, 0, 1)):  # two tokens, then the last one finishes (stop)
            yield gid, "x", {"id": 7 + i, "count_output_tokens": i + 1}, FinishStatus(status)
    m._wait_to_token_package = three_tokens.__get__(m)
    async def serve(tenant):
        return [x async for x in m.generate("a b", SamplingParams(), MultimodalParams(), Request(tenant))]
    asyncio.run(serve("acme"))
    asyncio.run(serve("globex"))
    out = {}
    spans = [s for s in exporter.get_finished_spans() if s.name == "text_completion tiny"]
    out["spans"] = sorted([s.attributes.get("llm.request.tenant"), s.attributes.get("llm.request.tier"),
                           s.attributes.get("llm.request.model.revision"), s.kind.name] for s in spans)
    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    points.setdefault(metric.name, []).append(dict(p.attributes) | {"_value": getattr(p, "value", getattr(p, "count", None))})
    out["slo"] = sorted([p["llm.request.tier"], p["llm.slo.objective"], p["llm.slo.outcome"], p["_value"]]
                        for p in points.get("llm.server.slo.checks", []))
    out["duration_tiers"] = sorted(p.get("llm.request.tier") for p in points.get("gen_ai.server.request.duration", []))
    signals = inst.adapter.telemetry.signals
    out["tokens_counted"] = sum(n for _, n in signals._steps)
    out["errors"] = inst.adapter.telemetry.errors.counts
    inst.uninstrument()
    print("RESULT " + json.dumps(out))
""")


def test_lightllm_http_requests_get_request_classes_tiers_and_slo_checks(tmp_path):
    tree = build_tree("main", tmp_path / "main")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        LLM_OTEL_CLASS_HEADERS="tenant:x-tenant-id",
        LLM_OTEL_TIERS="premium tenant=acme ttft=60; standard * e2e=120",
        LLM_OTEL_MODEL_REVISION="stable",
    )
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
    # request classes from the HTTP headers and the tier from the table, on each SERVER span
    assert out["spans"] == [["acme", "premium", "stable", "SERVER"], ["globex", "standard", "stable", "SERVER"]]
    # SLO checks per tier: availability for both, premium's TTFT and standard's end-to-end target
    assert out["slo"] == [
        ["premium", "availability", "met", 1],
        ["premium", "ttft", "met", 1],
        ["standard", "availability", "met", 1],
        ["standard", "e2e", "met", 1],
    ]
    # the GenAI metrics carry the tier label (bounded request classes on the record)
    assert out["duration_tiers"] == ["premium", "standard"]
    # every streamed token reached the signals (token efficiency's window): 3 per request
    assert out["tokens_counted"] == 6
    assert out["errors"] == {}
