"""Spans exported by an exporter process (``LLM_OTEL_EXPORT_PROCESS``, :mod:`llm_otel.export.offload`).

Real components: the exporter process (``python -m llm_otel.export.offload``) exports over
OTLP/gRPC to the real in-process receiver (tests/support/otlp_receiver.py); the same requests through the
SDK's in-process path must arrive as the same spans, ids included.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llm_otel.config import Settings
from llm_otel.export.offload import BACKLOG, DOWN, OffloadTracerProvider, RemoteInstrument, request_outlets
from llm_otel.export.providers import span_exporter_from_env
from llm_otel.process.providers import build_providers
from llm_otel.sampling import UtilizationPolicy, adaptive_sampler
from llm_otel.semconv import metrics as M
from llm_otel.telemetry import Telemetry


class SeededIds(IdGenerator):
    """The same id sequence for both paths (they make the same calls in the same order)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.trace_ids: set[str] = set()  # hex, as the receiver reports them

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        value = self._rng.getrandbits(128) or 1
        self.trace_ids.add(f"{value:032x}")
        return value


def _env(receiver, **extra) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRICS_EXPORTER": "none",
        **extra,
    }


def _requests(telemetry: Telemetry, tracer, tag: str) -> None:
    """Fixed-time requests: plain, with a remote parent carrying tracestate, failed, and a span
    with a link and an exception (what other processes and the adaptive sampler make of it)."""
    base = 1_700_000_000.0
    parent = TraceContextTextMapPropagator().extract(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "ot=th:0;rv:ffffffffffffff,vendor=x",
        }
    )
    for i, ctx in enumerate((None, parent, None)):
        arrival = base + i
        rec = telemetry.start_request(
            f"{tag}-{i}",
            operation="text_completion",
            provider="vllm",
            model="m",
            arrival_s=arrival,
            input_tokens=7,
            parent=ctx,
            engine_version="0.0",
        )
        mono0 = 1000.0 + i
        rec.mono_offset_ns = round((arrival - mono0) * 1e9)
        rec.on_event("queued", mono0 + 0.001)
        rec.on_event("scheduled", mono0 + 0.002)
        for k in range(12):
            rec.on_tokens([k], mono0 + 0.01 + k * 0.003 + (0.05 if k == 9 else 0.0))
        rec.finish_reason = "length"
        if i == 2:
            rec.error_type, rec.error_message = "EngineError", "boom"
        telemetry.finish(rec, end_ns=round((arrival + 0.2) * 1e9))
    root = tracer.start_span(
        "linked",
        start_time=round(base * 1e9),
        attributes={"a": [1, 2], "b": "x"},
        links=[trace.Link(trace.get_current_span(parent).get_span_context(), {"why": "t"})],
    )
    root.record_exception(ValueError("bad"), timestamp=round((base + 0.1) * 1e9))
    root.set_status(trace.StatusCode.ERROR, "bad")
    root.end(end_time=round((base + 0.3) * 1e9))


def _comparable(span: dict) -> dict:
    out = {k: v for k, v in span.items() if k != "transport"}
    for ev in out["events"]:
        ev["attributes"].pop("exception.stacktrace", None)  # frames differ between the two calls
    return out


