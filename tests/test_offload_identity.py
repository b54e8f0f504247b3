"""The exporter process (:mod:`llm_otel.export.offload`) together with process identity
(:mod:`llm_otel.process.identity`), the start policy and what it inherits.

Real components: the exporter process exports over OTLP/gRPC to the in-process receiver
(tests/support/otlp_receiver.py); processes under ``opentelemetry-instrument`` are real interpreters
started with the auto-instrumentation ``sitecustomize``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from llm_otel.config import Settings
from llm_otel.export.offload import ENCODING, OffloadTracerProvider, prewarm
from llm_otel.process.providers import build_providers
from llm_otel.semconv import metrics as M

AUTO = os.path.join("opentelemetry", "instrumentation", "auto_instrumentation")


def _clean_env(receiver, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_TRACES_SAMPLER": "always_on",
            "OTEL_METRIC_EXPORT_INTERVAL": "100000",
            **extra,
        }
    )
    return env


def _exporter_children(pid: int) -> list[int]:
    """pids of the exporter processes (``python -m llm_otel.export.offload``) whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == pid and b"llm_otel.export.offload" in cmdline:
            out.append(int(entry))
    return out


# --- 1. a re-label reaches the exporter process (spans, its GenAI metrics, a fork child's) -------
RELABEL_APP = """
    import os
    from llm_otel.config import Settings
    from llm_otel.process.identity import relabel
    from llm_otel.export.offload import prewarm, request_outlets
    from llm_otel.process.providers import build_providers
    from llm_otel.telemetry import Telemetry

    settings = Settings(console="off", adaptive_sampling="off")
    tp, mp = build_providers(settings, shutdown_on_exit=False)
    assert prewarm(tp)
    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp))
    tracer = tp.get_tracer("t")
    tracer.start_span("before-relabel").end()
    assert tp.force_flush(30000)
    first = tp.buffer._proc
    tracer.start_span("queued-before-relabel").end()  # still buffered when the relabel comes
    relabel("router", process_name="lightllm.server.router.manager:start_router_process")
    tracer.start_span("after-relabel").end()
    import time
    rec = telemetry.start_request("r1", operation="text_completion", provider="lightllm", model="m",
                                  arrival_s=time.time(), input_tokens=3)
    rec.on_tokens([1], time.monotonic())
    rec.finish_reason = "stop"
    telemetry.finish(rec)
    assert tp.force_flush(30000) and tp.buffer._proc is first  # the same exporter process, re-labelled
    pid = os.fork()
    if pid == 0:  # its own pid and instance id, same role, in its own exporter process
        tracer.start_span("forked-child").end()
        os._exit(0 if tp.force_flush(30000) and tp.buffer._proc is not first else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    tp.shutdown()
    mp.shutdown()
    print("ok", pid, flush=True)
"""


def test_relabel_reaches_the_exporter_process_spans_metrics_and_a_forked_childs(receiver):
    receiver.clear()
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RELABEL_APP)],
        capture_output=True,
        text=True,
        env=_clean_env(receiver),
        timeout=120,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    child_pid = int(out.stdout.split()[-1])

    def resource(name):
        (span,) = receiver.wait_for_spans(1, name=name)
        return span["resource"]

    before, queued, after = resource("before-relabel"), resource("queued-before-relabel"), resource("after-relabel")
    assert before["llm.process.role"] == queued["llm.process.role"] == "frontend"  # ended before: old label
    assert after["llm.process.role"] == "router"
    assert after["llm.process.name"] == "lightllm.server.router.manager:start_router_process"
    assert after["process.pid"] == before["process.pid"]
    assert after["service.instance.id"] == before["service.instance.id"]  # a UUID stays (identity.relabel)
    # the per-request GenAI metrics recorded in the exporter process carry the new identity
    # the app's own series (its pid): other processes of the session export this instrument too
    (point,) = receiver.wait_for_metric(
        M.LLM_SERVER_REQUESTS, timeout=10, resource={"process.pid": before["process.pid"]}
    )
    assert point["resource"]["llm.process.role"] == "router"
    assert point["resource"]["service.instance.id"] == after["service.instance.id"]
    child = resource("forked-child")
    assert (child["llm.process.role"], child["process.pid"]) == ("router", child_pid)
    assert child["service.instance.id"] != after["service.instance.id"]


# --- 2. start policy: lazy, prewarmed where llm-otel knows the process serves ------------------
def test_the_exporter_process_starts_with_the_first_span_or_prewarm(receiver):
    settings = Settings(console="off", adaptive_sampling="off")
    env = _clean_env(receiver)
    # exporter processes of providers other tests of this session built and still use (the
    # process-wide providers of an engine fixture) are not this test's
    before = set(_exporter_children(os.getpid()))
    tp, mp = build_providers(settings, env, shutdown_on_exit=False)
    assert isinstance(tp, OffloadTracerProvider)
    assert tp.buffer._thread is None and tp.buffer._proc is None
    assert set(_exporter_children(os.getpid())) - before == set()
    tp.get_tracer("t").start_span("first").end()  # the first span starts it
    assert tp.force_flush(30_000) and tp.buffer._proc is not None
    assert set(_exporter_children(os.getpid())) - before == {tp.buffer._proc.pid}
    tp.shutdown()
    tp2, mp2 = build_providers(settings, env, shutdown_on_exit=False)
    assert prewarm(tp2) and tp2.buffer._thread is not None  # a serving frontend: started at once
    assert tp2.force_flush(30_000) and tp2.buffer._proc is not None
    tp2.shutdown()
    for provider in (mp, mp2):
        provider.shutdown()


