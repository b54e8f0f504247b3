"""Console output used when no OTLP endpoint is set."""

from __future__ import annotations

import io

from conftest import make_captured
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from llm_otel.export.console import ConsoleMetricsSummary, ConsoleTreeExporter


def test_tree_is_printed_when_the_root_ends_with_children_indented():
    cap = make_captured()
    out = io.StringIO()
    cap.tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleTreeExporter(out)))
    rec = cap.telemetry.start_request(
        "r", operation="chat", provider="vllm", model="m", arrival_s=1000.0, input_tokens=3
    )
    rec.mono_offset_ns = 0
    rec.on_tokens([1], 1000.02)
    rec.on_tokens([2], 1000.03)
    rec.finish_reason = "stop"
    cap.telemetry.finish(rec, end_ns=int(1000.04e9))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("chat m  40.0 ms") and "in=3 out=2" in lines[0] and "trace=" in lines[0]
    assert lines[1].startswith("├─ llm.prompt  20.0 ms")
    assert lines[2].startswith("└─ llm.token_stream  10.0 ms") and "tpot=10ms" in lines[2]


def test_metrics_summary_lists_histograms_by_operation_and_token_type():
    from opentelemetry.sdk.metrics import MeterProvider

    from llm_otel.config import Settings
    from llm_otel.telemetry import Telemetry

    reader = ConsoleMetricsSummary(io.StringIO())
    telemetry = Telemetry(make_captured().tracer_provider, MeterProvider(metric_readers=[reader]), Settings())
    rec = telemetry.start_request("r", operation="chat", provider="vllm", model="m", arrival_s=1000.0, input_tokens=3)
    rec.mono_offset_ns = 0
    rec.on_tokens([1, 2], 1000.02)
    telemetry.finish(rec, end_ns=int(1000.05e9))
    text = reader.summary()
    assert "gen_ai.server.time_to_first_token{op=chat}" in text
    assert "llm.server.token.usage{op=chat,type=output}" in text


def test_metrics_summary_tells_apart_points_that_differ_in_any_attribute():
    """Review finding: points differing only in an attribute outside op/type/error printed as
    identical lines (e.g. the KV-cache size at admission and at finish)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from llm_otel.export.console import format_metrics

    reader = InMemoryMetricReader()
    hist = MeterProvider(metric_readers=[reader]).get_meter("t").create_histogram("llm.server.request.kv_cache.size")
    hist.record(10, {"gen_ai.operation.name": "chat", "llm.kv_cache.phase": "admission", "gen_ai.request.model": "m"})
    hist.record(30, {"gen_ai.operation.name": "chat", "llm.kv_cache.phase": "finish", "gen_ai.request.model": "m"})
    lines = [line.split()[0] for line in format_metrics(reader.get_metrics_data()).splitlines()[1:]]
    assert sorted(lines) == [
        "llm.server.request.kv_cache.size{op=chat,phase=admission}",
        "llm.server.request.kv_cache.size{op=chat,phase=finish}",
    ]
