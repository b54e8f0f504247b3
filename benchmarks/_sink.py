"""A counting OTLP sink for the overhead benchmark: gRPC and HTTP on loopback, run as its own process.

It accepts trace, metric and log exports, counts requests, bytes and spans, and answers at once, so
every traced configuration pays the same (small) export cost into the same receiver. Spans are
counted by parsing the protobuf request (``opentelemetry-proto``); nothing is kept.

    python benchmarks/_sink.py   # prints one JSON line {"grpc": "http://127.0.0.1:P", "http": ...},
                                 # then a JSON line of counts whenever a line arrives on stdin
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

_lock = threading.Lock()
counts = {"requests": 0, "bytes": 0, "spans": 0, "span_names": {}}


def _count(body: bytes, kind: str) -> None:
    spans = 0
    names: dict[str, int] = {}
    if kind == "traces":
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans += 1
                    names[span.name.split(" ")[0]] = names.get(span.name.split(" ")[0], 0) + 1
    with _lock:
        counts["requests"] += 1
        counts["bytes"] += len(body)
        counts["spans"] += spans
        for k, v in names.items():
            counts["span_names"][k] = counts["span_names"].get(k, 0) + v


_SERVICES = {
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export":
        ("traces", trace_service_pb2.ExportTraceServiceResponse),
    "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export":
        ("metrics", metrics_service_pb2.ExportMetricsServiceResponse),
    "/opentelemetry.proto.collector.logs.v1.LogsService/Export":
        ("logs", logs_service_pb2.ExportLogsServiceResponse),
}


class _Generic(grpc.GenericRpcHandler):
    def service(self, handler_call_details):
        entry = _SERVICES.get(handler_call_details.method)
        if entry is None:
            return None
        kind, response = entry

        def handle(body: bytes, context) -> bytes:
            _count(body, kind)
            return response().SerializeToString()

        return grpc.unary_unary_rpc_method_handler(handle)  # raw bytes in and out


class _Http(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind = self.path.rstrip("/").rsplit("/", 1)[-1]
        if kind == "traces" and "json" not in (self.headers.get("Content-Type") or ""):
            _count(body, "traces")
        else:
            _count(body, "other")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_Generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Http)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    print(json.dumps({"grpc": f"http://127.0.0.1:{port}", "http": f"http://127.0.0.1:{http.server_port}"}),
          flush=True)
    for _ in sys.stdin:
        with _lock:
            print(json.dumps(counts), flush=True)
    server.stop(None)
    http.shutdown()


if __name__ == "__main__":
    main()
