"""Under ``opentelemetry-instrument`` every installed instrumentor runs in every process: a process
that imports none of vLLM, tritonclient or LightLLM gets nothing from llm-otel (no providers, no
import of vLLM and torch), and an application's own provider set before it imports an engine is the
one used. Both failed before: the vLLM instrumentor took any non-engine process for a ``frontend``,
built global providers and imported vLLM to apply its hooks (fresh-eyes review of the issue 19 F2
fix; vLLM's resource tracker grew from 65 to 650 MB RSS). Real ``opentelemetry-instrument``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_instrumented(code: str, **env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", OTEL_METRICS_EXPORTER="none",
               DEAD_PORT=str(_closed_port()), **env_extra)
    done = subprocess.run([INSTRUMENT, sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_opentelemetry_instrument_gives_a_program_that_imports_no_engine_no_providers_and_no_vllm_import():
    """A Python program that never imports vLLM, tritonclient or LightLLM, run with
    ``opentelemetry-instrument`` where llm-otel[vllm] is installed, must get no global providers
    from llm-otel (docs/architecture.md: global providers are built by "the vLLM instrumentor in
    vLLM's frontend", Triton/LightLLM "at the first import of a module they hook") and must not be
    made to import vLLM and torch (~600 MB RSS and seconds of start-up per process). Today the vLLM
    instrumentor classifies any non-engine process as ``frontend``: ensure_providers at
    instrument() and apply_hooks imports vllm."""
    pytest.importorskip("vllm")
    out = _run_instrumented("""
        import sys
        from opentelemetry import trace
        print("RESULT", type(trace.get_tracer_provider()).__name__, "vllm" in sys.modules, "torch" in sys.modules)
    """)
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT ProxyTracerProvider False False"], out[-3000:]


def test_triton_spans_go_to_the_tracer_provider_the_application_sets_after_opentelemetry_instrument():
    """The application sets its own global TracerProvider after ``opentelemetry-instrument`` ran the
    instrumentors and before it imports tritonclient: the Triton client span must be recorded by the
    application's provider (98fcfee: providers are built at the first tritonclient import, and
    ensure_providers leaves the application's alone). With vLLM installed the vLLM instrumentor has
    already set llm-otel's OffloadTracerProvider at instrument(): the SDK logs "Overriding of current
    TracerProvider is not allowed" and the application's provider records nothing. (Passes with
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm``.)"""
    pytest.importorskip("tritonclient.http")
    out = _run_instrumented("""
        import os
        import numpy as np
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        mem = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(mem))
        trace.set_tracer_provider(tp)
        import tritonclient.http as httpclient
        client = httpclient.InferenceServerClient(f"127.0.0.1:{os.environ['DEAD_PORT']}")
        inp = httpclient.InferInput("TEXT", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"hi"], dtype=object))
        try:
            client.infer("m", [inp], request_id="r1")
        except Exception:
            pass  # nothing listens on DEAD_PORT: the span ends with an error
        print("RESULT", trace.get_tracer_provider() is tp, [s.name for s in mem.get_finished_spans()])
    """)
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT True ['infer m']"], out[-3000:]
