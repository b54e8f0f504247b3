"""GenAI request-metric observations an exporter process received but had not exported when it was
killed (it exports every ``OTEL_METRIC_EXPORT_INTERVAL``) either reach the collector or are
counted in ``llm_otel.metric_points.dropped`` (fresh-install review of issue 19, F4): the exporter
process reports which points each accepted export covered, and the serving process counts the
rest when the process dies. Real exporter process, real OTLP/gRPC to the tests' receiver."""

from __future__ import annotations

import os
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llm_otel.config import Settings
from llm_otel.export.offload import OffloadTracerProvider, RemoteInstrument, request_outlets
from llm_otel.process.providers import build_providers
from llm_otel.semconv import metrics as M
from llm_otel.telemetry import Telemetry


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


def _run(receiver, *, flush_before_kill: bool) -> tuple[int, int]:
    """10 observations, kill -9 the exporter process, 5 more, shut down: (received, counted)."""
    receiver.clear()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_METRIC_EXPORT_INTERVAL": "60000",
    }
    settings = Settings(console="off", adaptive_sampling="off")
    tp, mp = build_providers(settings, env, shutdown_on_exit=False)
    assert isinstance(tp, OffloadTracerProvider)
    reader = InMemoryMetricReader()
    tp.buffer.bind(MeterProvider(metric_readers=[reader]))
    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
    assert isinstance(telemetry.instruments.requests, RemoteInstrument)
    buffer = tp.buffer
    buffer.respawn_s = 0.0
    for _ in range(10):
        telemetry.instruments.requests.add(1, {"gen_ai.request.model": "m"})
    if flush_before_kill:  # an export the collector accepted covers the first 10
        assert tp.force_flush(30_000)
    deadline = time.monotonic() + 10
    while buffer._mqueue and time.monotonic() < deadline:  # noqa: SLF001 - the writer sent them
        time.sleep(0.05)
    time.sleep(0.5)  # the exporter process has read and recorded them (the interval is 60 s)
    buffer._proc.kill()  # noqa: SLF001 - the real process, killed as an OOM killer would
    buffer._proc.wait()  # noqa: SLF001
    for _ in range(5):
        telemetry.instruments.requests.add(1, {"gen_ai.request.model": "m"})
    assert tp.force_flush(30_000)
    tp.shutdown()
    time.sleep(1)
    # this process's series only: the session's servers count their own requests into this receiver
    mine = receiver.metrics(name=M.LLM_SERVER_REQUESTS, latest=False, resource={"process.pid": os.getpid()})
    received = max((p["value"] for p in mine), default=0)
    return received, _metric_drops(reader)


def test_metric_observations_held_by_a_killed_exporter_process_are_counted(receiver):
    received, counted = _run(receiver, flush_before_kill=False)
    assert received == 5 and counted == 10, (received, counted)


def test_observations_an_accepted_export_covered_are_not_counted_lost(receiver):
    received, counted = _run(receiver, flush_before_kill=True)
    # the first 10 reached the collector before the kill; the new process's series starts again at 5
    assert received == 10 and counted == 0, (received, counted)
