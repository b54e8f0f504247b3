"""A collector outage with the exporter process (issue 19 review): the exporter process keeps
reading its pipe while span exports wait on a dead collector, so GenAI request metrics survive the
outage as they do in process.

Real components: the exporter process (``python -m llm_otel.export.offload``) exporting over
OTLP/gRPC to a real receiver (tests/support/otlp_receiver.py) that starts only after the outage."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llm_otel.config import Settings
from llm_otel.process.providers import build_providers
from llm_otel.semconv import metrics as M


def _metric_drops(reader) -> int:
    data = reader.get_metrics_data()
    return sum(
        p.value
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == M.LLM_OTEL_METRIC_POINTS_DROPPED
        for p in m.data.data_points
    )


N_OUTAGE = 4000  # more observations than the pipe to the exporter process holds (64 KiB)


def _requests_counted_after_an_outage(export_process: bool) -> tuple[int, int]:
    """The collector is down while N_OUTAGE requests finish (and a few sampled spans are exported), then
    comes back on the same port: how many requests llm.server.requests counts at the collector."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import socket
    from concurrent import futures

    import grpc
    import support.otlp_receiver as orx
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
    }
    # a small buffer stands for a long outage at a high request rate (default 8192 spans, 4x that
    # many metric observations: about 2,500 requests)
    settings = Settings(console="off", adaptive_sampling="off", export_process=export_process, export_process_buffer=8)
    tp, mp = build_providers(settings, env, shutdown_on_exit=False)
    reader = InMemoryMetricReader()
    from llm_otel.export.offload import request_outlets
    from llm_otel.telemetry import Telemetry

    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
    if export_process:
        tp.buffer.bind(MeterProvider(metric_readers=[reader]))
    tracer = tp.get_tracer("t")
    for i in range(N_OUTAGE):
        if i % 200 == 0:
            tracer.start_span("sampled").end()  # the exporter process is busy retrying these
        telemetry.instruments.requests.add(1, {"gen_ai.request.model": "m"})
        if i % 10 == 0:
            time.sleep(0.01)
    rx = orx.OTLPReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(orx._TraceService(rx), server)  # noqa: SLF001
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(orx._MetricsService(rx), server)  # noqa: SLF001
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()  # the collector is back
    try:
        time.sleep(8)
        tp.force_flush(10_000)
        mp.force_flush(10_000)
        time.sleep(1)
        counted = max((p["value"] for p in rx.metrics(name=M.LLM_SERVER_REQUESTS, latest=False)), default=0)
    finally:
        tp.shutdown()
        mp.shutdown()
        server.stop(None)
    return counted, _metric_drops(reader) if export_process else 0


@pytest.mark.slow
def test_a_collector_outage_loses_no_genai_request_metrics_with_the_exporter_process():
    """In process, the meter provider aggregates every request while the collector is down and
    delivers the cumulative totals once it is back. With the exporter process, its one thread
    blocks in span exports (each retried for OTEL_EXPORTER_OTLP_TIMEOUT) and stops reading the
    pipe, so metric observations queue in the serving process and are dropped (counted) once its
    buffer is full: a collector outage permanently loses request metrics that the in-process path
    keeps."""
    in_process, _ = _requests_counted_after_an_outage(False)
    offloaded, dropped = _requests_counted_after_an_outage(True)
    assert in_process == N_OUTAGE
    assert offloaded == N_OUTAGE, (
        f"exporter process: {offloaded} of {N_OUTAGE} requests reached the collector after the "
        f"outage ({dropped} observations counted as dropped); in process: {in_process}"
    )
