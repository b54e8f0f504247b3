"""The fleet pipeline, for real: two vLLM OpenAI servers (the tiny model, one start each, zero-code
with ``LLM_OTEL_ENABLED=1`` as examples/kubernetes/vllm.yaml runs them) -> rotel, a real OTLP
collector (the ``rotel`` PyPI package's binary: OTLP in, resource attributes, OTLP out) -> the
tests' OTLP receiver; and Debian's Prometheus scraping both servers' llm-otel endpoints.

Replica ``a`` samples at a fixed head probability of 0.5 (``ot=th:8``) and captures every request
the head drops as an outlier root (``LLM_OTEL_OUTLIER_TTFT_S`` tiny), so every request it serves
arrives exactly once - as a head-sampled tree with ``th``, or as an outlier tree without. Replica
``b`` runs the default adaptive sampler (probability 1 while idle: ``th:0``) and also serves
requests that arrive with a router's ``traceparent``/``tracestate`` (``ot=th:c``, sampled at 25 %
upstream), whose threshold it must carry on. The last test stops rotel: the servers keep serving
and count the spans they lose in ``llm_otel_spans_dropped_total``, logging it once per process.

What a real collector with tail sampling does (otelcol-contrib) is not run here - it is not
installable on this machine kind; tests/test_deploy_static.py checks those configurations.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import secrets
import socket
import subprocess
import sys
import time

import pytest
import yaml
from conftest import HAS_VLLM, VLLM_ENV, record_received
from support.otlp_receiver import OTLPReceiver
from test_ops_live import _free_pair, _free_port, _query, _require, _stop

httpx = pytest.importorskip("httpx")
pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

SERVED = "tiny"
ROUTER_SPAN = "00f067aa0ba902b7"
ROUTER_STATE = "ot=th:c,router=edge-1"  # the router kept 25 % (threshold 0xc / 16)
ENVIRONMENT = "fleet-ci"  # added by rotel to every resource
A_REQUESTS = 16  # both head-kept and outlier trees: P(one kind only) = 2^-15
B_OWN, B_ROUTED = 4, 4
DOWN_REQUESTS = 4


def _randomness(trace_id: str) -> int:
    """The trace's randomness for consistent sampling: its low 56 bits (W3C random trace id)."""
    return int(trace_id, 16) & ((1 << 56) - 1)


def _threshold(trace_state: str) -> int | None:
    """``th`` of the ``ot`` tracestate entry as a 56-bit rejection threshold, None without one."""
    match = re.search(r"(?:^|,)ot=(?:[^,]*;)?th:([0-9a-f]{1,14})", trace_state or "")
    return None if match is None else int(match.group(1).ljust(14, "0"), 16)


@dataclasses.dataclass
class Replica:
    name: str
    service: str
    base: str
    metrics_port: int  # frontend; the engine core serves on metrics_port + 1
    proc: subprocess.Popen
    log: pathlib.Path


_TAKEN: set[int] = set()  # ports handed out in this module: the servers bind them only later


def _distinct(pick, width: int = 1) -> int:
    while True:
        port = pick()
        if not _TAKEN & set(range(port, port + width)):
            _TAKEN.update(range(port, port + width))
            return port


