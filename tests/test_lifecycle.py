"""Process lifecycle without an engine: the final flush at exit (bounded by the flush deadline,
whatever the collector does), export requests a collector accepts, and applications that fork
after ``instrument()``. Real OTLP over gRPC to the test receiver; each scenario runs in its own
Python process, because exit and fork are what is tested."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import record_received

from llm_otel.config import Settings
from llm_otel.export.exporters import ProcessSpanExporter, estimate_span_bytes
from llm_otel.export.offload import request_outlets
from llm_otel.process.providers import build_providers
from llm_otel.telemetry import Telemetry


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(
        OTEL_SERVICE_NAME="lifecycle-test",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        # nothing leaves the process before exit except through the final flush
        OTEL_BSP_SCHEDULE_DELAY="60000",
        OTEL_METRIC_EXPORT_INTERVAL="60000",
    )
    env.update(extra)
    return env


def _run(script: str, env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``script``; returns the result and the seconds from its ``exiting`` line to its exit."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    exiting_at = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "exiting":
            exiting_at = time.monotonic()
    proc.wait(timeout=timeout)
    stderr = proc.stderr.read()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, "".join(lines), stderr)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{result.stdout}\n{stderr[-3000:]}"
    return result, time.monotonic() - (exiting_at or start)


APP = """
    import llm_otel
    from opentelemetry import metrics, trace
    llm_otel.instrument(engines=[])
    trace.get_tracer("app").start_span("app-work", attributes={"n": 1}).end()
    metrics.get_meter("app").create_counter("app.things").add(3)
    print("exiting", flush=True)