def test_span_trees_are_identical_to_the_in_process_path(receiver):
    settings = Settings(console="off", adaptive_sampling="off")
    policy = UtilizationPolicy(floor=0.5, ceiling=0.5)  # ot=th on every kept trace, same decisions

    def run(offload: bool) -> list[dict]:
        receiver.clear()
        env = _env(receiver)
        ids = SeededIds(7)
        sdk = TracerProvider(sampler=adaptive_sampler(policy), id_generator=ids, resource=None)
        if offload:
            tp = OffloadTracerProvider(sdk.resource, sdk.sampler, sdk.id_generator, "rx", 1000, env)
        else:
            sdk.add_span_processor(BatchSpanProcessor(span_exporter_from_env(env)))
            tp = sdk
        mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
        telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
        _requests(telemetry, tp.get_tracer("test.scope", "1.2", schema_url="https://x/s"), "r")
        assert tp.force_flush(30_000)
        tp.shutdown()
        time.sleep(0.2)
        # the session's receiver is shared: a late span of an earlier test (an in-process vLLM
        # engine's) may still arrive; this run's spans are in the traces its ids started or joined
        mine = ids.trace_ids | {"0af7651916cd43dd8448eb211c80319c"}
        spans = receiver.spans()
        foreign = [s for s in spans if s["trace_id"] not in mine]
        assert not [s for s in foreign if str(s["attributes"].get("llm.request.id", "")).startswith("r-")], foreign
        return sorted(
            (_comparable(s) for s in spans if s["trace_id"] in mine), key=lambda s: (s["trace_id"], s["span_id"])
        )

    in_process, offloaded = run(False), run(True)
    assert len(in_process) >= 5  # sampled at 0.5 with fixed ids: some trees kept, some not
    assert offloaded == in_process
    names = {s["name"] for s in offloaded}
    assert {"llm.prompt", "llm.token_stream"} <= names
    remote = [s for s in offloaded if s["trace_id"] == "0af7651916cd43dd8448eb211c80319c"]
    assert remote and all("vendor=x" in s["trace_state"] for s in remote)
    assert any(s["links"] for s in offloaded) or "linked" not in names


def _drops(reader) -> dict[str, int]:
    out: dict[str, int] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == M.LLM_OTEL_SPANS_DROPPED:
                    for point in metric.data.data_points:
                        key = point.attributes.get("error.type")
                        out[key] = out.get(key, 0) + point.value
    return out


def _offload(receiver, settings=None, **env):
    settings = settings or Settings(console="off", adaptive_sampling="off")
    reader = InMemoryMetricReader()
    tp, _ = build_providers(settings, _env(receiver, OTEL_TRACES_SAMPLER="always_on", **env), shutdown_on_exit=False)
    assert isinstance(tp, OffloadTracerProvider)
    mp = MeterProvider(metric_readers=[reader])
    tp.buffer.bind(mp)
    return tp, reader


def test_a_killed_exporter_process_costs_counted_spans_and_a_new_one_takes_over(receiver, caplog):
    receiver.clear()
    tp, reader = _offload(receiver)
    buffer = tp.buffer
    buffer.respawn_s = 0.0
    tracer = tp.get_tracer("t")
    tracer.start_span("before").end()
    assert tp.force_flush(30_000)
    receiver.wait_for_spans(1, name="before")
    killed = buffer._proc  # noqa: SLF001 - the real process, killed as an OOM killer would
    killed.kill()
    killed.wait()
    for _ in range(5):
        tracer.start_span("after").end()  # never raises into the caller
    assert tp.force_flush(30_000)
    receiver.wait_for_spans(5, name="after")  # a new exporter process delivered them
    successor = buffer._proc  # noqa: SLF001
    assert successor is not None and successor.pid != killed.pid and successor.poll() is None  # restarted, alive
    assert any("exporter process" in r.getMessage() for r in caplog.records)
    tp.shutdown()