INSTRUMENTED_APP = """
    import multiprocessing, os, sys, time
    from opentelemetry import trace
    import tritonclient.http  # a library llm-otel hooks (in every process: spawn re-imports this module)

    def silent():  # a helper process (LightLLM's detokenizer, cache, metrics ...): never makes a span
        time.sleep(1.0)
        provider = trace.get_tracer_provider()
        sys.exit(0 if type(provider).__name__ == "OffloadTracerProvider" and provider.buffer._proc is None else 5)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=silent) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
        provider = trace.get_tracer_provider()
        assert provider.buffer._proc is None  # nor has this one made a span yet
        provider.get_tracer("t").start_span("instrumented-app").end()
        assert provider.force_flush(30000)
        print("EXPORTER", provider.buffer._proc.pid, flush=True)
        time.sleep(1.0)  # the exporter process has started up completely
        with open(f"/proc/{provider.buffer._proc.pid}/environ", "rb") as f:
            print("ENVIRON", f.read().split(b"\\0"), flush=True)
        provider.shutdown()
"""


@pytest.mark.slow
def test_processes_that_never_emit_start_no_exporter_process_and_it_does_not_instrument_itself(receiver, tmp_path):
    """Under opentelemetry-instrument every Python process that imports a library llm-otel hooks
    builds providers; helper processes that never make a span start no exporter process; the one started runs without the
    auto-instrumentation sitecustomize (and its providers), with llm-otel importable."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(INSTRUMENTED_APP))
    env = _clean_env(
        receiver,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="vllm",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        OTEL_SERVICE_NAME="offload-instrumented",
    )
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    out = subprocess.run(
        [instrument, sys.executable, str(app)], capture_output=True, text=True, env=env, timeout=180, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the exporter process's own sitecustomize would import llm_otel.export.offload before runpy runs it
    assert "found in sys.modules" not in out.stderr, out.stderr[-3000:]
    (environ,) = [line for line in out.stdout.splitlines() if line.startswith("ENVIRON ")]
    pythonpath = [v for v in eval(environ[len("ENVIRON ") :]) if v.startswith(b"PYTHONPATH=")]  # noqa: S307
    assert pythonpath and AUTO.encode() not in pythonpath[0]
    assert b"src" in pythonpath[0] or b"llm_otel" not in pythonpath[0]  # llm_otel's root stays first
    assert receiver.wait_for_spans(1, name="instrumented-app")


PLAIN_APP = """
import os, time
time.sleep(1.5)  # long enough for an exporter process started at activation to be running
kids = []
for pid in os.listdir("/proc"):
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (OSError, ValueError, IndexError):
        continue
    if ppid == os.getpid() and b"llm_otel.export.offload" in cmd:
        kids.append(pid)
