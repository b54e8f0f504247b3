"""In-process OTLP trace and metrics receiver for the test suite.

``OTLPReceiver`` runs two servers on loopback only, both on free ports:

* a gRPC server implementing the OTLP ``TraceService`` and ``MetricsService``;
* an OTLP/HTTP server (``POST /v1/traces`` and ``POST /v1/metrics``, binary
  protobuf or OTLP/JSON bodies - JSON ids are hex as the OTLP spec says, which is
  what Triton's C++ exporter sends - optionally ``gzip`` or ``deflate`` encoded).

Everything that arrives is decoded into plain dicts so tests can assert on
ordinary Python values instead of protobuf messages::

    with OTLPReceiver() as rx:
        exporter = OTLPSpanExporter(endpoint=rx.grpc_endpoint, insecure=True)
        ...
        (span,) = rx.wait_for_spans(1, name="chat")
        assert span["attributes"]["gen_ai.request.model"] == "gpt-4o"

Span dict keys: ``trace_id``, ``span_id``, ``parent_span_id`` (lowercase hex,
parent ``""`` for a root), ``name``, ``kind`` (proto enum name, e.g.
``"SPAN_KIND_INTERNAL"``), ``start_ns``, ``end_ns``, ``attributes``,
``events`` (dicts ``name``/``time_ns``/``attributes``), ``links`` (dicts
``trace_id``/``span_id``/``attributes``), ``status_code`` (e.g.
``"STATUS_CODE_ERROR"``), ``status_message``, ``resource``, ``scope_name``,
``scope_version``, ``trace_state``, ``transport`` (``"grpc"``/``"http"``).

Metric point dict keys: ``name``, ``unit``, ``description``, ``kind``
(``"histogram"``, ``"sum"``, ``"gauge"``; also ``"exponential_histogram"``
and ``"summary"`` with count/sum only), ``attributes``, ``start_ns``,
``time_ns``, ``resource``, ``scope_name``, ``scope_version``, ``transport``,
plus ``count``/``sum``/``min``/``max``/``bucket_counts``/``explicit_bounds``/``exemplars``
(dicts ``trace_id``/``span_id``/``value``) for histograms, ``value`` for sums and gauges, and ``is_monotonic``/
``temporality`` for sums.
"""

from __future__ import annotations

import base64
import binascii
import copy
import gzip
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

__all__ = ["OTLPReceiver"]

_LOOPBACK = "127.0.0.1"

SPAN_KEYS = frozenset(
    {
        "trace_id",
        "span_id",
        "parent_span_id",
        "name",
        "kind",
        "start_ns",
        "end_ns",
        "attributes",
        "events",
        "links",
        "status_code",
        "status_message",
        "resource",
        "scope_name",
        "scope_version",
        "trace_state",
        "transport",
    }
)


# --------------------------------------------------------------------------
# protobuf -> plain python decoding
# --------------------------------------------------------------------------


def _any_value(value) -> Any:
    """Decode an ``AnyValue`` into str/int/float/bool/bytes/list/dict/None."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, which)


def _attributes(key_values: Iterable) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in key_values}


def _hex(raw: bytes) -> str:
    return raw.hex()


def _freeze(value: Any) -> Any:
    """Make an attribute value hashable (lists -> tuples, dicts -> sorted tuples)."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _decode_span(span, resource: dict, scope, transport: str) -> dict[str, Any]:
    return {
        "trace_id": _hex(span.trace_id),
        "span_id": _hex(span.span_id),
        "parent_span_id": _hex(span.parent_span_id),
        "name": span.name,
        "kind": trace_pb2.Span.SpanKind.Name(span.kind),
        "start_ns": int(span.start_time_unix_nano),
        "end_ns": int(span.end_time_unix_nano),
        "attributes": _attributes(span.attributes),
        "events": [
            {
                "name": event.name,
                "time_ns": int(event.time_unix_nano),
                "attributes": _attributes(event.attributes),
            }
            for event in span.events
        ],
        "links": [
            {
                "trace_id": _hex(link.trace_id),
                "span_id": _hex(link.span_id),
                "attributes": _attributes(link.attributes),
            }
            for link in span.links
        ],
        "status_code": trace_pb2.Status.StatusCode.Name(span.status.code),
        "status_message": span.status.message,
        "resource": dict(resource),
        "scope_name": scope.name,
        "scope_version": scope.version,
        "trace_state": span.trace_state,
        "transport": transport,
    }