"""


def test_final_flush_delivers_spans_and_metrics_at_interpreter_exit(receiver):
    receiver.clear()
    _run(APP, _child_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint))
    (span,) = receiver.wait_for_spans(1, name="app-work", timeout=10)
    assert span["resource"]["service.name"] == "lifecycle-test"
    (point,) = receiver.wait_for_metric("app.things", timeout=10)
    assert point["value"] == 3


class _BlackHole:
    """A TCP server that accepts connections and never answers (a hung collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("collector", ["closed port", "accepts and never answers"])
@pytest.mark.case("C18")
def test_exit_with_an_unreachable_collector_is_bounded_by_the_flush_deadline(collector):
    hole = _BlackHole() if collector != "closed port" else None
    port = hole.port if hole else _closed_port()
    try:
        result, exit_s = _run(
            APP, _child_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", LLM_OTEL_FLUSH_DEADLINE_S="1")
        )
    finally:
        if hole:
            hole.close()
    # the OTLP exporter's own timeout is 10 s per signal and it retries: unbounded, exit takes >= 10 s
    assert exit_s < 1 + 4, f"exit took {exit_s:.1f} s with LLM_OTEL_FLUSH_DEADLINE_S=1\n{result.stderr[-2000:]}"
    warnings = [line for line in result.stderr.splitlines() if "final flush" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert "application process" in warnings[0] and "not delivered" in warnings[0]
    assert "1 span(s)" in warnings[0] and f"127.0.0.1:{port}" in warnings[0]


def _long_prompt(n_chars: int, seed: int) -> str:
    # quotes, backslashes and non-ASCII: what JSON escaping and byte counting must get right
    unit = f'req {seed}: "quoted" \\ back-slashed, naïve ünïcode — '
    return (unit * (n_chars // len(unit) + 1))[:n_chars]


@pytest.mark.case("C17")
def test_export_requests_stay_under_the_cap_and_captured_messages_stay_valid_json(receiver):
    receiver.clear()
    settings = Settings(capture_content=True, content_max_chars=10_000_000, console="off", adaptive_sampling="off")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_METRICS_EXPORTER": "none"}
    tp, mp = build_providers(settings, env=env, shutdown_on_exit=False)
    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
    sizes = {f"long-{i}": 400_000 for i in range(12)}  # 12 x 400 kB: one batch of ~5 MB
    sizes["huge"] = 5_000_000  # alone over the 4 MiB a gRPC server accepts
    for rid, n in sizes.items():
        rec = telemetry.start_request(
            rid,
            operation="text_completion",
            provider="vllm",
            model="m",
            arrival_s=time.time(),
            input_tokens=3,
            prompt_text=_long_prompt(n, len(rid)),
        )
        telemetry.finish(rec)
    assert tp.force_flush(30_000)
    spans = receiver.wait_for_spans(len(sizes), name="text_completion m", timeout=30)
    record_received(spans)
    assert len(spans) == len(sizes)
    for span in spans:
        messages = json.loads(span["attributes"]["gen_ai.input.messages"])  # valid JSON, always
        assert messages[0]["role"] == "user" and messages[0]["parts"][0]["type"] == "text"
    lengths = sorted(len(json.loads(s["attributes"]["gen_ai.input.messages"])[0]["parts"][0]["content"]) for s in spans)
    assert lengths[:-1] == [400_000] * 12, "spans under the cap are exported whole"
    # shortened to fit the 3 MiB cap (the JSON escapes \u00ef etc. take about 1.5 bytes per character
    # here), not dropped and not cut further than needed
    assert 1_500_000 < lengths[-1] < 3 * 1024 * 1024, "the huge prompt is shortened to fit, not dropped"
    grpc_traces = [r for r in receiver.requests() if r["signal"] == "traces" and r["transport"] == "grpc"]
    assert len(grpc_traces) >= 3 and all(r["size"] <= 3 * 1024 * 1024 for r in grpc_traces)
    tp.shutdown()
    mp.shutdown()


def test_size_estimate_is_an_upper_bound_of_the_encoded_span():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider

    tp = TracerProvider()
    tracer = tp.get_tracer("t")
    span = tracer.start_span(
        "s", attributes={"a": "x" * 1000, "b": 7, "c": [1.5, 2.5], "d": "ünï" * 50, "e": ("p", "q")}
    )
    span.add_event("ev", {"k": "v" * 100})
    span.end()
    assert estimate_span_bytes(span) >= encode_spans([span]).ByteSize()


def test_exporter_wrapper_splits_batches_and_never_raises():
    calls = []

    class Inner:
        def export(self, spans):
            calls.append(len(spans))
            if len(calls) == 2:
                raise RuntimeError("boom")
            from opentelemetry.sdk.trace.export import SpanExportResult

            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

        def force_flush(self, timeout_millis=0):
            return True

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    tracer = TracerProvider().get_tracer("t")
    spans = []
    for i in range(10):
        s = tracer.start_span(f"s{i}", attributes={"blob": "y" * 30_000})
        s.end()
        spans.append(s)
    exporter = ProcessSpanExporter(Inner, max_request_bytes=100_000)
    assert exporter.export(spans) is SpanExportResult.FAILURE  # the second chunk's exporter raised
    assert sum(calls) == 10 and len(calls) >= 3
    assert exporter.failed == calls[1] and exporter.in_flight == 0
    assert "RuntimeError: boom" in exporter.last_error


FORK_APP = """
    import os, sys, threading, time
    import llm_otel
    from opentelemetry import trace
    from llm_otel.export.providers import SystemRandomIdGenerator
    from llm_otel.gpu.nvml import UtilizationPoller

    llm_otel.instrument(engines=[])
    tracer = trace.get_tracer("app")
    tracer.start_span("parent-before-fork").end()
    trace.get_tracer_provider().force_flush()  # the parent's channel is connected and in use

    class Source:
        thread_name = "llm-otel-test-poller"
        def read(self):
            return 0.5
    poller = UtilizationPoller(Source(), period_s=0.02).start()
    ids = SystemRandomIdGenerator()

    pid = os.fork()
    if pid == 0:
        with tracer.start_as_current_span("child-work", attributes={"child.pid": os.getpid()}):
            pass
        time.sleep(0.3)
        alive = any(t.name == "llm-otel-test-poller" and t.is_alive() for t in threading.enumerate())
        print("child-poller", alive, poller.utilization is not None, flush=True)
        print("child-ids", ",".join(str(ids.generate_span_id()) for _ in range(200)), flush=True)
        print("exiting", flush=True)
        sys.stdout.flush()
        sys.exit(0)  # atexit: the lifecycle flushes the child's own providers
    _, status = os.waitpid(pid, 0)
    print("child-status", status, flush=True)
    print("parent-ids", ",".join(str(ids.generate_span_id()) for _ in range(200)), flush=True)
    tracer.start_span("parent-after-fork").end()
"""


@pytest.mark.case("C20")
def test_forked_application_child_exports_through_its_own_channel(receiver):
    receiver.clear()
    result, _ = _run(
        FORK_APP, _child_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    )
    out = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert out["child-status"].strip() == "0"
    assert out["child-poller"].split() == ["True", "True"], "the poller thread runs in the child"
    assert not set(out["child-ids"].split(",")) & set(out["parent-ids"].split(",")), "ids never repeat"
    (child,) = receiver.wait_for_spans(1, name="child-work", timeout=15)
    receiver.wait_for_spans(1, name="parent-after-fork", timeout=15)
    assert child["attributes"]["child.pid"] != os.getpid()
    peers = {r["peer"] for r in receiver.requests() if r["signal"] == "traces"}
    assert len(peers) >= 2, f"the child must export over its own connection, saw {peers}"


def test_a_process_that_may_be_killed_at_its_deadline_reports_before_it(tmp_path, monkeypatch, caplog):
    """vLLM kills its engine processes soon after SIGTERM: once shutdown began, a process whose
    collector does not answer says what it could not deliver at its deadline (not only at its
    final flush, which it may never reach), and marks itself done for the process waiting on it."""
    import logging

    from llm_otel.process.lifecycle import FLUSH_DIR_ENV, ProcessLifecycle

    hole = _BlackHole()
    monkeypatch.setenv(FLUSH_DIR_ENV, str(tmp_path))
    try:
        settings = Settings(console="off", adaptive_sampling="off")
        tp, mp = build_providers(
            settings,
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.port}", "OTEL_METRICS_EXPORTER": "none"},
            shutdown_on_exit=False,
        )
        life = ProcessLifecycle("engine_core", deadline_s=0.5)
        from llm_otel.process.providers import exporters_of

        life.add(tp, mp, exporters_of(tp))
        tp.get_tracer("t").start_span("last-step").end()
        caplog.set_level(logging.WARNING, logger="llm_otel")
        life.begin()
        marker = tmp_path / f"{os.getpid()}.flushed"
        deadline = time.monotonic() + 5
        while not marker.exists():
            assert time.monotonic() < deadline, "never marked itself done"
            time.sleep(0.05)
        ours = [r.getMessage() for r in caplog.records if "final flush" in r.getMessage()]
        assert len(ours) == 1 and "engine_core process" in ours[0] and "1 span(s)" in ours[0], ours
        life.flush()  # the exit path afterwards says nothing more
        assert len([r for r in caplog.records if "final flush" in r.getMessage()]) == 1
    finally:
        hole.close()


def test_a_large_prompt_and_completion_are_both_shortened_and_keep_their_structure():
    from opentelemetry.sdk.trace import TracerProvider

    from llm_otel.export.exporters import shrink_span
    from llm_otel.semconv import attributes as A

    tracer = TracerProvider().get_tracer("t")
    prompt = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "p" * 5_000_000}]}])
    completion = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "c" * 3_000_000}]}])
    span = tracer.start_span("s", attributes={A.GEN_AI_INPUT_MESSAGES: prompt, A.GEN_AI_OUTPUT_MESSAGES: completion})
    span.end()
    small = shrink_span(span, 3 * 1024 * 1024)
    assert estimate_span_bytes(small) <= 3 * 1024 * 1024
    inp = json.loads(small.attributes[A.GEN_AI_INPUT_MESSAGES])
    out = json.loads(small.attributes[A.GEN_AI_OUTPUT_MESSAGES])
    assert inp[0]["role"] == "user" and out[0]["role"] == "assistant"
    kept_in, kept_out = len(inp[0]["parts"][0]["content"]), len(out[0]["parts"][0]["content"])
    assert kept_in > 1_000_000 and kept_out > 600_000  # both keep a share, in proportion
    assert abs(kept_in / 5_000_000 - kept_out / 3_000_000) < 0.05


def test_flush_directory_is_never_taken_from_a_users_variable(tmp_path, monkeypatch):
    from llm_otel.process import lifecycle as L

    monkeypatch.setenv(L.FLUSH_DIR_ENV, str(tmp_path))  # not one llm-otel made
    monkeypatch.setattr(L, "_owned_dir", None)
    made = L.create_flush_dir()
    try:
        assert made != str(tmp_path) and os.path.basename(made).startswith("llm-otel-flush-")
        assert os.environ[L.FLUSH_DIR_ENV] == made and L.create_flush_dir() == made
    finally:
        os.rmdir(made)
