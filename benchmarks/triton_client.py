"""Client-side cost of the Triton client instrumentation against a real tritonserver.

Runs the same sequence of gRPC ``infer`` calls and one streamed request per round against the
tests' tritonserver (tests/support/triton_server.py, needs .venv-triton), without and with
TritonClientInstrumentor (spans into an in-memory exporter), and prints the median wall time per
call. Server tracing is pointed at a closed port so it costs the same in both runs.

    .venv/bin/python benchmarks/triton_client.py [calls]
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
from support import triton_server  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from llm_otel.instrumentation.triton import TritonClientInstrumentor  # noqa: E402


def inputs():
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    return [t]


def run(url: str, calls: int) -> list[float]:
    client = grpcclient.InferenceServerClient(url)
    client.infer("text_echo", inputs())  # connect
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        client.infer("text_echo", inputs(), request_id=str(i))
        out.append(time.perf_counter() - t0)
    client.close()
    return out


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with tempfile.TemporaryDirectory() as tmp:
        server = triton_server.start(pathlib.Path(tmp), "http://127.0.0.1:9/v1/traces")
        try:
            bare = run(server.grpc_url, calls)
            exporter = InMemorySpanExporter()
            tp = TracerProvider()
            tp.add_span_processor(SimpleSpanProcessor(exporter))
            inst = TritonClientInstrumentor()
            inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]))
            traced = run(server.grpc_url, calls)
            inst.uninstrument()
            bare2 = run(server.grpc_url, calls)
        finally:
            server.stop()
    b = statistics.median(bare + bare2) * 1e3
    t = statistics.median(traced) * 1e3
    print(f"grpc infer, {calls} calls each: median bare {b:.3f} ms, instrumented {t:.3f} ms, "
          f"difference {t - b:+.3f} ms per call ({len(exporter.get_finished_spans())} spans)")


if __name__ == "__main__":
    main()