def _number(point) -> int | float | None:
    which = point.WhichOneof("value")
    if which is None:
        return None
    return int(point.as_int) if which == "as_int" else float(point.as_double)


def _optional(message, field: str) -> float | None:
    return getattr(message, field) if message.HasField(field) else None


def _decode_metric(metric, resource: dict, scope, transport: str) -> list[dict[str, Any]]:
    which = metric.WhichOneof("data")
    if which is None:
        return []
    data = getattr(metric, which)
    points = []
    for point in data.data_points:
        item: dict[str, Any] = {
            "name": metric.name,
            "unit": metric.unit,
            "description": metric.description,
            "kind": which,
            "attributes": _attributes(point.attributes),
            "start_ns": int(point.start_time_unix_nano),
            "time_ns": int(point.time_unix_nano),
            "resource": dict(resource),
            "scope_name": scope.name,
            "scope_version": scope.version,
            "transport": transport,
        }
        if which == "histogram":
            item.update(
                count=int(point.count),
                sum=_optional(point, "sum"),
                min=_optional(point, "min"),
                max=_optional(point, "max"),
                bucket_counts=[int(c) for c in point.bucket_counts],
                explicit_bounds=list(point.explicit_bounds),
                exemplars=[
                    {"trace_id": _hex(e.trace_id), "span_id": _hex(e.span_id), "value": _number(e)}
                    for e in point.exemplars
                ],
            )
        elif which in ("sum", "gauge"):
            item["value"] = _number(point)
            if which == "sum":
                item["is_monotonic"] = data.is_monotonic
                item["temporality"] = metrics_pb2.AggregationTemporality.Name(data.aggregation_temporality)
        elif which == "exponential_histogram":
            item.update(count=int(point.count), sum=_optional(point, "sum"))
        elif which == "summary":
            item.update(count=int(point.count), sum=float(point.sum))
        points.append(item)
    return points


def _check_filters(filters: dict[str, Any], known: Iterable[str]) -> None:
    unknown = set(filters) - set(known)
    if unknown:
        raise ValueError(f"unknown filter key(s) {sorted(unknown)}; known keys: {sorted(known)}")


def _matches(item: dict[str, Any], filters: dict[str, Any]) -> bool:
    return all(item.get(key) == want for key, want in filters.items())


def _has_resource(point: dict[str, Any], resource: dict[str, Any] | None) -> bool:
    return resource is None or all(point["resource"].get(key) == want for key, want in resource.items())


def _describe_span(span: dict[str, Any]) -> str:
    parent = span["parent_span_id"] or "-"
    return (
        f"{span['name']!r} kind={span['kind']} trace={span['trace_id']} "
        f"span={span['span_id']} parent={parent} status={span['status_code']} "
        f"via={span['transport']}"
    )


# --------------------------------------------------------------------------
# gRPC services
# --------------------------------------------------------------------------


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (grpc naming)
        if self._receiver.trace_delay_s:
            time.sleep(self._receiver.trace_delay_s)  # a slow collector
        self._receiver._record_request("grpc", "traces", None, 200, peer=context.peer(), size=request.ByteSize())
        self._receiver._ingest_traces(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (grpc naming)
        self._receiver._record_request("grpc", "metrics", None, 200, peer=context.peer(), size=request.ByteSize())
        self._receiver._ingest_metrics(request, "grpc")
        return metrics_service_pb2.ExportMetricsServiceResponse()


# --------------------------------------------------------------------------
# OTLP/HTTP
# --------------------------------------------------------------------------

_HTTP_ROUTES = {
    "/v1/traces": (
        "traces",
        trace_service_pb2.ExportTraceServiceRequest,
        trace_service_pb2.ExportTraceServiceResponse,
    ),
    "/v1/metrics": (
        "metrics",
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
}

_MAX_BODY = 64 * 1024 * 1024
_JSON_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})