def test_a_respawned_exporter_process_marks_the_reset_of_its_cumulative_series(receiver):
    """Issue 30 item 4: the GenAI request metrics are aggregated in the exporter process; one that
    dies takes its cumulative sums with it, and the new one counts from zero under the same
    resource and attributes. What the collector receives must say so the way OTLP does: every point
    of the new process starts (``start_time_unix_nano``) after the last point of the old one, so a
    backend sees a counter reset - not a decrease, nor (when the new count overtakes the old) a
    smaller increase. A backend adding up the cumulative segments (one per start time) gets every
    request."""
    receiver.clear()
    settings = Settings(console="off", adaptive_sampling="off")
    env = {k: v for k, v in _env(receiver, OTEL_TRACES_SAMPLER="always_on").items() if k != "OTEL_METRICS_EXPORTER"}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint, OTEL_METRIC_EXPORT_INTERVAL="600000")
    tp, mp = build_providers(settings, env, shutdown_on_exit=False)
    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
    buffer = tp.buffer
    buffer.respawn_s = 0.0

    def requests(n: int, tag: str) -> None:
        for i in range(n):
            rec = telemetry.start_request(
                f"{tag}-{i}",
                operation="text_completion",
                provider="vllm",
                model="m",
                arrival_s=time.time(),
                input_tokens=3,
            )
            rec.mono_offset_ns = time.time_ns() - time.monotonic_ns()
            rec.on_tokens([1], time.monotonic())
            rec.finish_reason = "length"
            telemetry.finish(rec)
        assert tp.force_flush(30_000)

    def points() -> list[dict]:
        return [
            p
            for p in receiver.metrics(M.LLM_SERVER_REQUESTS, latest=False)
            if p["resource"]["process.pid"] == os.getpid()
        ]

    requests(3, "old")
    old = receiver.wait_for_metric(M.LLM_SERVER_REQUESTS, timeout=10)
    first = buffer._proc  # noqa: SLF001 - the real exporter process, killed as an OOM killer would
    first.kill()
    first.wait()
    requests(5, "new")  # more than the old process counted: a backend that ignores start times undercounts
    assert buffer._proc is not None and buffer._proc.pid != first.pid  # noqa: SLF001 - a new process exported
    deadline = time.monotonic() + 10
    while len({p["start_ns"] for p in points()}) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tp.shutdown()
    mp.shutdown()
    series: dict[tuple, list[dict]] = {}
    for p in points():
        series.setdefault(tuple(sorted(p["attributes"].items())), []).append(p)
    assert old and series
    for key, pts in series.items():
        pts.sort(key=lambda p: p["time_ns"])
        starts = sorted({p["start_ns"] for p in pts})
        assert len(starts) == 2, (key, pts)  # one cumulative segment per exporter process
        last_old = max(p["time_ns"] for p in pts if p["start_ns"] == starts[0])
        assert starts[1] > last_old, (key, pts)  # the reset is marked: after the old process's last point
        for a, b in zip(pts, pts[1:], strict=False):  # within a segment the sum never goes down
            assert b["value"] >= a["value"] or b["start_ns"] > a["time_ns"], (key, pts)
        # what a start-time-aware backend adds up: the last value of each segment
        total = sum(max(p["value"] for p in pts if p["start_ns"] == s) for s in starts)
        assert total == 8, (key, pts)


def test_spans_ended_while_the_exporter_process_is_down_are_counted(receiver, caplog):
    receiver.clear()
    tp, reader = _offload(receiver)
    buffer = tp.buffer
    tracer = tp.get_tracer("t")
    tracer.start_span("first").end()
    assert tp.force_flush(30_000)
    buffer.respawn_s = 3600.0  # no new process for now: what ends meanwhile is lost, and counted
    buffer._proc.kill()  # noqa: SLF001
    buffer._proc.wait()  # noqa: SLF001
    for _ in range(4):
        tracer.start_span("lost").end()
    tp.force_flush(5_000)
    assert _drops(reader).get(DOWN) == 4
    assert buffer.failed == 4
    # one line, naming the exporter process (not the collector) and the reason (review finding F3)
    lines = [r.getMessage() for r in caplog.records if "span(s) dropped" in r.getMessage()]
    assert len(lines) == 1 and "exporter process is not running" in lines[0] and "-9" in lines[0], lines
    tp.shutdown()


@pytest.mark.case("C13")
def test_a_full_buffer_drops_new_spans_and_counts_them(receiver):
    receiver.clear()
    tp, reader = _offload(receiver, Settings(console="off", adaptive_sampling="off", export_process_buffer=5))
    tracer = tp.get_tracer("t")
    with tp.buffer._lock:  # noqa: SLF001 - the writer is busy (a slow pipe): nothing leaves the buffer
        for _ in range(12):
            tracer.start_span("burst").end()
    assert _drops(reader).get(BACKLOG) == 7
    assert tp.force_flush(30_000)
    assert len(receiver.wait_for_spans(5, name="burst")) == 5
    tp.shutdown()