def _start_server(name: str, tiny_model, rotel_grpc: str, work: pathlib.Path, extra: dict) -> Replica:
    port, metrics_port = _distinct(_free_port), _distinct(_free_pair, 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(VLLM_ENV)
    env.update(
        LLM_OTEL_ENABLED="1",
        OTEL_SERVICE_NAME=f"vllm-replica-{name}",
        OTEL_RESOURCE_ATTRIBUTES=f"k8s.pod.name=replica-{name},service.namespace=fleet",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=rotel_grpc,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_EXPORTER_OTLP_TIMEOUT="2",
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
        LLM_OTEL_LOGIT_DIST_RATIO="1",
        LLM_OTEL_CONSOLE="off",
        VLLM_LOGGING_LEVEL="INFO",
        **extra,
    )
    log = work / f"replica-{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model),
        "--served-model-name",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Replica(name, f"vllm-replica-{name}", f"http://127.0.0.1:{port}", metrics_port, proc, log)


def _wait_healthy(replicas: list[Replica]) -> None:
    deadline = time.time() + 400
    waiting = list(replicas)
    while waiting:
        for r in list(waiting):
            if r.proc.poll() is not None:
                pytest.fail(f"replica {r.name} exited {r.proc.returncode}:\n{r.log.read_text()[-4000:]}")
            try:
                if httpx.get(r.base + "/health", timeout=2).status_code == 200:
                    waiting.remove(r)
            except httpx.HTTPError:
                pass
        if waiting and time.time() > deadline:
            pytest.fail(f"replicas {[r.name for r in waiting]} not ready in 400 s")
        time.sleep(1)


def _start_rotel(receiver: OTLPReceiver, work: pathlib.Path) -> tuple[subprocess.Popen, str]:
    rotel = pytest.importorskip("rotel")
    agent = pathlib.Path(rotel.__file__).parent / "rotel-agent"
    grpc_port, http_port = _distinct(_free_port), _distinct(_free_port)
    cmd = [
        str(agent),
        "start",
        "--otlp-grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--otlp-http-endpoint",
        f"127.0.0.1:{http_port}",
        "--exporter",
        "otlp",
        "--otlp-exporter-endpoint",
        receiver.grpc_endpoint,
        "--otlp-exporter-protocol",
        "grpc",
        # resource enrichment at the collector (rotel sets these on every resource, replacing
        # a value the replica set: only keys the replicas leave alone)
        "--otel-resource-attributes",
        f"deployment.environment.name={ENVIRONMENT}",
        "--traces-batch-timeout",
        "100ms",
        "--log-file",
        str(work / "rotel-agent.log"),
        "--pid-file",
        str(work / "rotel-agent.pid"),
    ]
    proc = subprocess.Popen(cmd, stdout=open(work / "rotel.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 30
    while True:  # listening once a TCP connect succeeds
        if proc.poll() is not None:
            pytest.fail(f"rotel exited {proc.returncode}: {(work / 'rotel.out').read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", grpc_port)) == 0:
                break
        if time.time() > deadline:
            pytest.fail("rotel did not listen in 30 s")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{grpc_port}"


def _start_prometheus(replicas: list[Replica], work: pathlib.Path):
    binary = _require("prometheus")
    port = _distinct(_free_port)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "llm",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{r.metrics_port + offset}"],
                        "labels": {"replica": r.name, "process": process},
                    }
                    for r in replicas
                    for offset, process in ((0, "frontend"), (1, "engine_core"))
                ],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(work / "prometheus.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    deadline = time.time() + 60
    while True:
        try:
            if client.get("/-/ready").status_code == 200:
                return proc, client
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"prometheus not ready: {(work / 'prometheus.log').read_text()[-2000:]}")
        time.sleep(0.5)


@dataclasses.dataclass
class Fleet:
    receiver: OTLPReceiver
    rotel: subprocess.Popen
    a: Replica
    b: Replica
    prom: httpx.Client
    work: pathlib.Path
    sent: dict = dataclasses.field(default_factory=dict)  # replica -> requests answered 200
    routed: list = dataclasses.field(default_factory=list)  # trace ids b received from the router


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    receiver = OTLPReceiver().start()
    procs = []
    try:
        rotel, rotel_grpc = _start_rotel(receiver, work)
        procs.append(rotel)
        a = _start_server(
            "a",
            tiny_model,
            rotel_grpc,
            work,
            {
                "OTEL_TRACES_SAMPLER": "llm_otel_adaptive",
                "OTEL_TRACES_SAMPLER_ARG": "0.5,0.5",
                "LLM_OTEL_OUTLIER_TTFT_S": "0.000001",
                "VLLM_CPU_OMP_THREADS_BIND": "0",
            },
        )
        procs.append(a.proc)
        b = _start_server("b", tiny_model, rotel_grpc, work, {"VLLM_CPU_OMP_THREADS_BIND": "1"})
        procs.append(b.proc)
        _wait_healthy([a, b])
        prom_proc, prom = _start_prometheus([a, b], work)
        procs.append(prom_proc)
        fleet = Fleet(receiver, rotel, a, b, prom, work)
        _send_traffic(fleet)
        yield fleet
        prom.close()
    finally:
        for proc in reversed(procs):
            _stop(proc)
        record_received(receiver.spans())
        receiver.stop()