def _json_ids_to_base64(value: Any) -> Any:
    """OTLP/JSON carries trace/span ids as hex; protobuf's JSON mapping expects base64 for bytes."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in _JSON_ID_KEYS and isinstance(item, str):
                out[key] = base64.b64encode(bytes.fromhex(item)).decode("ascii")
            else:
                out[key] = _json_ids_to_base64(item)
        return out
    if isinstance(value, list):
        return [_json_ids_to_base64(v) for v in value]
    return value


def _make_handler(receiver: OTLPReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "otlp-test-receiver"

        def log_message(self, format, *args):  # silence stderr access log
            pass

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _fail(self, status: int, message: str, signal: str | None, encoding: str | None) -> None:
            receiver._record_request("http", signal, encoding, status, error=message)
            # Don't reuse a connection whose request we may not have fully read.
            self.close_connection = True
            self._reply(status, message.encode("utf-8"), "text/plain; charset=utf-8")

        def do_POST(self):  # noqa: N802 (http.server naming)
            path = self.path.split("?", 1)[0]
            encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
            route = _HTTP_ROUTES.get(path)
            signal = route[0] if route else None

            length_header = self.headers.get("Content-Length")
            if length_header is None:
                return self._fail(411, "Content-Length required", signal, encoding)
            try:
                length = int(length_header)
            except ValueError:
                return self._fail(400, f"bad Content-Length {length_header!r}", signal, encoding)
            if length < 0 or length > _MAX_BODY:
                return self._fail(413, f"body size {length} not accepted", signal, encoding)
            body = self.rfile.read(length)

            if route is None:
                return self._fail(404, f"no OTLP endpoint at {path!r}", signal, encoding)
            _, request_cls, response_cls = route

            content_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
            if content_type not in ("application/x-protobuf", "application/json"):
                return self._fail(
                    415,
                    f"unsupported Content-Type {content_type!r}; expected application/x-protobuf or application/json",
                    signal,
                    encoding,
                )

            try:
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                elif encoding != "identity":
                    return self._fail(415, f"unsupported Content-Encoding {encoding!r}", signal, encoding)
            except (OSError, EOFError, zlib.error) as exc:
                return self._fail(400, f"cannot decode {encoding} body: {exc}", signal, encoding)

            request = request_cls()
            try:
                if content_type == "application/json":
                    json_format.ParseDict(_json_ids_to_base64(json.loads(body)), request, ignore_unknown_fields=True)
                else:
                    request.ParseFromString(body)
            except (DecodeError, json_format.ParseError, ValueError, binascii.Error) as exc:
                return self._fail(400, f"malformed {content_type} body: {exc}", signal, encoding)

            receiver._record_request("http", signal, encoding, 200)
            if signal == "traces":
                receiver._ingest_traces(request, "http")
            else:
                receiver._ingest_metrics(request, "http")
            self._reply(200, response_cls().SerializeToString(), "application/x-protobuf")

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False


# --------------------------------------------------------------------------
# the receiver
# --------------------------------------------------------------------------


class OTLPReceiver:
    """Loopback OTLP receiver (gRPC + HTTP) that decodes spans and metric points.

    Use as a context manager; servers are started on ``__enter__`` and stopped
    on ``__exit__``. ``start()``/``stop()`` are available for fixtures.
    """

    def __init__(self, grpc_workers: int = 4) -> None:
        self._grpc_workers = grpc_workers
        # seconds each OTLP/gRPC trace export waits before it is answered: a slow collector
        self.trace_delay_s = 0.0
        self._cond = threading.Condition()
        self._spans: list[dict[str, Any]] = []
        self._metric_points: list[dict[str, Any]] = []
        self._latest_points: dict[tuple, dict[str, Any]] = {}
        self._requests: list[dict[str, Any]] = []
        self._grpc_server: grpc.Server | None = None
        self._grpc_port: int | None = None
        self._http_server: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------

    def __enter__(self) -> OTLPReceiver:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> OTLPReceiver:
        if self._grpc_server is not None:
            raise RuntimeError("OTLPReceiver already started")
        try:
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=self._grpc_workers, thread_name_prefix="otlp-rx-grpc"),
                options=[("grpc.so_reuseport", 0)],
            )
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), server)
            port = server.add_insecure_port(f"{_LOOPBACK}:0")
            if not port:
                raise RuntimeError("could not bind the OTLP gRPC receiver to a loopback port")
            server.start()
            self._grpc_server, self._grpc_port = server, port

            self._http_server = _HTTPServer((_LOOPBACK, 0), _make_handler(self))
            self._http_thread = threading.Thread(
                target=self._http_server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="otlp-rx-http",
                daemon=True,
            )
            self._http_thread.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        grpc_server, self._grpc_server = self._grpc_server, None
        http_server, self._http_server = self._http_server, None
        http_thread, self._http_thread = self._http_thread, None
        if grpc_server is not None:
            grpc_server.stop(grace=None).wait(timeout=5)
        if http_server is not None:
            if http_thread is not None and http_thread.is_alive():
                http_server.shutdown()
            http_server.server_close()
        if http_thread is not None:
            http_thread.join(timeout=5)

    # ---- endpoints -------------------------------------------------------

    def _require_running(self) -> None:
        if self._grpc_server is None or self._http_server is None:
            raise RuntimeError("OTLPReceiver is not running; use it as a context manager")

    @property
    def grpc_endpoint(self) -> str:
        self._require_running()
        return f"http://{_LOOPBACK}:{self._grpc_port}"

    @property
    def http_endpoint(self) -> str:
        self._require_running()
        return f"http://{_LOOPBACK}:{self._http_server.server_address[1]}"

    @property
    def http_traces_url(self) -> str:
        return f"{self.http_endpoint}/v1/traces"

    @property
    def http_metrics_url(self) -> str:
        return f"{self.http_endpoint}/v1/metrics"

    # ---- ingestion (called from server threads) ----------------------------

    def _record_request(
        self,
        transport: str,
        signal: str | None,
        encoding: str | None,
        status: int,
        error: str | None = None,
        peer: str | None = None,
        size: int | None = None,
    ) -> None:
        with self._cond:
            self._requests.append(
                {
                    "transport": transport,
                    "signal": signal,
                    "content_encoding": encoding,
                    "status": status,
                    "error": error,
                    "peer": peer,  # gRPC: the client's address ("ipv4:127.0.0.1:PORT"), one per channel
                    "size": size,  # gRPC: the decoded request's encoded size in bytes
                }
            )
            self._cond.notify_all()

    def _ingest_traces(self, request, transport: str) -> None:
        decoded = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(_decode_span(span, resource, scope_spans.scope, transport))
        with self._cond:
            self._spans.extend(decoded)
            self._cond.notify_all()

    def _ingest_metrics(self, request, transport: str) -> None:
        decoded = []
        for resource_metrics in request.resource_metrics:
            resource = _attributes(resource_metrics.resource.attributes)
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    decoded.extend(_decode_metric(metric, resource, scope_metrics.scope, transport))
        with self._cond:
            for point in decoded:
                self._metric_points.append(point)
                # one series per (resource, instrument, attributes), as a backend keeps them: two
                # processes (the session server and a test's own) never overwrite each other's point
                key = (point["name"], _freeze(point["attributes"]), _freeze(point["resource"]))
                # Re-insert so iteration order follows the most recent update.
                self._latest_points.pop(key, None)
                self._latest_points[key] = point
            self._cond.notify_all()

    # ---- spans -----------------------------------------------------------

    def _matching_spans(self, filters: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in self._spans if _matches(s, filters)]

    def spans(self, **filters: Any) -> list[dict[str, Any]]:
        """Received spans (arrival order) whose keys equal every given filter."""
        _check_filters(filters, SPAN_KEYS)
        with self._cond:
            return copy.deepcopy(self._matching_spans(filters))

    def wait_for_spans(self, n: int, timeout: float = 10.0, **filters: Any) -> list[dict[str, Any]]:
        """Block until at least ``n`` spans match ``filters``; return all that match.

        Raises ``TimeoutError`` listing every span that did arrive.
        """
        _check_filters(filters, SPAN_KEYS)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._matching_spans(filters)
                if len(found) >= n:
                    return copy.deepcopy(found)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    arrived = "\n".join(f"  - {_describe_span(s)}" for s in self._spans) or "  (none)"
                    raise TimeoutError(
                        f"waited {timeout}s for {n} span(s) matching {filters or '{}'}, "
                        f"got {len(found)}; {len(self._spans)} span(s) arrived in total:\n{arrived}"
                    )
                self._cond.wait(remaining)

    def children(self, span: dict[str, Any]) -> list[dict[str, Any]]:
        """Direct children of ``span`` received so far, ordered by start time."""
        with self._cond:
            kids = [
                s for s in self._spans if s["trace_id"] == span["trace_id"] and s["parent_span_id"] == span["span_id"]
            ]
            return copy.deepcopy(sorted(kids, key=lambda s: s["start_ns"]))

    def tree(self, trace_id: str) -> list[dict[str, Any]]:
        """Spans of one trace as nested ``{"span": ..., "children": [...]}`` nodes.

        Returns the list of root nodes: spans without a parent, or whose parent
        was not received (e.g. a remote parent). Siblings are ordered by start time.
        """
        with self._cond:
            spans = copy.deepcopy([s for s in self._spans if s["trace_id"] == trace_id])
        by_parent: dict[str, list[dict[str, Any]]] = {}
        for s in spans:
            by_parent.setdefault(s["parent_span_id"], []).append(s)
        known = {s["span_id"] for s in spans}

        def build(span: dict[str, Any], seen: frozenset) -> dict[str, Any]:
            kids = sorted(by_parent.get(span["span_id"], []), key=lambda s: s["start_ns"])
            seen = seen | {span["span_id"]}
            return {
                "span": span,
                "children": [build(k, seen) for k in kids if k["span_id"] not in seen],
            }

        roots = sorted(
            (s for s in spans if not s["parent_span_id"] or s["parent_span_id"] not in known),
            key=lambda s: s["start_ns"],
        )
        return [build(r, frozenset()) for r in roots]

    # ---- metrics ---------------------------------------------------------

    def metrics(
        self, name: str | None = None, *, latest: bool = True, resource: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """Decoded metric data points.

        With ``latest=True`` (default) only the most recent point per series
        ``(name, attributes, resource attributes)``; with ``latest=False`` every point
        ever received, in arrival order. ``name`` restricts to one instrument;
        ``resource`` to points whose resource has each of the given attributes
        with the given value (e.g. the ``service.name`` or ``process.pid`` a test
        set), since other processes - the session's servers - export here too.
        """
        with self._cond:
            source = self._latest_points.values() if latest else self._metric_points
            return copy.deepcopy(
                [p for p in source if (name is None or p["name"] == name) and _has_resource(p, resource)]
            )

    def wait_for_metric(
        self,
        name: str,
        timeout: float = 10.0,
        *,
        predicate: Callable[[dict[str, Any]], bool] | None = None,
        resource: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Block until a point for ``name`` (from a ``resource`` as in :meth:`metrics`,
        satisfying ``predicate``) has arrived.

        Returns the latest points (one per series) for ``name`` that match.
        Raises ``TimeoutError`` listing the metric names that did arrive.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [
                    p
                    for p in self._latest_points.values()
                    if p["name"] == name and _has_resource(p, resource) and (predicate is None or predicate(p))
                ]
                if found:
                    return copy.deepcopy(found)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    arrived = sorted({(p["name"], p["kind"]) for p in self._metric_points})
                    listing = ", ".join(f"{n} ({k})" for n, k in arrived) or "(none)"
                    same_name = [p for p in self._latest_points.values() if p["name"] == name]
                    detail = f"; latest points for {name!r}: {same_name}" if same_name else ""
                    raise TimeoutError(
                        f"waited {timeout}s for metric {name!r}"
                        f"{f' from resource {resource}' if resource else ''}"
                        f"{' matching predicate' if predicate else ''}; "
                        f"metrics that arrived: {listing}{detail}"
                    )
                self._cond.wait(remaining)

    # ---- misc ------------------------------------------------------------

    def requests(self) -> list[dict[str, Any]]:
        """Log of export requests: transport, signal, content_encoding, status, error, peer, size."""
        with self._cond:
            return copy.deepcopy(self._requests)

    def clear(self) -> None:
        """Forget every span, metric point and request received so far."""
        with self._cond:
            self._spans.clear()
            self._metric_points.clear()
            self._latest_points.clear()
            self._requests.clear()