def _cpu_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_a_burst_while_the_exporter_process_starts_beside_cpu_hogs_arrives_whole(receiver):
    """Issue 30 item 4: 200 spans in 2 s beside three CPU-bound processes, the collector slow to
    answer (0.3 s per export): what piles up while the exporter process starts and while an export
    waits stays queued within the buffer's bound and arrives; nothing is reported dropped (the old
    four-frame queue delivered 120-160 of 200 and blamed the collector)."""
    receiver.clear()
    receiver.trace_delay_s = 0.3
    hogs = _cpu_hogs(3)
    try:
        tp, reader = _offload(receiver)
        tracer = tp.get_tracer("t")
        for _ in range(200):
            tracer.start_span("burst").end()
            time.sleep(0.01)
        assert tp.force_flush(60_000)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        receiver.trace_delay_s = 0.0
    assert len(receiver.wait_for_spans(200, timeout=30, name="burst")) == 200
    assert _drops(reader) == {} and tp.buffer.failed == 0
    tp.shutdown()


def test_spans_the_exporter_process_cannot_queue_are_backlog_not_export_failures(receiver, caplog):
    """Issue 30 item 4: with the collector answering slowly and a small buffer, the spans the
    exporter process's queue cannot take are counted ``export_process_backlog`` - the collector took
    every batch it was sent, so ``export_failed`` stays 0 - and the log line names the exporter
    process, not the collector."""
    receiver.clear()
    receiver.trace_delay_s = 1.0
    try:
        tp, reader = _offload(receiver, Settings(console="off", adaptive_sampling="off", export_process_buffer=8))
        tracer = tp.get_tracer("t")
        tracer.start_span("first").end()
        assert tp.force_flush(30_000)  # the exporter process runs
        for _ in range(60):
            for _ in range(6):
                tracer.start_span("slow").end()
            time.sleep(0.02)
        tp.force_flush(30_000)
    finally:
        receiver.trace_delay_s = 0.0
    drops = _drops(reader)
    assert drops.get(BACKLOG, 0) > 0 and "export_failed" not in drops, drops
    arrived = len(receiver.spans(name="slow"))
    assert arrived + drops[BACKLOG] == 360, (arrived, drops)
    lines = [r.getMessage() for r in caplog.records if "span(s) dropped" in r.getMessage()]
    assert lines and all("collector does not keep up" not in line for line in lines), lines
    tp.shutdown()


def test_the_final_flush_delivers_what_is_buffered_and_ends_the_exporter_process(receiver):
    receiver.clear()
    tp, _ = _offload(receiver)
    for _ in range(3):
        tp.get_tracer("t").start_span("last").end()
    tp.force_flush(30_000)
    proc = tp.buffer._proc  # noqa: SLF001
    tp.get_tracer("t").start_span("last").end()
    tp.shutdown(timeout_millis=10_000)
    assert len(receiver.wait_for_spans(4, name="last")) == 4
    assert proc.wait(5) == 0


FORK_APP = """
    import os, sys, time
    from llm_otel.config import Settings
    from llm_otel.process.providers import build_providers
    tp, mp = build_providers(Settings(console="off", adaptive_sampling="off"), shutdown_on_exit=False)
    tp.get_tracer("t").start_span("parent-before-fork").end()
    assert tp.force_flush(30000)
    parent_proc, parent_sent = tp.buffer._proc, tp.buffer._sent
    pid = os.fork()
    if pid == 0:
        tp.get_tracer("t").start_span("child-span").end()
        ok = tp.force_flush(30000)
        # the child has an exporter process of its own; the parent's pipe was never written
        os._exit(0 if ok and tp.buffer._proc is not parent_proc and tp.buffer._pid == os.getpid() else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert tp.buffer._sent == parent_sent and tp.buffer._proc is parent_proc
    tp.get_tracer("t").start_span("parent-after-fork").end()
    assert tp.force_flush(30000)
    tp.shutdown()
    print("ok", flush=True)
"""