def _complete(base: str, max_tokens: int, headers: dict | None = None) -> None:
    body = {"model": SERVED, "prompt": f"request {max_tokens}", "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(base + "/v1/completions", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def _send_traffic(fleet: Fleet) -> None:
    """Each request of a replica has its own max_tokens: the request span's gen_ai.request.max_tokens
    tells which request a tree belongs to."""
    for i in range(A_REQUESTS):
        _complete(fleet.a.base, 2 + i)
    for i in range(B_OWN):
        _complete(fleet.b.base, 2 + i)
    for i in range(B_ROUTED):
        # a router's trace, kept by it at 25 %: randomness >= 0xc0.. (consistent with th:c), its
        # trace id flagged random (W3C Level 2, 0x02), as OTEP 235 routers (llm-d) send it
        trace_id = secrets.token_hex(9) + "f" + secrets.token_hex(7)[:13]
        fleet.routed.append(trace_id)
        _complete(
            fleet.b.base, 2 + B_OWN + i, {"traceparent": f"00-{trace_id}-{ROUTER_SPAN}-03", "tracestate": ROUTER_STATE}
        )
    fleet.sent = {"a": A_REQUESTS, "b": B_OWN + B_ROUTED}


def _request_roots(fleet: Fleet, replica: Replica, n: int) -> dict[int, dict]:
    """max_tokens -> the request's root span, once all n have arrived."""
    spans = fleet.receiver.wait_for_spans(n, name=f"text_completion {SERVED}", timeout=60)
    roots = [s for s in spans if s["resource"].get("service.name") == replica.service]
    deadline = time.time() + 60
    while len(roots) < n and time.time() < deadline:
        time.sleep(0.5)
        roots = [
            s
            for s in fleet.receiver.spans(name=f"text_completion {SERVED}")
            if s["resource"].get("service.name") == replica.service
        ]
    by_tokens: dict[int, list] = {}
    for s in roots:
        by_tokens.setdefault(s["attributes"]["gen_ai.request.max_tokens"], []).append(s)
    assert all(len(v) == 1 for v in by_tokens.values()), f"a request arrived twice: {by_tokens}"
    return {k: v[0] for k, v in by_tokens.items()}


def _children(fleet: Fleet, root: dict, names: set[str]) -> dict[str, dict]:
    deadline = time.time() + 30
    while True:
        kids = {s["name"]: s for s in fleet.receiver.children(root)}
        if names <= set(kids) or time.time() > deadline:
            assert names <= set(kids), (
                f"{root['name']} {root['trace_id']}: children {sorted(kids)}, want {sorted(names)}"
            )
            return kids
        time.sleep(0.5)


def test_every_request_of_a_half_sampling_replica_arrives_once_with_or_without_its_threshold(fleet):
    roots = _request_roots(fleet, fleet.a, A_REQUESTS)
    assert sorted(roots) == list(range(2, 2 + A_REQUESTS))
    kinds = {"head": 0, "outlier": 0}
    for tokens, root in roots.items():
        reason = root["attributes"]["llm.sampling.reason"]
        kinds[reason] += 1
        assert root["attributes"]["gen_ai.usage.output_tokens"] == tokens
        if reason == "head":  # kept by the head decision: th:8, consistent with the trace id
            assert _threshold(root["trace_state"]) == 8 << 52, root["trace_state"]
            assert _randomness(root["trace_id"]) >= 8 << 52
            kids = _children(fleet, root, {"llm.prompt", "llm.token_stream", "llm.logit_dist"})
            assert kids["llm.logit_dist"]["resource"]["llm.process.role"] == "worker"
            assert all(k["trace_state"] == root["trace_state"] for k in kids.values())
        else:  # dropped by the head, kept at finish: no th, linked to the trace the head dropped
            assert reason == "outlier" and _threshold(root["trace_state"]) is None, root["trace_state"]
            (link,) = root["links"]
            assert _randomness(link["trace_id"]) < 8 << 52 and link["trace_id"] != root["trace_id"]
            kids = _children(fleet, root, {"llm.prompt", "llm.token_stream"})
            assert all(_threshold(k["trace_state"]) is None for k in kids.values())
        assert kids["llm.token_stream"]["attributes"]["gen_ai.usage.output_tokens"] == tokens
    assert kinds["head"] and kinds["outlier"], kinds


@pytest.mark.case("C27")
def test_an_idle_adaptive_replica_keeps_everything_and_carries_a_routers_threshold_on(fleet):
    roots = _request_roots(fleet, fleet.b, B_OWN + B_ROUTED)
    assert sorted(roots) == list(range(2, 2 + B_OWN + B_ROUTED))
    for tokens, root in roots.items():
        kids = _children(fleet, root, {"llm.prompt", "llm.token_stream", "llm.logit_dist"})
        if tokens < 2 + B_OWN:  # its own root: probability 1 while idle
            assert root["parent_span_id"] == "" and root["trace_state"] == "ot=th:0"
            assert root["attributes"]["llm.sampling.reason"] == "head"
        else:  # the router's trace and tracestate, untouched through the replica and rotel
            assert root["trace_id"] == fleet.routed[tokens - 2 - B_OWN]
            assert root["parent_span_id"] == ROUTER_SPAN and root["trace_state"] == ROUTER_STATE
            assert root["attributes"]["llm.sampling.reason"] == "parent"  # the router decided
        assert all(k["trace_state"] == root["trace_state"] for k in kids.values())


def test_step_spans_link_to_the_requests_their_batches_served(fleet):
    roots = {**_request_roots(fleet, fleet.a, A_REQUESTS)}
    heads = [r for r in roots.values() if r["attributes"]["llm.sampling.reason"] == "head"]
    heads += list(_request_roots(fleet, fleet.b, B_OWN + B_ROUTED).values())
    outlier_targets = {
        (link["trace_id"], link["span_id"])
        for r in roots.values()
        if r["attributes"]["llm.sampling.reason"] == "outlier"
        for link in r["links"]
    }
    by_context = {(r["trace_id"], r["span_id"]): r for r in heads}
    deadline = time.time() + 30
    while True:
        steps = fleet.receiver.spans(name="llm.engine.step")
        linked = {(link["trace_id"], link["span_id"]) for s in steps for link in s["links"]}
        if set(by_context) <= linked or time.time() > deadline:
            break
        time.sleep(0.5)
    assert set(by_context) <= linked, f"{len(set(by_context) - linked)} kept request(s) without a step linking to them"
    for step in steps:
        assert step["resource"]["llm.process.role"] == "engine_core"
        for link in step["links"]:
            context = (link["trace_id"], link["span_id"])
            assert context in by_context or context in outlier_targets, f"step link {context} resolves to nothing"
            if context in by_context:  # a replica's engine core links only its own requests
                assert by_context[context]["resource"]["service.name"] == step["resource"]["service.name"]


def test_resources_tell_the_replicas_and_their_processes_apart(fleet):
    _request_roots(fleet, fleet.b, B_OWN + B_ROUTED)
    seen = set()
    for span in fleet.receiver.spans():
        resource = span["resource"]
        replica = {"vllm-replica-a": "a", "vllm-replica-b": "b"}[resource["service.name"]]
        assert resource["k8s.pod.name"] == f"replica-{replica}" and resource["service.namespace"] == "fleet"
        assert resource["deployment.environment.name"] == ENVIRONMENT  # added by the collector
        seen.add((replica, resource.get("llm.process.role", "frontend")))
    assert seen == {(r, role) for r in "ab" for role in ("frontend", "engine_core", "worker")}


def _prom_value(fleet: Fleet, expr: str) -> dict[str, float]:
    return {row["metric"].get("replica", ""): float(row["value"][1]) for row in _query(fleet.prom, expr)}


def test_prometheus_counts_every_request_each_replica_served(fleet):
    want = {name: float(n) for name, n in fleet.sent.items()}
    queries = (
        'sum by (replica) (llm_server_requests_total{process="frontend"})',
        'sum by (replica) (gen_ai_server_request_duration_seconds_count{process="frontend"})',
    )
    deadline = time.time() + 30
    while True:
        got = [_prom_value(fleet, q) for q in queries]
        if all(g == want for g in got) or time.time() > deadline:
            break
        time.sleep(1)
    assert got == [want, want]  # every request, sampled or not
    services = {
        row["metric"]["replica"]: row["metric"]["service_name"]
        for row in _query(fleet.prom, 'target_info{process="frontend"}')
    }
    assert services == {"a": fleet.a.service, "b": fleet.b.service}


@pytest.mark.last_in_module  # the collector stays down
def test_a_collector_that_stops_costs_spans_not_requests(fleet):
    """Bad input: rotel stops. Requests are served as before; each process that had spans to
    export counts them in llm_otel_spans_dropped_total and logs it once."""
    _request_roots(fleet, fleet.a, A_REQUESTS)  # everything before the outage has arrived
    _stop(fleet.rotel)
    dropped = 'sum by (replica) (llm_otel_spans_dropped_total{process="frontend"})'
    history = []
    for round_ in range(2):  # two rounds: the second outage batch must not be logged again
        for i in range(DOWN_REQUESTS):  # served while the exporter retries in its own thread
            _complete(fleet.a.base, 40 + 10 * round_ + i)
        # the exporter gives up on a batch after its retries (OTLP timeout and backoff), then the
        # count reaches Prometheus at its next scrape: on a loaded CI machine that took over 40 s
        deadline = time.time() + 90
        while True:
            value = _prom_value(fleet, dropped).get("a", 0.0)
            if value > (history[-1] if history else 0.0) or time.time() > deadline:
                break
            time.sleep(1)
        history.append(value)
    assert 0 < history[0] < history[1], history
    # the engine core (its step spans of the head-kept requests) counts on its own endpoint
    engine = 'sum by (replica) (llm_otel_spans_dropped_total{process="engine_core"})'
    deadline = time.time() + 90
    while not _prom_value(fleet, engine).get("a") and time.time() < deadline:
        time.sleep(1)
    assert _prom_value(fleet, engine).get("a", 0.0) > 0
    log = fleet.a.log.read_text()
    ours = [line for line in log.splitlines() if "llm-otel: span export to" in line and "failed" in line]
    assert 1 <= len(ours) <= 3, ours  # at most once per process (frontend, engine core, worker)
    sdk = [
        line
        for line in log.splitlines()
        if "Failed to export traces" in line or re.search(r"Transient error .* exporting traces", line)
    ]
    assert not sdk, sdk[:3]
    assert httpx.get(fleet.a.base + "/health", timeout=5).status_code == 200
