"""Shared fixtures: in-memory telemetry, the OTLP receiver, one real vLLM engine per session, and
the live semantic-conventions check over every span llm-otel emits in the session."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# tests/ on the path: the support package (tests/support), contracts/ and the layout trees
sys.path.insert(0, os.path.dirname(__file__))

from support.otlp_receiver import OTLPReceiver  # noqa: E402
from support.semconv_live import SpanLog, check  # noqa: E402
from support.vllm_env import EXACT, HAS_VLLM, VLLM_ENV, wait_for_vllm_server  # noqa: E402, F401 (tests import them from here)

from llm_otel.config import Settings  # noqa: E402
from llm_otel.export.providers import SystemRandomIdGenerator  # noqa: E402
from llm_otel.telemetry import Telemetry  # noqa: E402

# --- live semconv check ------------------------------------------------------------------------
SPAN_LOG = SpanLog()
_original_on_end = SynchronousMultiSpanProcessor.on_end


def _recording_on_end(self, span):
    try:
        scope = span.instrumentation_scope.name if span.instrumentation_scope else ""
        SPAN_LOG.add(
            scope, span.name, dict(span.attributes or {}), [(e.name, dict(e.attributes or {})) for e in span.events]
        )
    except Exception as exc:  # noqa: BLE001  # pragma: no cover - the check must never hide a test's own result
        print(f"semconv live check could not record a span: {exc}", file=sys.stderr)
    return _original_on_end(self, span)


SynchronousMultiSpanProcessor.on_end = _recording_on_end


def record_received(spans: list[dict]) -> None:
    """Feed spans decoded by the OTLP receiver (other processes) into the live check."""
    for s in spans:
        SPAN_LOG.add(s["scope_name"], s["name"], s["attributes"], [(e["name"], e["attributes"]) for e in s["events"]])


def pytest_collection_modifyitems(config, items):
    """Tests marked ``last_in_module`` end something their module's fixture shares (the fleet's
    collector): they run after the module's other tests, whatever order pytest-randomly chose (it
    shuffles in a wrapper before this hook; modules stay contiguous)."""
    reordered: list = []
    group: list = []
    for item in [*items, None]:
        if group and (item is None or getattr(item, "module", None) is not getattr(group[0], "module", None)):
            reordered += [i for i in group if i.get_closest_marker("last_in_module") is None]
            reordered += [i for i in group if i.get_closest_marker("last_in_module") is not None]
            group = []
        if item is not None:
            group.append(item)
    items[:] = reordered


def pytest_sessionfinish(session, exitstatus):
    from llm_otel._semconv_registry import load_registry

    problems = check(SPAN_LOG, load_registry())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    write(
        f"semconv live check: {SPAN_LOG.count} llm-otel spans emitted, {len(SPAN_LOG.seen)} distinct shapes, "
        f"{len(problems)} problem(s)"
    )
    for p in problems:
        write(f"semconv live check FAILED: {p}")
    if problems:
        session.exitstatus = 1
    seed = session.config.getoption("randomly_seed", None)  # pytest-randomly (a test dependency)
    if seed is not None and session.config.getoption("randomly_reorganize", True):
        write(f"test order: random, seed {seed} (the same order again: --randomly-seed={seed})")


# --- in-memory telemetry -----------------------------------------------------------------------
@dataclasses.dataclass
class Captured:
    telemetry: Telemetry
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader

    def finished(self):
        return list(self.spans.get_finished_spans())

    def metric_points(self, name: str) -> list:
        data = self.metrics.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        out.extend(m.data.data_points)
        return out


def make_captured(settings: Settings | None = None, sampler=None) -> Captured:
    exporter = InMemorySpanExporter()
    kwargs = {"sampler": sampler} if sampler is not None else {}
    tp = TracerProvider(id_generator=SystemRandomIdGenerator(), **kwargs)
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(tp, mp, settings or Settings.from_env(EXACT))
    return Captured(telemetry, tp, mp, exporter, reader)


@pytest.fixture
def captured() -> Captured:
    return make_captured()


# --- OTLP receiver -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def receiver():
    with OTLPReceiver() as rx:
        yield rx
        record_received(rx.spans())


# --- the real vLLM engine ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model():
    from llm_otel.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@dataclasses.dataclass
class Engine:
    llm: object
    captured: Captured
    instrumentor: object
    receiver: OTLPReceiver
    model: str

    def clear(self) -> None:
        self.captured.spans.clear()
        self.receiver.clear()


ENGINE_PROCESS_ENV = {
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
    "OTEL_SERVICE_NAME": "llm-otel-tests",
}


@contextlib.contextmanager
def environ(**values):
    """Temporarily set environment variables (vLLM's spawned processes inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def engine(tiny_model, receiver):
    """One vLLM offline engine (vLLM defaults: disable_log_stats=True) for the whole session.

    The frontend exports into in-memory exporters and, over both OTLP transports, into
    ``receiver``; the engine-core and worker processes (instrumented by the vllm.general_plugins
    entry point) export to ``receiver`` over gRPC from the OTEL_* environment they inherit."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm]')")
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    from llm_otel.instrumentation.vllm import VLLMInstrumentor

    cap = make_captured()
    cap.tracer_provider.add_span_processor(
        BatchSpanProcessor(GrpcExporter(endpoint=receiver.grpc_endpoint, insecure=True))
    )
    cap.tracer_provider.add_span_processor(BatchSpanProcessor(HttpExporter(endpoint=receiver.http_traces_url)))
    inst = VLLMInstrumentor()
    inst.instrument(
        tracer_provider=cap.tracer_provider, meter_provider=cap.meter_provider, settings=Settings(logit_dist_ratio=1.0)
    )
    from vllm import LLM

    with environ(LLM_OTEL_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, **ENGINE_PROCESS_ENV):
        llm = LLM(
            model=str(tiny_model), dtype="float32", max_model_len=512, seed=0, block_size=32, enable_prefix_caching=True
        )
    yield Engine(llm, cap, inst, receiver, str(tiny_model))
    cap.tracer_provider.force_flush()
    inst.uninstrument()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    cap.tracer_provider.shutdown()
    cap.meter_provider.shutdown()


# --- the real OpenAI server --------------------------------------------------------------------
OPENAI_SERVED = "tiny"  # --served-model-name of the session's OpenAI server


@pytest.fixture(scope="session")
def openai_server(tiny_model, receiver, tmp_path_factory):
    """The real vLLM OpenAI server (frontend, engine-core and worker processes), started once per
    session zero-code with ``opentelemetry-instrument``, exporting spans and metrics (every second)
    to the session's OTLP receiver as service ``vllm-server-test``; request classes from the
    ``x-tenant-id`` / ``x-priority`` headers, a ``premium`` tier for tenant ``acme``, and the
    in-process ``/healthz``. Used by tests/test_vllm_server.py and tests/test_vllm_refusals.py."""
    from support.vllm_servers import free_port, start_server

    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install -e '.[vllm]')")
    health_port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        OTEL_SERVICE_NAME="vllm-server-test",
        LLM_OTEL_LOGIT_DIST_RATIO="1",
        VLLM_LOGGING_LEVEL="INFO",
        # serving signals (test_signals_from_http_headers_and_in_process_healthz)
        LLM_OTEL_CLASS_HEADERS="tenant:x-tenant-id,priority:x-priority",
        LLM_OTEL_TIERS="premium tenant=acme ttft=60",
        LLM_OTEL_MODEL_REVISION="stable",
        LLM_OTEL_HEALTH_PORT=str(health_port),
        LLM_OTEL_HEALTH_WARMUP_S="0",
    )
    server = start_server(
        tiny_model,
        log_path,
        env,
        served=OPENAI_SERVED,
        args=("--max-model-len", "2048", "--max-logprobs", "20"),
        enforce_eager=False,
    )
    yield {"base": server.base, "proc": server.proc, "log": log_path, "health_port": health_port}
    server.stop()


# ngram speculative decoding as the engine tests turn it on: drafts of up to 3 tokens looked up in
# the request's own tokens (repetitive prompts get drafts proposed, some accepted, some rejected)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="session")
def spec_engine(engine, tiny_model):
    """A second offline vLLM engine, with ngram speculative decoding (:data:`SPEC_CONFIG`) and
    vLLM's own statistics on (``disable_log_stats=False``: ``LLM.get_metrics()`` gives the
    ``vllm:spec_decode_*`` counters to compare with), started once per session (about 60 s here).

    It shares the session ``engine``'s instrumentor and exporters: the frontend hooks are on
    vLLM's classes, so they serve any ``LLM`` in this process; its engine-core and worker processes
    are instrumented by the plugin from the environment set here, like the session engine's."""
    from vllm import LLM

    with environ(LLM_OTEL_ENABLED="1", OTEL_EXPORTER_OTLP_ENDPOINT=engine.receiver.grpc_endpoint, **ENGINE_PROCESS_ENV):
        llm = LLM(
            model=str(tiny_model),
            dtype="float32",
            max_model_len=512,
            seed=0,
            block_size=32,
            speculative_config=dict(SPEC_CONFIG),
            disable_log_stats=False,
        )
    yield Engine(llm, engine.captured, engine.instrumentor, engine.receiver, str(tiny_model))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


@pytest.fixture(autouse=True)
def _no_inherited_configuration_refusal(monkeypatch):
    """A test that makes llm-otel refuse an invalid setting in this process sets
    ``LLM_OTEL_CONFIG_REFUSED`` for the children it would start; it must not silence the next
    test's ERROR line (monkeypatch puts the variable back as it was after each test)."""
    monkeypatch.delenv("LLM_OTEL_CONFIG_REFUSED", raising=False)
    yield


@pytest.fixture(autouse=True)
def _errors_log_once_per_test():
    """llm-otel logs each failure site once per process (llm_otel.errors); tests that look for a
    site's one line must see it whichever test failed that site first."""
    from llm_otel.errors import _reset_for_tests

    _reset_for_tests()
    yield