def test_a_forked_child_exports_through_its_own_exporter_process(receiver):
    receiver.clear()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(_env(receiver, OTEL_TRACES_SAMPLER="always_on"))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORK_APP)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    for name in ("parent-before-fork", "child-span", "parent-after-fork"):
        assert len(receiver.wait_for_spans(1, name=name)) == 1


def test_application_providers_are_used_in_process(receiver, monkeypatch):
    """An application that passes its own providers keeps the SDK path: no exporter process."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint)
    memory = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(memory))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    assert request_outlets(tp, mp) is None  # the SDK's provider: everything in process
    telemetry = Telemetry(tp, mp, Settings(console="off", adaptive_sampling="off"), outlets=request_outlets(tp, mp))
    rec = telemetry.start_request(
        "app", operation="text_completion", provider="vllm", model="m", arrival_s=time.time(), input_tokens=1
    )
    rec.on_tokens([1], time.monotonic())
    telemetry.finish(rec)
    assert {s.name for s in memory.get_finished_spans()} >= {"text_completion m", "llm.prompt"}


def test_the_opt_out_keeps_the_sdk_batch_processor(receiver):
    tp, _ = build_providers(
        Settings(console="off", adaptive_sampling="off", export_process=False), _env(receiver), shutdown_on_exit=False
    )
    assert isinstance(tp, TracerProvider)
    assert type(tp._active_span_processor._span_processors[0]) is BatchSpanProcessor  # noqa: SLF001
    tp.shutdown()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_the_exporter_process_exits_when_its_serving_process_is_killed(receiver):
    """SIGKILL to the serving process (an OOM kill): its exporter process, idle, is gone within the
    flush deadline (``LLM_OTEL_FLUSH_DEADLINE_S``, 2 s here) plus a margin - not after an export
    timeout or two (an exporter process once outlived its server by about 30 s)."""
    script = textwrap.dedent("""
        import time
        from llm_otel.config import Settings
        from llm_otel.process.providers import build_providers
        tp, _ = build_providers(Settings(console="off", adaptive_sampling="off"), shutdown_on_exit=False)
        tp.get_tracer("t").start_span("x").end()
        tp.force_flush(30000)
        print(tp.buffer._proc.pid, flush=True)
        time.sleep(60)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(_env(receiver, OTEL_TRACES_SAMPLER="always_on", LLM_OTEL_FLUSH_DEADLINE_S="2"))
    serving = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    exporter_pid = int(serving.stdout.readline())
    assert not _gone(exporter_pid)
    serving.kill()
    assert serving.wait(30) == -signal.SIGKILL
    killed = time.monotonic()
    while time.monotonic() < killed + 2.0 + 1.5 and not _gone(exporter_pid):
        time.sleep(0.05)
    alive = not _gone(exporter_pid)
    if alive:
        os.kill(exporter_pid, signal.SIGKILL)
    assert not alive, "the exporter process outlived its killed serving process by more than the flush deadline"
    print(f"\nexporter process gone {time.monotonic() - killed:.2f} s after its serving process was killed")


