"""Specification tests for the in-process OTLP receiver in ``support/otlp_receiver.py``.

Everything is sent with the official OpenTelemetry OTLP exporters so the
receiver is checked against what real instrumentation puts on the wire.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
from urllib.parse import urlsplit

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from support.otlp_receiver import OTLPReceiver

RESOURCE_ATTRS = {"service.name": "otlp-receiver-tests", "deployment.environment": "test"}
SCOPE = ("tests.otlp_receiver", "1.2.3")

CHILD_ATTRS = {
    "gen_ai.system": "openai",
    "gen_ai.usage.input_tokens": 12,
    "gen_ai.request.temperature": 0.7,
    "gen_ai.request.stream": True,
    "gen_ai.response.finish_reasons": ["stop", "length"],
    "llm.token_ids": [101, 102, 103],
    "llm.scores": [0.25, 1.5],
    "llm.flags": [True, False],
}

LINKED = SpanContext(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C,
    span_id=0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
)

REMOTE_PARENT = SpanContext(
    trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736,
    span_id=0x00F067AA0BA902B7,
    is_remote=True,
    trace_flags=TraceFlags(TraceFlags.SAMPLED),
    trace_state=TraceState([("vendor", "abc"), ("other", "1")]),
)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@pytest.fixture
def rx():
    with OTLPReceiver() as receiver:
        yield receiver


def _span_exporter(rx: OTLPReceiver, transport: str):
    if transport == "grpc":
        return GrpcSpanExporter(endpoint=rx.grpc_endpoint, insecure=True)
    if transport == "grpc+gzip":
        return GrpcSpanExporter(endpoint=rx.grpc_endpoint, insecure=True, compression=grpc.Compression.Gzip)
    if transport == "http":
        return HttpSpanExporter(endpoint=rx.http_traces_url)
    if transport == "http+gzip":
        return HttpSpanExporter(endpoint=rx.http_traces_url, compression=Compression.Gzip)
    raise AssertionError(transport)


def _metric_exporter(rx: OTLPReceiver, transport: str):
    if transport == "grpc":
        return GrpcMetricExporter(endpoint=rx.grpc_endpoint, insecure=True)
    if transport == "http":
        return HttpMetricExporter(endpoint=rx.http_metrics_url)
    raise AssertionError(transport)


@pytest.fixture
def make_tracer_provider():
    providers = []

    def make(exporter) -> TracerProvider:
        provider = TracerProvider(resource=Resource(RESOURCE_ATTRS))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        providers.append(provider)
        return provider

    yield make
    for provider in providers:  # before the receiver stops, so nothing retries
        provider.shutdown()


@pytest.fixture
def make_meter_provider():
    providers = []

    def make(exporter) -> MeterProvider:
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
        provider = MeterProvider(metric_readers=[reader], resource=Resource(RESOURCE_ATTRS))
        providers.append(provider)
        return provider

    yield make
    for provider in providers:
        provider.shutdown()


def _hex_trace(ctx: SpanContext) -> str:
    return format(ctx.trace_id, "032x")


def _hex_span(ctx: SpanContext) -> str:
    return format(ctx.span_id, "016x")


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    try:
        conn.request("POST", parts.path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        conn.close()


def _port(endpoint: str) -> int:
    return urlsplit(endpoint).port


PROTOBUF = {"Content-Type": "application/x-protobuf"}


# --------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "grpc+gzip", "http", "http+gzip"])
def test_parent_and_child_spans_are_decoded_field_by_field(rx, make_tracer_provider, transport):
    provider = make_tracer_provider(_span_exporter(rx, transport))
    tracer = provider.get_tracer(*SCOPE)

    parent = tracer.start_span(
        "agent.run", kind=SpanKind.SERVER, start_time=1_000_000_000, attributes={"agent.name": "planner"}
    )
    child = tracer.start_span(
        "llm.chat",
        context=trace.set_span_in_context(parent),
        kind=SpanKind.CLIENT,
        attributes=CHILD_ATTRS,
        links=[Link(LINKED, {"link.reason": "retry", "attempt": 2})],
        start_time=1_100_000_000,
    )
    child.add_event("gen_ai.content.prompt", {"gen_ai.prompt": "hi", "tokens": 3}, timestamp=1_150_000_000)
    child.set_status(Status(StatusCode.ERROR, "rate limited"))
    child.end(end_time=1_200_000_000)
    parent.end(end_time=1_300_000_000)

    received = rx.wait_for_spans(2, timeout=5)
    parent_ctx, child_ctx = parent.get_span_context(), child.get_span_context()
    wire = transport.split("+")[0]

    assert [s["name"] for s in received] == ["llm.chat", "agent.run"]  # end order
    assert rx.spans(name="llm.chat") == [
        {
            "trace_id": _hex_trace(child_ctx),
            "span_id": _hex_span(child_ctx),
            "parent_span_id": _hex_span(parent_ctx),
            "name": "llm.chat",
            "kind": "SPAN_KIND_CLIENT",
            "start_ns": 1_100_000_000,
            "end_ns": 1_200_000_000,
            "attributes": CHILD_ATTRS,
            "events": [
                {
                    "name": "gen_ai.content.prompt",
                    "time_ns": 1_150_000_000,
                    "attributes": {"gen_ai.prompt": "hi", "tokens": 3},
                }
            ],
            "links": [
                {
                    "trace_id": "0af7651916cd43dd8448eb211c80319c",
                    "span_id": "b7ad6b7169203331",
                    "attributes": {"link.reason": "retry", "attempt": 2},
                }
            ],
            "status_code": "STATUS_CODE_ERROR",
            "status_message": "rate limited",
            "resource": RESOURCE_ATTRS,
            "scope_name": SCOPE[0],
            "scope_version": SCOPE[1],
            "trace_state": "",
            "transport": wire,
        }
    ]
    assert rx.spans(name="agent.run") == [
        {
            "trace_id": _hex_trace(parent_ctx),
            "span_id": _hex_span(parent_ctx),
            "parent_span_id": "",
            "name": "agent.run",
            "kind": "SPAN_KIND_SERVER",
            "start_ns": 1_000_000_000,
            "end_ns": 1_300_000_000,
            "attributes": {"agent.name": "planner"},
            "events": [],
            "links": [],
            "status_code": "STATUS_CODE_UNSET",
            "status_message": "",
            "resource": RESOURCE_ATTRS,
            "scope_name": SCOPE[0],
            "scope_version": SCOPE[1],
            "trace_state": "",
            "transport": wire,
        }
    ]
    assert _hex_trace(child_ctx) == _hex_trace(parent_ctx)


def test_gzip_compressed_http_export_is_received_as_gzip(rx, make_tracer_provider):
    provider = make_tracer_provider(HttpSpanExporter(endpoint=rx.http_traces_url, compression=Compression.Gzip))
    with provider.get_tracer(*SCOPE).start_as_current_span("compressed"):
        pass

    (span,) = rx.wait_for_spans(1, timeout=5, name="compressed")
    assert span["transport"] == "http"
    assert rx.requests() == [
        {
            "transport": "http",
            "signal": "traces",
            "content_encoding": "gzip",
            "status": 200,
            "error": None,
            "peer": None,
            "size": None,
        }
    ]


def test_span_under_a_remote_parent_keeps_parent_id_and_trace_state(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "grpc"))
    remote = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    with provider.get_tracer(*SCOPE).start_as_current_span("handle", context=remote, kind=SpanKind.CONSUMER):
        pass

    (span,) = rx.wait_for_spans(1, timeout=5)
    assert span["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span["parent_span_id"] == "00f067aa0ba902b7"
    assert span["trace_state"] == "vendor=abc,other=1"
    assert span["kind"] == "SPAN_KIND_CONSUMER"
    # The parent was never received, so the span is a root of its trace tree.
    assert rx.tree(span["trace_id"]) == [{"span": span, "children": []}]


def test_tree_nests_spans_by_parent_and_orders_siblings_by_start(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "http"))
    tracer = provider.get_tracer(*SCOPE)
    with tracer.start_as_current_span("root") as root:
        with tracer.start_as_current_span("first"):
            with tracer.start_as_current_span("grandchild"):
                pass
        with tracer.start_as_current_span("second"):
            pass
    with tracer.start_as_current_span("other-trace"):
        pass

    rx.wait_for_spans(5, timeout=5)
    trace_id = _hex_trace(root.get_span_context())

    def names(nodes):
        return [(n["span"]["name"], names(n["children"])) for n in nodes]

    assert names(rx.tree(trace_id)) == [("root", [("first", [("grandchild", [])]), ("second", [])])]
    (root_span,) = rx.spans(name="root")
    assert [s["name"] for s in rx.children(root_span)] == ["first", "second"]
    assert rx.children(rx.spans(name="second")[0]) == []
    assert rx.tree("0" * 32) == []


def test_spans_filters_by_equality_on_any_decoded_key(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "grpc"))
    tracer = provider.get_tracer(*SCOPE)
    with tracer.start_as_current_span("a", kind=SpanKind.CLIENT) as a:
        pass
    with tracer.start_as_current_span("b"):
        pass

    rx.wait_for_spans(2, timeout=5)
    assert [s["name"] for s in rx.spans()] == ["a", "b"]
    assert [s["name"] for s in rx.spans(kind="SPAN_KIND_CLIENT")] == ["a"]
    assert [s["name"] for s in rx.spans(trace_id=_hex_trace(a.get_span_context()))] == ["a"]
    assert rx.spans(name="a", transport="http") == []
    with pytest.raises(ValueError, match="unknown filter key"):
        rx.spans(nmae="a")


def test_wait_for_spans_wakes_up_when_spans_arrive_later(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "grpc"))

    def export_later():
        with provider.get_tracer(*SCOPE).start_as_current_span("late"):
            pass

    timer = threading.Timer(0.1, export_later)
    timer.start()
    try:
        (span,) = rx.wait_for_spans(1, timeout=5, name="late")
    finally:
        timer.join()
    assert span["name"] == "late"


def test_returned_spans_are_copies_that_do_not_alter_storage(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "grpc"))
    with provider.get_tracer(*SCOPE).start_as_current_span("x", attributes={"k": "v"}):
        pass
    (span,) = rx.wait_for_spans(1, timeout=5)
    span["attributes"]["k"] = "changed"
    assert rx.spans()[0]["attributes"] == {"k": "v"}


def test_wait_for_spans_times_out_with_a_listing_of_what_arrived(rx, make_tracer_provider):
    provider = make_tracer_provider(_span_exporter(rx, "http"))
    with provider.get_tracer(*SCOPE).start_as_current_span("arrived-span"):
        pass
    rx.wait_for_spans(1, timeout=5)

    with pytest.raises(TimeoutError) as excinfo:
        rx.wait_for_spans(1, timeout=0.1, name="never-sent")
    message = str(excinfo.value)
    assert "never-sent" in message
    assert "'arrived-span'" in message
    assert "1 span(s) arrived" in message


def test_clear_forgets_spans_metrics_and_requests(rx, make_tracer_provider, make_meter_provider):
    tracer_provider = make_tracer_provider(_span_exporter(rx, "grpc"))
    with tracer_provider.get_tracer(*SCOPE).start_as_current_span("before-clear"):
        pass
    meter_provider = make_meter_provider(_metric_exporter(rx, "grpc"))
    meter_provider.get_meter(*SCOPE).create_counter("c").add(1)
    meter_provider.force_flush()
    rx.wait_for_spans(1, timeout=5)
    rx.wait_for_metric("c", timeout=5)

    rx.clear()

    assert rx.spans() == []
    assert rx.metrics() == []
    assert rx.metrics(latest=False) == []
    assert rx.requests() == []


# --------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_histogram_sum_and_gauge_points_are_decoded(rx, make_meter_provider, transport):
    provider = make_meter_provider(_metric_exporter(rx, transport))
    meter = provider.get_meter(*SCOPE)
    duration = meter.create_histogram(
        "gen_ai.client.operation.duration",
        unit="s",
        description="LLM call duration",
        explicit_bucket_boundaries_advisory=[0.1, 0.5, 1.0],
    )
    for value in (0.05, 0.3, 0.7, 2.5):
        duration.record(value, {"gen_ai.system": "openai"})
    tokens = meter.create_counter("gen_ai.client.token.usage", unit="{token}")
    tokens.add(5, {"gen_ai.token.type": "input"})
    tokens.add(7, {"gen_ai.token.type": "input"})
    tokens.add(3, {"gen_ai.token.type": "output"})
    meter.create_gauge("llm.queue.depth").set(4, {"queue": "main"})

    assert provider.force_flush()
    (hist,) = rx.wait_for_metric("gen_ai.client.operation.duration", timeout=5)

    assert hist["kind"] == "histogram"
    assert hist["unit"] == "s"
    assert hist["description"] == "LLM call duration"
    assert hist["attributes"] == {"gen_ai.system": "openai"}
    assert hist["count"] == 4
    assert hist["sum"] == pytest.approx(3.55)
    assert hist["min"] == pytest.approx(0.05)
    assert hist["max"] == pytest.approx(2.5)
    assert hist["explicit_bounds"] == [0.1, 0.5, 1.0]
    assert hist["bucket_counts"] == [1, 1, 1, 1]
    assert hist["resource"] == RESOURCE_ATTRS
    assert (hist["scope_name"], hist["scope_version"]) == SCOPE
    assert hist["transport"] == transport
    assert hist["time_ns"] >= hist["start_ns"] > 0

    sums = {p["attributes"]["gen_ai.token.type"]: p for p in rx.metrics("gen_ai.client.token.usage")}
    assert {k: p["value"] for k, p in sums.items()} == {"input": 12, "output": 3}
    assert all(p["kind"] == "sum" and p["is_monotonic"] for p in sums.values())
    assert all(p["temporality"] == "AGGREGATION_TEMPORALITY_CUMULATIVE" for p in sums.values())
    assert all(p["unit"] == "{token}" for p in sums.values())

    (gauge,) = rx.metrics("llm.queue.depth")
    assert (gauge["kind"], gauge["value"], gauge["attributes"]) == ("gauge", 4, {"queue": "main"})
    assert isinstance(gauge["value"], int)


def test_metrics_keeps_latest_point_per_attributes_and_full_history(rx, make_meter_provider):
    provider = make_meter_provider(_metric_exporter(rx, "http"))
    counter = provider.get_meter(*SCOPE).create_counter("requests")
    counter.add(2, {"route": "/a"})
    counter.add(1, {"route": "/b"})
    provider.force_flush()
    rx.wait_for_metric("requests", timeout=5)
    counter.add(3, {"route": "/a"})
    provider.force_flush()
    rx.wait_for_metric("requests", timeout=5, predicate=lambda p: p["value"] == 5)

    latest = {p["attributes"]["route"]: p["value"] for p in rx.metrics("requests")}
    assert latest == {"/a": 5, "/b": 1}
    history = [(p["attributes"]["route"], p["value"]) for p in rx.metrics("requests", latest=False)]
    assert history[:2] in ([("/a", 2), ("/b", 1)], [("/b", 1), ("/a", 2)])
    assert sorted(history[2:]) == [("/a", 5), ("/b", 1)]
    assert rx.metrics("no-such-metric") == []
    assert {p["name"] for p in rx.metrics()} == {"requests"}


def test_latest_points_are_kept_per_resource_and_can_be_picked_by_resource(rx):
    """Two processes exporting the same instrument with the same attributes (the session's server
    and a test's own program) are two series: neither overwrites the other's latest point, and a
    test picks its own by a resource attribute it set."""
    providers = [
        MeterProvider(
            metric_readers=[PeriodicExportingMetricReader(_metric_exporter(rx, "grpc"), 60_000)],
            resource=Resource({**RESOURCE_ATTRS, "service.name": name, "process.pid": pid}),
        )
        for name, pid in (("session-server", 1), ("the-test", 2))
    ]
    try:
        for provider, value in zip(providers, (7, 3)):
            provider.get_meter(*SCOPE).create_counter("requests").add(value, {"route": "/a"})
            assert provider.force_flush()
        rx.wait_for_metric("requests", timeout=5, resource={"service.name": "the-test"})
        rx.wait_for_metric("requests", timeout=5, resource={"service.name": "session-server"})
        assert sorted(p["value"] for p in rx.metrics("requests")) == [3, 7]
        (mine,) = rx.metrics("requests", resource={"service.name": "the-test"})
        assert (mine["value"], mine["resource"]["process.pid"]) == (3, 2)
        (theirs,) = rx.wait_for_metric("requests", resource={"process.pid": 1}, timeout=5)
        assert theirs["value"] == 7
        assert rx.metrics("requests", resource={"service.name": "the-test", "process.pid": 1}) == []
        with pytest.raises(TimeoutError, match="from resource"):
            rx.wait_for_metric("requests", timeout=0.1, resource={"service.name": "nobody"})
    finally:
        for provider in providers:
            provider.shutdown()


def test_wait_for_metric_times_out_naming_the_metrics_that_arrived(rx, make_meter_provider):
    provider = make_meter_provider(_metric_exporter(rx, "grpc"))
    provider.get_meter(*SCOPE).create_counter("seen.counter").add(1)
    provider.force_flush()
    rx.wait_for_metric("seen.counter", timeout=5)

    with pytest.raises(TimeoutError, match=r"'missing\.metric'.*seen\.counter \(sum\)"):
        rx.wait_for_metric("missing.metric", timeout=0.1)
    with pytest.raises(TimeoutError, match="matching predicate"):
        rx.wait_for_metric("seen.counter", timeout=0.1, predicate=lambda p: p["value"] > 1)


# --------------------------------------------------------------------------
# HTTP protocol edges
# --------------------------------------------------------------------------


def test_http_replies_with_a_protobuf_export_response(rx):
    request = trace_service_pb2.ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes(range(16)), bytes(range(8)), "hand-made"

    status, content_type, body = _post(rx.http_traces_url, request.SerializeToString(), PROTOBUF)
    assert (status, content_type) == (200, "application/x-protobuf")
    trace_service_pb2.ExportTraceServiceResponse.FromString(body)  # parses

    status, content_type, body = _post(
        rx.http_metrics_url, metrics_service_pb2.ExportMetricsServiceRequest().SerializeToString(), PROTOBUF
    )
    assert (status, content_type) == (200, "application/x-protobuf")
    metrics_service_pb2.ExportMetricsServiceResponse.FromString(body)

    (received,) = rx.spans()
    assert received["trace_id"] == bytes(range(16)).hex()
    assert received["parent_span_id"] == ""
    assert received["kind"] == "SPAN_KIND_UNSPECIFIED"


@pytest.mark.parametrize(
    "path, body, extra_headers",
    [
        ("/v1/traces", b"this is not protobuf", {}),
        ("/v1/metrics", b"this is not protobuf", {}),
        ("/v1/traces", b"not gzip at all", {"Content-Encoding": "gzip"}),
        ("/v1/traces", gzip.compress(b"this is not protobuf"), {"Content-Encoding": "gzip"}),
    ],
    ids=["traces", "metrics", "bad-gzip", "gzipped-garbage"],
)
def test_http_rejects_a_malformed_body_with_400_and_stores_nothing(rx, path, body, extra_headers):
    status, _, _ = _post(rx.http_endpoint + path, body, {**PROTOBUF, **extra_headers})

    assert status == 400
    assert rx.spans() == []
    assert rx.metrics(latest=False) == []
    (logged,) = rx.requests()
    assert logged["status"] == 400 and logged["transport"] == "http"


def test_http_rejects_unknown_paths_and_non_otlp_content(rx):
    assert _post(rx.http_endpoint + "/v1/logs", b"", PROTOBUF)[0] == 404
    assert _post(rx.http_traces_url, b"{}", {"Content-Type": "text/plain"})[0] == 415
    assert _post(rx.http_traces_url, b"{not json", {"Content-Type": "application/json"})[0] == 400


def test_http_accepts_otlp_json_with_hex_ids(rx):
    # the shape Triton's C++ OTLP/HTTP exporter posts: hex ids, application/json
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "triton"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "triton-server"},
                        "spans": [
                            {
                                "traceId": "0af7651916cd43dd8448eb211c80319c",
                                "spanId": "b7ad6b7169203331",
                                "parentSpanId": "00f067aa0ba902b7",
                                "name": "InferRequest",
                                "kind": 2,
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                            }
                        ],
                    }
                ],
            }
        ]
    }
    status = _post(rx.http_traces_url, json.dumps(body).encode(), {"Content-Type": "application/json"})[0]
    assert status == 200
    (span,) = rx.wait_for_spans(1)
    assert (span["trace_id"], span["span_id"], span["parent_span_id"]) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        "00f067aa0ba902b7",
    )
    assert span["kind"] == "SPAN_KIND_SERVER" and span["scope_name"] == "triton-server"


# --------------------------------------------------------------------------
# lifecycle
# --------------------------------------------------------------------------


def test_receiver_listens_only_on_loopback_and_closes_its_ports_on_exit():
    with OTLPReceiver() as rx:
        endpoints = [rx.grpc_endpoint, rx.http_endpoint]
        assert all(e.startswith("http://127.0.0.1:") for e in endpoints)
        assert rx.http_traces_url == rx.http_endpoint + "/v1/traces"
        assert rx.http_metrics_url == rx.http_endpoint + "/v1/metrics"
        assert _port(rx.grpc_endpoint) != _port(rx.http_endpoint)
        for endpoint in endpoints:
            socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=2).close()

    for endpoint in endpoints:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=2).close()
    with pytest.raises(RuntimeError, match="not running"):
        rx.grpc_endpoint
