"""A collector that is down: spans dropped by the OTLP exporter are counted in
``llm_otel.spans.dropped`` and logged once (src/llm_otel/export/drops.py). The exporter is the
real OTLP gRPC exporter, pointed at a loopback port nobody listens on, then at the tests' OTLP
receiver. tests/test_fleet_pipeline.py checks the same on real vLLM servers whose collector stops."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from support.otlp_receiver import OTLPReceiver

from llm_otel.config import Settings
from llm_otel.export.exporters import ProcessSpanExporter
from llm_otel.process.providers import build_providers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dropped(reader: InMemoryMetricReader) -> list:
    data = reader.get_metrics_data()
    return [
        (dict(p.attributes), p.value)
        for rm in (data.resource_metrics if data else [])
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "llm_otel.spans.dropped"
        for p in m.data.data_points
    ]


def _emit(provider: TracerProvider, n: int) -> None:
    tracer = provider.get_tracer("test")
    for i in range(n):
        tracer.start_span(f"s{i}").end()
    provider.force_flush()


def _exporter(inner, endpoint: str) -> ProcessSpanExporter:
    """llm-otel's exporter wrapper around ``inner`` (what build_providers makes of an OTLP exporter)."""
    return ProcessSpanExporter(lambda: inner, endpoint=endpoint)


@pytest.mark.case("C13")
def test_spans_lost_to_a_collector_that_is_down_are_counted_and_logged_once(caplog):
    endpoint = f"127.0.0.1:{_closed_port()}"
    drops = _exporter(OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=1), endpoint)
    reader = InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(drops, max_export_batch_size=2))
    caplog.set_level(logging.INFO, logger="llm_otel")
    _emit(provider, 3)  # before a meter provider exists: remembered
    drops.bind(MeterProvider(metric_readers=[reader]))
    _emit(provider, 2)
    assert drops.dropped == 5
    assert _dropped(reader) == [({"error.type": "export_failed"}, 5)]
    ours = [r for r in caplog.records if r.name == "llm_otel"]
    assert len(ours) == 1 and ours[0].levelno == logging.WARNING and endpoint in ours[0].getMessage()
    sdk = [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert not [m for m in sdk if "traces" in m], sdk  # the SDK's per-batch lines are filtered
    # the collector comes back: one INFO line, nothing counted, and the next outage logs again
    with OTLPReceiver() as rx:
        drops._inner = OTLPSpanExporter(endpoint=rx.grpc_endpoint, insecure=True)
        _emit(provider, 1)
        rx.wait_for_spans(1, name="s0")
    ours = [r for r in caplog.records if r.name == "llm_otel"]
    assert [r.levelno for r in ours] == [logging.WARNING, logging.INFO] and "5 span(s) lost" in ours[1].getMessage()
    assert _dropped(reader) == [({"error.type": "export_failed"}, 5)]
    provider.shutdown()


def test_a_raising_exporter_is_a_failed_batch_not_an_exception():
    class Raising(OTLPSpanExporter):
        def export(self, spans):
            raise RuntimeError("boom")

    drops = _exporter(Raising(endpoint="127.0.0.1:1", insecure=True), "127.0.0.1:1")
    assert drops.export([object(), object()]) is SpanExportResult.FAILURE
    assert drops.dropped == 2


def test_metric_export_failures_stay_in_the_log():
    """The filter removes the trace exporter's repeated lines only: the gRPC module logs metric
    export failures through the same logger."""
    from llm_otel.export.drops import _FILTER

    name = "opentelemetry.exporter.otlp.proto.grpc.exporter"

    def record(*args):
        return logging.LogRecord(
            name, logging.ERROR, __file__, 1, "Failed to export %s to %s, error code: %s", args, None
        )

    assert not _FILTER.filter(record("traces", "x:4317", "UNAVAILABLE"))
    assert _FILTER.filter(record("metrics", "x:4317", "UNAVAILABLE"))


def test_providers_llm_otel_builds_count_their_drops():
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    tracer_provider, meter_provider = build_providers(Settings.from_env({"LLM_OTEL_EXPORT_PROCESS": "false"}), env)
    (processor,) = tracer_provider._active_span_processor._span_processors
    assert isinstance(processor.span_exporter, ProcessSpanExporter)
    assert processor.span_exporter.endpoint == env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    assert processor.span_exporter.drops._counter is not None  # bound to the process's meter provider
    tracer_provider.shutdown()
    meter_provider.shutdown()


def test_a_collector_slower_than_the_timeout_costs_the_batch_counted_and_logged_once(caplog):
    """A real gRPC OTLP trace service that holds every export past the exporter's timeout: the
    exporter gives up (DEADLINE_EXCEEDED) and the batch is counted like one to a closed port."""
    import threading
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    release = threading.Event()

    class Stalled(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (grpc naming)
            release.wait(30)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Stalled(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        endpoint = f"127.0.0.1:{port}"
        drops = _exporter(OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=1), endpoint)
        reader = InMemoryMetricReader()
        drops.bind(MeterProvider(metric_readers=[reader]))
        provider = TracerProvider()
        processor = BatchSpanProcessor(drops, schedule_delay_millis=50)
        provider.add_span_processor(processor)
        caplog.set_level(logging.INFO, logger="llm_otel")
        tracer = provider.get_tracer("test")
        for i in range(3):
            tracer.start_span(f"s{i}").end()
        provider.force_flush()
        assert drops.dropped == 3 and _dropped(reader) == [({"error.type": "export_failed"}, 3)]
        assert len([r for r in caplog.records if r.name == "llm_otel"]) == 1
    finally:
        release.set()
        server.stop(0)
    provider.shutdown()


VLLM_SERVER_LOGGING = r"""
import os, sys
from model_hosting_container_standards.logging_config import configure_root_logger
if sys.argv[1] == "plugin":
    from llm_otel.instrumentation.vllm import plugin
    plugin.register()  # what vLLM's plugin loader runs in its API server before the app is built
configure_root_logger()  # what the OpenAI server's app build then does (LOG_LEVEL unset: ERROR)
from llm_otel.export.drops import DropCounter
DropCounter("http://collector:4317").failed(3, "export_failed", "collector down")
"""


def test_the_drop_warning_survives_vllms_openai_server_logging_setup(tmp_path):
    """vLLM 0.32's OpenAI server imports model_hosting_container_standards while building its app,
    which sets the root logger to ERROR; in a vLLM process llm-otel's plugin keeps the ``llm_otel``
    logger at WARNING, so the one line of an export outage still reaches stderr (without the plugin
    it is discarded: the control run)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "server_logging.py"
    script.write_text(VLLM_SERVER_LOGGING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_", "LOG_LEVEL"))}
    env.update(
        {
            "LLM_OTEL_ENABLED": "1",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        }
    )
    runs = {
        mode: subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120)
        for mode in ("plugin", "control")
    }
    for mode, run in runs.items():
        assert run.returncode == 0, f"{mode}: {run.stderr[-3000:]}"
    assert "3 span(s) dropped" in runs["plugin"].stderr, runs["plugin"].stderr[-3000:]
    assert "span(s) dropped" not in runs["control"].stderr, runs["control"].stderr[-3000:]