BLACK_HOLE_APP = """
    import signal, sys, time
    from llm_otel.config import Settings
    from llm_otel.process.providers import build_providers
    tp, _ = build_providers(Settings(console="off", adaptive_sampling="off"), shutdown_on_exit=False)
    tracer = tp.get_tracer("t")
    for i in range(30000):  # more frames than the pipe holds: the writer thread blocks in a write
        tracer.start_span("x", attributes={"pad": "y" * 200}).end()
    time.sleep(1)
    print(tp.buffer._proc.pid, flush=True)
    if sys.argv[1] == "killed":
        signal.pause()
    tp.shutdown(timeout_millis=2000)
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts: it runs nothing and holds no socket)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" in f.read()
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("end", ["final_flush", "killed"])
def test_with_a_collector_that_never_answers_the_exporter_process_ends_with_its_serving_process(end):
    """Review finding (issue 19, F4): with a collector that accepts connections and never answers,
    the exporter process sat in one export timeout after another for the frames still in its pipe
    and outlived its serving process (4-30 s). It must end with the final flush's deadline, or one
    flush deadline (2 s) after its serving process was killed."""
    import socket

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
        env.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{hole.getsockname()[1]}",
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_METRICS_EXPORTER="none",
            OTEL_TRACES_SAMPLER="always_on",
            LLM_OTEL_FLUSH_DEADLINE_S="2",
        )
        serving = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(BLACK_HOLE_APP), end],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        exporter_pid = int(serving.stdout.readline())
        if end == "killed":
            serving.kill()
        assert serving.wait(30) in (0, -signal.SIGKILL)
        gone_by = time.monotonic() + (1.0 if end == "final_flush" else 2.0 + 1.5)
        while time.monotonic() < gone_by and not _gone(exporter_pid):
            time.sleep(0.05)
        alive = not _gone(exporter_pid)
        if alive:
            os.kill(exporter_pid, signal.SIGKILL)
        assert not alive, f"the exporter process outlived its serving process ({end})"
    finally:
        hole.close()


GENAI_REQUEST_METRICS = (
    M.GEN_AI_SERVER_REQUEST_DURATION,
    M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
    M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
    M.LLM_SERVER_INTER_TOKEN_LATENCY,
    M.LLM_SERVER_OUTPUT_TOKEN_RATE,
    M.LLM_SERVER_REQUEST_QUEUE_TIME,
    M.LLM_SERVER_TOKEN_USAGE,
    M.LLM_SERVER_REQUESTS,
    M.LLM_SERVER_REQUEST_KV_CACHE_SIZE,
    M.LLM_SERVER_SLO_CHECKS,
)


def _choices(telemetry: Telemetry) -> None:
    """An ``n = 2`` request (one record per choice sharing a ChoiceGroup: the request-level
    observations once, by the last choice) with a different model, so its series are its own."""
    from llm_otel.telemetry.record import ChoiceGroup

    base, group = 1_700_000_010.0, ChoiceGroup(2)
    for c in range(2):
        rec = telemetry.start_request(
            "n2",
            operation="text_completion",
            provider="vllm",
            model="m2",
            arrival_s=base,
            input_tokens=5,
            choice_index=c,
        )
        rec.choice_group = group
        rec.mono_offset_ns = round((base - 2000.0) * 1e9)
        for k in range(9 + c):
            rec.on_tokens([k, k], 2000.01 + k * 0.004 * (c + 1))
        rec.finish_reason = "stop"
        telemetry.finish(rec, end_ns=round((base + 0.1 + c * 0.05) * 1e9))


@pytest.mark.parametrize("itl_every", [1, 4])
def test_genai_metrics_are_the_same_and_their_exemplars_point_at_exported_request_spans(receiver, itl_every):
    """Every request's GenAI metrics, recorded by the exporter process from one record per
    finished request: the same points as in process - names, attributes, counts, sums, buckets,
    the serving process's resource and scope - and the same exemplars (trace id, span id, value),
    which name the sampled request spans that were exported. Same ids and the same ITL sampling
    offsets on both paths (seeded), so the comparison is exact."""
    settings = Settings(console="off", adaptive_sampling="off", itl_sample_every=itl_every)

    def run(export_process: bool):
        receiver.clear()
        env = {k: v for k, v in _env(receiver, OTEL_TRACES_SAMPLER="always_on").items() if k != "OTEL_METRICS_EXPORTER"}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.grpc_endpoint
        tp, mp = build_providers(
            dataclasses.replace(settings, export_process=export_process), env, shutdown_on_exit=False
        )
        tp.id_generator = SeededIds(11)  # before any tracer exists: the same span ids on both paths
        from llm_otel.signals import SignalsConfig
        from llm_otel.signals.kv import KVSpec

        telemetry = Telemetry(
            tp,
            mp,
            settings,
            signals_config=SignalsConfig.from_env({"LLM_OTEL_TIERS": "standard * e2e=120 ttft=60"}),
            outlets=request_outlets(tp, mp),
        )
        telemetry.instruments._rng.seed(3)  # noqa: SLF001 - the same ITL offsets on both paths
        signals, start = telemetry.signals, telemetry.start_request
        kv = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype_bytes=4, block_size=16)

        def start_request(*args, **kwargs):  # as the vLLM adapter admits a request: tier and KV size
            rec = start(*args, **kwargs)
            _, labels, tier = signals.classify()
            signals.admit(rec, labels, tier, kv)
            return rec

        telemetry.start_request = start_request
        # recorded by the exporter process (the same points prove it delivers them) or in process
        assert isinstance(signals.kv_size, RemoteInstrument) is export_process
        assert isinstance(signals.slo_checks, RemoteInstrument) is export_process
        assert (telemetry.instruments.sink is not None) is export_process
        _requests(telemetry, tp.get_tracer("t"), "m")
        _choices(telemetry)
        assert tp.force_flush(30_000) and mp.force_flush(30_000)
        points = {}
        for name in GENAI_REQUEST_METRICS:
            # this process's series: other processes (the session's servers) export these instruments
            # here too; a point the exporter process sent under its own identity would never match
            for p in receiver.wait_for_metric(name, timeout=10, resource={"process.pid": os.getpid()}):
                key = (name, tuple(sorted(p["attributes"].items())))
                points[key] = (
                    p.get("count"),
                    p.get("sum"),
                    tuple(p.get("bucket_counts", ())),
                    p.get("value"),
                    p["resource"]["process.pid"],
                    p["scope_name"],
                    p["scope_version"],
                    tuple((e["trace_id"], e["span_id"], e["value"]) for e in p.get("exemplars", ())),
                )
        spans = {(s["trace_id"], s["span_id"]) for s in receiver.spans() if s["name"].startswith("text_completion m")}
        tp.shutdown()
        mp.shutdown()
        return points, spans

    in_process, _ = run(False)
    offloaded, request_spans = run(True)
    assert len({key[0] for key in in_process}) == len(GENAI_REQUEST_METRICS)
    assert offloaded == in_process
    assert {p[4] for p in offloaded.values()} == {os.getpid()}  # the serving process's resource
    exemplars = {e[:2] for p in offloaded.values() for e in p[7]}
    assert exemplars and exemplars <= request_spans
    itl = [p for key, p in offloaded.items() if key[0] == M.LLM_SERVER_INTER_TOKEN_LATENCY]
    # 11, 11, 8 and 9 gaps after the first token-producing step (the failed request records none)
    assert sum(p[0] for p in itl) == 39 if itl_every == 1 else 4 <= sum(p[0] for p in itl) <= 14


def test_metric_observations_a_full_buffer_cannot_take_are_counted(receiver):
    tp, reader = _offload(receiver, Settings(console="off", adaptive_sampling="off", export_process_buffer=1))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    telemetry = Telemetry(tp, mp, Settings(console="off", adaptive_sampling="off"), outlets=request_outlets(tp, mp))
    # the application's meter provider (not the one llm-otel built with the exporter process): here
    assert type(telemetry.instruments.ttft).__name__ != "RemoteInstrument"
    assert not isinstance(telemetry.instruments.ttft, RemoteInstrument)

    remote = RemoteInstrument(tp.buffer, "requests")
    with tp.buffer._lock:  # noqa: SLF001 - the writer is busy: nothing leaves the buffer
        for _ in range(tp.buffer.metric_capacity + 3):
            remote.add(1, {"a": "b"})
    data = reader.get_metrics_data()
    dropped = [
        p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == M.LLM_OTEL_METRIC_POINTS_DROPPED
        for p in m.data.data_points
        if p.attributes.get("error.type") == BACKLOG
    ]
    assert dropped == [3]
    tp.shutdown()


def test_a_request_metric_record_a_full_buffer_cannot_take_counts_all_its_points(receiver):
    """A finished request's GenAI observations are one record, weighing the observations it may
    record in the metric buffer (bounded in observations, however long the requests): a full
    buffer loses the record and counts every point it held; what the writer takes frees its weight."""
    from llm_otel.telemetry.metrics import Instruments

    tp, reader = _offload(receiver)
    buffer = tp.buffer
    sets = ({"m": "x"},) * 4
    ok = (sets, True, 0.5, 0.1, 0.01, [0.01, 0.02, 0.03], 20.0, 0.002, 7, 10, None)
    buffer.metric_capacity = 3 * (8 + 3)  # three such records
    with buffer._lock:  # noqa: SLF001 - the writer is busy: nothing leaves the buffer
        for _ in range(4):
            buffer.push_request(ok, None)
        assert len(buffer._mqueue) == 3  # noqa: SLF001
    data = reader.get_metrics_data()
    dropped = [
        p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == M.LLM_OTEL_METRIC_POINTS_DROPPED
        for p in m.data.data_points
        if p.attributes.get("error.type") == BACKLOG
    ]
    # duration, TTFT, TPOT, 3 ITL gaps, token rate, the request count, queue time, input and output tokens
    assert dropped == [Instruments.points(ok)] == [11]
    assert buffer._drain() and buffer._mput == buffer._mtaken == 33  # noqa: SLF001
    with buffer._lock:  # noqa: SLF001
        for _ in range(3):
            buffer.push_request(ok, None)
        assert len(buffer._mqueue) == 3  # noqa: SLF001 - taken records freed their weight
    tp.shutdown()


@pytest.mark.parametrize("case", ["ok", "error", "first_choice", "no_tokens"])
def test_the_points_of_a_request_record_are_what_apply_records(case):
    """``Instruments.points`` (the drop count of a lost request record) equals the points the real
    SDK instruments receive from ``apply``: histogram counts plus counter increments."""
    from llm_otel.telemetry.metrics import NO_TRACE, Instruments

    reader = InMemoryMetricReader()
    instruments = Instruments(MeterProvider(metric_readers=[reader]).get_meter("t"), 1)
    sets = ({"a": "1"}, {"a": "1", "r": "stop"}, {"a": "1", "t": "input"}, {"a": "1", "t": "output"})
    obs = {
        "ok": (sets, True, 0.5, 0.1, 0.01, [0.01, 0.02], 20.0, 0.002, 7, 10, None),
        "error": (sets, True, 0.5, None, None, (), None, 0.002, 7, 0, "boom"),
        "first_choice": (sets, False, 0.5, 0.1, None, [0.3], 20.0, None, 7, 10, None),
        "no_tokens": (sets, True, 0.5, None, None, (), None, None, 7, 0, None),
    }[case]
    instruments.apply(obs, NO_TRACE)
    data = reader.get_metrics_data()
    recorded = sum(
        p.count if hasattr(p, "count") else p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    )
    assert recorded == Instruments.points(obs)


PREWARM_APP = """
    import sys, time
    from opentelemetry import trace
    from llm_otel.config import Settings
    from llm_otel.instrumentation.lightllm import process
    from llm_otel.process.providers import build_providers
    tp, _ = build_providers(Settings(console="off", adaptive_sampling="off"), shutdown_on_exit=False)
    trace.set_tracer_provider(tp)
    process.relabel_this_process(sys.argv[1], **({"master": sys.argv[2] == "master"} if len(sys.argv) > 2 else {}))
    started = tp.buffer._thread is not None  # prewarm starts the writer thread, which starts the process
    deadline = time.monotonic() + 20
    while started and tp.buffer._proc is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print("RESULT", started, tp.buffer._proc is not None, flush=True)
"""


@pytest.mark.parametrize(
    ("role", "started"),
    [(("router",), True), (("worker", "master"), True), (("worker", "other"), False), (("detokenizer",), False)],
)
def test_lightllm_processes_that_export_start_their_exporter_process_when_known(receiver, role, started):
    """Issue 30 item 4: LightLLM's router lost step spans of its first requests while its exporter
    process started under load; the processes that will export - the router (engine steps), a DP
    group's master model-infer worker (device steps, ``llm.logit_dist``), like the HTTP worker -
    start theirs as soon as they are known (re-labelled at multiprocessing's bootstrap), before any
    span; the detokenizer and a non-master worker, which export nothing, start none."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(_env(receiver))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PREWARM_APP), *role],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"RESULT {started} {started}" in done.stdout, done.stdout + done.stderr[-3000:]