print("EXPORTERS", len(kids))
"""


def test_a_process_that_only_has_vllm_installed_starts_no_exporter_process(receiver, tmp_path):
    """With the vLLM instrumentor active (vLLM importable) a plain Python process under
    opentelemetry-instrument - multiprocessing's resource tracker, a script - builds no engine client,
    so nothing prewarms an exporter process for it (the review found one, about 49 MB, in every such
    process); a vLLM frontend starts its own when it starts building LLMEngine/AsyncLLM."""
    app = tmp_path / "plain.py"
    app.write_text(textwrap.dedent(PLAIN_APP))
    env = _clean_env(
        receiver,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        OTEL_SERVICE_NAME="plain",
    )
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    out = subprocess.run(
        [instrument, sys.executable, str(app)], capture_output=True, text=True, env=env, timeout=180, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EXPORTERS 0" in out.stdout, (out.stdout, out.stderr[-3000:])


def test_the_vllm_frontend_prewarms_when_it_starts_building_an_engine_client():
    """The vLLM adapter runs its before_first_engine callback once, before the wrapped
    LLMEngine/AsyncLLM __init__ (so the exporter process's start overlaps vLLM's start-up)."""
    from llm_otel.instrumentation.vllm.adapter import VLLMAdapter
    from llm_otel.telemetry import Telemetry

    tp, mp = TracerProvider(), MeterProvider()
    adapter = VLLMAdapter(Telemetry(tp, mp, Settings(console="off", adaptive_sampling="off")))
    order = []
    adapter.before_first_engine = lambda: order.append("prewarm")
    wrapper = adapter.engine_init("engine_init")

    class Engine:
        output_processor = None

    for _ in range(2):
        wrapper(lambda: order.append("init"), Engine(), (), {})
    assert order == ["prewarm", "init", "init"]


def test_the_exporter_process_environment_drops_the_auto_instrumentation_dir(receiver):
    import opentelemetry.instrumentation.auto_instrumentation as auto

    auto_dir = os.path.dirname(auto.__file__)
    env = _clean_env(receiver, PYTHONPATH=os.pathsep.join(["/x/y", auto_dir]))
    tp, mp = build_providers(Settings(console="off", adaptive_sampling="off"), env, shutdown_on_exit=False)
    paths = tp.buffer._env["PYTHONPATH"].split(os.pathsep)
    assert auto_dir not in paths and "/x/y" in paths
    tp.shutdown()
    mp.shutdown()


# --- 4. values pickle cannot encode lose that value, not the frame; lists copied at set time ------
def test_an_unencodable_attribute_loses_that_value_not_the_frame(receiver, caplog):
    receiver.clear()
    tp, mp = build_providers(
        Settings(console="off", adaptive_sampling="off"), _clean_env(receiver), shutdown_on_exit=False
    )
    reader = InMemoryMetricReader()
    tp.buffer.bind(MeterProvider(metric_readers=[reader]))
    tracer = tp.get_tracer("t")
    ranks = [1, 2]
    bad = tracer.start_span("with-bad-value", attributes={"ok": "yes"})
    bad.set_attribute("lock", threading.Lock())  # another instrumentation's object: pickle fails
    bad.set_attribute("ranks", ranks)
    bad.set_attributes({"np": np.float32(1.5), "seq": ["a", "b"]})
    bad.add_event("ev", {"lock": threading.Lock(), "n": 1})
    ranks.append(3)  # after set: the span keeps what was set, as the SDK's tuple copy does
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        with tp.buffer._lock:  # one frame for all of them
            for i in range(5):
                tracer.start_span(f"neighbour-{i}").end()
            bad.end()
            hopeless = tracer.start_span("renamed")
            hopeless.update_name(threading.Lock())  # the span's own data: that span alone is lost
            hopeless.end()
        assert tp.force_flush(30_000)
    for i in range(5):
        assert receiver.wait_for_spans(1, name=f"neighbour-{i}")
    (span,) = receiver.wait_for_spans(1, name="with-bad-value")
    attrs = span["attributes"]
    assert "lock" not in attrs and attrs["ok"] == "yes" and attrs["np"] == 1.5
    assert list(attrs["ranks"]) == [1, 2] and list(attrs["seq"]) == ["a", "b"]
    (event,) = span["events"]
    assert event["attributes"] == {"n": 1}
    assert tp.buffer.attributes_dropped == 2 and tp.buffer.failed == 1
    data = reader.get_metrics_data()
    assert [
        (p.attributes["error.type"], p.value)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == M.LLM_OTEL_SPANS_DROPPED
        for p in m.data.data_points
    ] == [(ENCODING, 1)]
    assert len([r for r in caplog.records if "attribute value" in r.getMessage()]) == 1
    tp.shutdown()
    mp.shutdown()


def test_metric_observations_with_unencodable_attribute_values_keep_the_rest(receiver):
    tp, mp = build_providers(
        Settings(console="off", adaptive_sampling="off"), _clean_env(receiver), shutdown_on_exit=False
    )
    good = ("requests", 1, {"gen_ai.request.model": "m"}, None)
    odd = ("requests", 1, {"gen_ai.request.model": "m", "x": threading.Lock(), "n": np.int64(3)}, None)
    kind, records = tp.buffer._encodable(("metrics", [good, odd]))  # noqa: SLF001 - the fallback itself
    assert kind == "metrics" and records == [good, ("requests", 1, {"gen_ai.request.model": "m", "n": 3}, None)]
    assert type(records[1][2]["n"]) is int and tp.buffer.attributes_dropped == 1
    tp.shutdown()
    mp.shutdown()


def test_a_request_metric_record_with_an_unencodable_label_keeps_the_rest(receiver):
    """One finished request's observations travel as one record: a label value pickle cannot
    take is dropped from each of its four attribute sets, its values are kept."""
    tp, mp = build_providers(
        Settings(console="off", adaptive_sampling="off"), _clean_env(receiver), shutdown_on_exit=False
    )
    attrs = {"gen_ai.request.model": "m", "x": threading.Lock(), "n": np.int64(3)}
    obs = ((attrs, attrs, attrs, attrs), True, 0.5, 0.1, 0.01, [0.01, 0.02], 20.0, None, 7, 10, None)
    kind, records = tp.buffer._encodable(("metrics", [("request", obs, 10, (1, 2, 1))]))  # noqa: SLF001
    clean = {"gen_ai.request.model": "m", "n": 3}
    assert kind == "metrics" and records == [("request", ((clean,) * 4, *obs[1:]), 10, (1, 2, 1))]
    assert tp.buffer.attributes_dropped == 4
    tp.shutdown()
    mp.shutdown()
