"""LightLLM across its processes, zero-code: every layout stand-in (tests/lightllm_layouts/) runs
whole request lives under ``opentelemetry-instrument`` - this test's child is the HTTP worker, it
spawns the router, which spawns the model-infer worker, as LightLLM does; the ``GroupReqIndexes``
and ``to_router_rpc_obj()`` tuples carrying ``MultimodalParams`` are really pickled on each hop.
All three processes export over OTLP/gRPC to the session receiver; nothing in the children is
set up by the test except the environment they inherit.

Cases C01, C02, C05, C06, C09, C10 (shared/CASES.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from lightllm_layouts.layers import build_tree

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = os.path.join(HERE, "lightllm_layouts")
MODEL = "tiny-llama"

# every test reads runs of three LightLLM processes (tens of seconds each)
pytestmark = pytest.mark.slow


def tp(i: int) -> tuple[str, str, str]:
    trace_id, span_id = f"{i:032x}", f"{i + 0xABC:016x}"
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


STOP, LENGTH, AFTER, N2 = tp(0x10), tp(0x11), tp(0x12), tp(0x13)
CONCURRENT = [tp(0x20), tp(0x21), tp(0x22)]

REQUESTS = [
    # 4 prompt tokens: the fake model ends with EOS as its 4th token
    {"name": "stop", "prompt": "a b c d", "max_new_tokens": 16, "traceparent": STOP[0]},
    # 6 prompt tokens sharing the 4-token prefix above (prefix cache hit), cut at 3 tokens
    {"name": "length", "prompt": "a b c d e f", "max_new_tokens": 3, "traceparent": LENGTH[0]},
    {"name": "n2", "prompt": "x y", "n": 2, "max_new_tokens": 8, "traceparent": N2[0]},
    # the client disconnects after 3 tokens of 11 (LightLLM: is_disconnected -> abort -> raise)
    {"name": "disconnect", "prompt": "p q r s t u v w x y z", "max_new_tokens": 40, "disconnect_after": 3},
    {"name": "after", "prompt": "g h", "max_new_tokens": 8, "traceparent": AFTER[0]},
    [
        {
            "name": f"c{i}",
            "prompt": "k l m",
            "max_new_tokens": 8,
            "traceparent": c[0],
            "path": "/v1/chat/completions" if i == 2 else "/generate",
        }
        for i, c in enumerate(CONCURRENT)
    ],
    # the consumer closes the stream after 2 tokens (GeneratorExit into generate)
    {"name": "closed", "prompt": "u v w x y z", "max_new_tokens": 30, "close_after": 2},
]
HEALTH = {"name": "health", "prompt": "h", "max_new_tokens": 1, "health": True}
POD = "pod-7d9f"  # an inherited service.instance.id (OTEL_RESOURCE_ATTRIBUTES), as in a Kubernetes pod


# A layout no LightLLM release has: main @ fc72ffab with the hooked methods renamed (definitions and
# call sites), so llm-otel finds none of them where it looks.
RENAMED = {
    "unknown": {
        "add_req": "enqueue_group",
        "transfer_to_next_module": "_forward_group",
        "abort": "cancel_group",
        "set_next_gen_token_id": "push_token",
    }
}


def run_layout(
    layout: str, receiver, tmp_path_factory, requests: list, start_args: dict | None = None, **extra_env: str
) -> dict:
    tree = build_tree(layout, tmp_path_factory.mktemp(layout))
    renames = RENAMED.get(layout, {})
    for path in (tree / "lightllm").rglob("*.py") if renames else ():
        text = path.read_text()
        for old, new in renames.items():  # `def name(` and `.name(` only: strings and comments stay
            text = re.sub(rf"(\bdef |\.){old}\(", rf"\g<1>{new}(", text)
        path.write_text(text)
    service = f"lightllm-layout-{layout}-{os.getpid()}"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        OTEL_SERVICE_NAME=service,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS="otel,process",
        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="vllm",  # not needed here, and slow to import
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        # these runs check what each process reports, not the exit deadline (tests/test_lifecycle.py
        # does): a model-infer process exports its few spans at its final flush, over a gRPC channel
        # it opens then, and on a loaded machine 2 s did not always cover that (4 spans lost, seen under load)
        LLM_OTEL_FLUSH_DEADLINE_S="10",
        LIGHTLLM_START_ARGS=json.dumps({"model_name": MODEL, "model_dir": "/models/x"}),
        **extra_env,
    )
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    done = subprocess.run(
        [
            instrument,
            sys.executable,
            os.path.join(LAYOUTS, "driver.py"),
            json.dumps({"requests": requests, "args": start_args or {}}),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=str(tree),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    assert result["router_exitcode"] == 0, done.stderr[-4000:]
    spans = [s for s in receiver.spans() if s["resource"].get("service.name") == service]
    return {"results": {r["name"]: r for r in result["results"]}, "spans": spans, "stderr": done.stderr}


class Trace:
    """The spans of one run, indexed for assertions."""

    def __init__(self, run: dict) -> None:
        self.run = run
        self.spans = run["spans"]
        self.by_id = {s["span_id"]: s for s in self.spans}

    def named(self, name: str, **attrs) -> list[dict]:
        return [
            s for s in self.spans if s["name"] == name and all(s["attributes"].get(k) == v for k, v in attrs.items())
        ]

    def requests(self, request_id: str) -> list[dict]:
        return [
            s
            for s in self.spans
            if s["name"] in (f"text_completion {MODEL}", f"chat {MODEL}")
            and s["attributes"].get("llm.request.id") == request_id
        ]

    def children(self, span: dict, name: str) -> list[dict]:
        return [s for s in self.spans if s["parent_span_id"] == span["span_id"] and s["name"] == name]

    def tree(self, request_id: str) -> dict:
        (req,) = self.requests(request_id)
        out = {"request": req}
        for name in ("llm.prompt", "llm.token_stream", "llm.router.request", "llm.infer.request"):
            found = self.children(req, name)
            assert len(found) <= 1, name
            out[name] = found[0] if found else None
        return out


def request_id(run: dict, name: str, choice: int = 0) -> str:
    return (
        str(run["results"][name]["tokens"][0][0] - run["results"][name]["tokens"][0][0] % 8 + choice)
        if run["results"][name]["tokens"]
        else None
    )


def event_time(span: dict, name: str) -> int:
    (ev,) = [e for e in span["events"] if e["name"] == name]
    return ev["time_ns"]


@pytest.fixture(scope="module")
def main_run(receiver, tmp_path_factory):
    # every sampled request gets llm.logit_dist from the worker's logits
    # (with content capture on: token ids decode back to the text, so they are content)
    return run_layout(
        "main",
        receiver,
        tmp_path_factory,
        REQUESTS + [HEALTH],
        LLM_OTEL_LOGIT_DIST_RATIO="1",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
    )


@pytest.fixture(scope="module")
def runs(receiver, tmp_path_factory, main_run):
    out = {"main": main_run}
    # v1.0.x: logit distributions from its own post_process.sample; a step-span budget of one span
    # per 1000 s leaves exactly the first burst token (capacity 1) for this run of dozens of steps
    out["v1_0"] = run_layout(
        "v1_0",
        receiver,
        tmp_path_factory,
        REQUESTS[:2] + [HEALTH],
        LLM_OTEL_LOGIT_DIST_RATIO="1",
        LLM_OTEL_STEP_SPANS_PER_S="0.001",
    )
    out["pr965"] = run_layout(
        "pr965",
        receiver,
        tmp_path_factory,
        REQUESTS[:2] + [HEALTH],
        OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={POD}",
    )
    # v1.0.0 with two model-infer processes (TP 2): every rank samples and sets tokens there
    out["v1_0_0"] = run_layout(
        "v1_0_0",
        receiver,
        tmp_path_factory,
        REQUESTS[:2],
        start_args={"tp": 2},
        LLM_OTEL_LOGIT_DIST_RATIO="1",
        OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={POD}",
    )
    return out


# --- C01: the tree covers the request from arrival; queue, prefill and decode separable ------
@pytest.mark.case("C01")
def test_request_span_tree_spans_three_processes_and_covers_the_request(main_run):
    t = Trace(main_run)
    tree = t.tree(request_id(main_run, "stop"))
    req = tree["request"]
    assert req["kind"] == "SPAN_KIND_SERVER"
    assert (req["trace_id"], req["parent_span_id"]) == (STOP[1], STOP[2])  # joined to the inbound traceparent
    for name in ("llm.prompt", "llm.token_stream", "llm.router.request", "llm.infer.request"):
        assert tree[name] is not None, name
        assert tree[name]["trace_id"] == STOP[1]
    # one process each: HTTP worker (this test's child), router (its child), model-infer worker (grandchild)
    pids = {
        name: tree[name]["resource"]["process.pid"] for name in ("request", "llm.router.request", "llm.infer.request")
    }
    assert len(set(pids.values())) == 3
    # and each process's resource has its own service.instance.id (process/identity.py)
    instances = {
        tree[name]["resource"]["service.instance.id"] for name in ("request", "llm.router.request", "llm.infer.request")
    }
    assert len(instances) == 3
    prompt, stream, router, infer = (
        tree[n] for n in ("llm.prompt", "llm.token_stream", "llm.router.request", "llm.infer.request")
    )
    # order of a request's life, across processes (one host clock)
    queued, scheduled = event_time(router, "llm.request.queued"), event_time(router, "llm.request.scheduled")
    first_engine_token = min(e["time_ns"] for e in infer["events"] if e["name"] == "llm.token")
    assert (
        req["start_ns"]
        == prompt["start_ns"]
        <= router["start_ns"]
        == queued
        <= scheduled
        <= infer["start_ns"]
        <= first_engine_token
        <= prompt["end_ns"]
        == stream["start_ns"]
        <= stream["end_ns"]
        <= req["end_ns"]
    )
    assert infer["end_ns"] <= router["end_ns"]
    covered = (prompt["end_ns"] - prompt["start_ns"]) + (stream["end_ns"] - stream["start_ns"])
    assert covered >= 0.9 * (req["end_ns"] - req["start_ns"])
    # queue, prefill and decode are separate numbers
    assert router["attributes"]["llm.request.queue.duration"] == pytest.approx((scheduled - queued) / 1e9)
    assert router["attributes"]["llm.request.frontend.duration"] >= 0
    assert infer["attributes"]["llm.request.prefill.duration"] == pytest.approx(
        (first_engine_token - infer["start_ns"]) / 1e9
    )
    assert infer["attributes"]["llm.request.decode.duration"] > 0
    # per-token timing and the sampled log-probs from the worker
    tokens = [e for e in infer["events"] if e["name"] == "llm.token"]
    assert [e["attributes"]["llm.token.id"] for e in tokens] == [100, 101, 102, 2]
    assert [e["attributes"]["llm.token.index"] for e in tokens] == [0, 1, 2, 3]
    assert infer["attributes"]["llm.logit.perplexity"] == pytest.approx(
        2.718281828**0.25, rel=1e-5
    )  # mean logprob -0.25
    assert [e["attributes"]["llm.token.id"] for e in stream["events"] if e["name"] == "llm.token"] == [100, 101, 102, 2]


def test_logit_dist_from_the_workers_full_vocabulary_logits(main_run):
    t = Trace(main_run)
    (req,) = t.requests(request_id(main_run, "stop"))
    (dist,) = t.children(req, "llm.logit_dist")
    assert (
        dist["resource"]["process.pid"]
        == t.tree(request_id(main_run, "stop"))["llm.infer.request"]["resource"]["process.pid"]
    )
    attrs = dist["attributes"]
    assert (attrs["llm.logit.source"], attrs["llm.logit.steps"], attrs["llm.logit.top_k"]) == (
        "full_vocab_logits",
        4,
        5,
    )
    assert attrs["llm.logit.nonfinite_steps"] == 0
    steps = [e for e in dist["events"] if e["name"] == "llm.logit.step"]
    # the sampled token leads each step's top-k; its log-prob is the fake model's -0.1 * (k + 1)
    assert [e["attributes"]["llm.logit.top_token_ids"][0] for e in steps] == [100, 101, 102, 2]
    assert [e["attributes"]["llm.logit.sampled_logprob"] for e in steps] == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4], abs=1e-5
    )
    assert attrs["llm.logit.perplexity"] == pytest.approx(2.718281828**0.25, rel=1e-4)
    assert all(e["attributes"]["llm.logit.entropy"] > 0 for e in steps)


@pytest.mark.case("C01")
def test_router_steps_are_linked_not_parented(main_run):
    t = Trace(main_run)
    (req,) = t.requests(request_id(main_run, "stop"))
    steps = [s for s in t.named("llm.engine.step") if any(l["span_id"] == req["span_id"] for l in s["links"])]
    assert steps and all(s["trace_id"] != STOP[1] and s["parent_span_id"] == "" for s in steps)
    assert all(s["attributes"]["llm.engine.step.batch_size"] >= 1 for s in steps)


# --- C09: token counts are the engine's -----------------------------------------------------
@pytest.mark.parametrize(
    "name, input_tokens, output_tokens, cached, reason",
    [
        ("stop", 4, 4, 0, "stop"),
        ("length", 6, 3, 4, "length"),
        ("after", 2, 2, None, "stop"),
    ],
)
@pytest.mark.case("C09")
def test_token_counts_are_the_engine_counts_in_every_process(
    main_run, name, input_tokens, output_tokens, cached, reason
):
    assert len(main_run["results"][name]["tokens"]) == output_tokens
    tree = Trace(main_run).tree(request_id(main_run, name))
    for span in ("request", "llm.router.request", "llm.infer.request"):
        attrs = tree[span]["attributes"]
        assert attrs["gen_ai.usage.input_tokens"] == input_tokens, span
        assert attrs["gen_ai.usage.output_tokens"] == output_tokens, span
        assert attrs["gen_ai.response.finish_reasons"] == [reason], span
        if cached is not None:
            assert attrs["gen_ai.usage.cache_read.input_tokens"] == cached, span
    assert tree["llm.token_stream"]["attributes"]["gen_ai.usage.output_tokens"] == output_tokens


@pytest.mark.case("C09")
def test_each_choice_of_n2_has_its_own_span_tree(main_run):
    t = Trace(main_run)
    first = request_id(main_run, "n2")
    roots = []
    for choice in (0, 1):
        tree = t.tree(str(int(first) + choice))
        roots.append(tree["request"])
        assert tree["request"]["attributes"]["llm.request.choice.index"] == choice
        assert tree["request"]["attributes"]["gen_ai.request.choice.count"] == 2
        assert tree["request"]["attributes"]["gen_ai.usage.output_tokens"] == 2
        assert tree["llm.router.request"]["attributes"]["llm.request.id"] == str(int(first) + choice)
        assert tree["llm.infer.request"]["attributes"]["gen_ai.usage.output_tokens"] == 2
    # both choices answer one inbound request: one trace, siblings under the caller's span
    assert {(r["trace_id"], r["parent_span_id"]) for r in roots} == {(N2[1], N2[2])}


# --- C02: abort / disconnect mid-decode ------------------------------------------------------
@pytest.mark.case("C02")
def test_client_disconnect_ends_every_stage_with_error_and_partial_counts(main_run):
    assert main_run["results"]["disconnect"]["error"].endswith("disconnected")
    tree = Trace(main_run).tree(request_id(main_run, "disconnect"))
    req = tree["request"]
    assert req["status_code"] == "STATUS_CODE_ERROR"
    assert req["attributes"]["error.type"] == "aborted"
    assert req["attributes"]["gen_ai.usage.output_tokens"] == 3  # what reached the client
    assert tree["llm.token_stream"]["attributes"]["error.type"] == "aborted"
    for stage in ("llm.router.request", "llm.infer.request"):
        assert tree[stage]["attributes"]["error.type"] == "aborted", stage
        assert tree[stage]["status_code"] == "STATUS_CODE_ERROR", stage
        assert 3 <= tree[stage]["attributes"]["gen_ai.usage.output_tokens"] < 11, stage  # stopped early


@pytest.mark.case("C02")
def test_the_engine_keeps_serving_and_the_next_request_is_traced(main_run):
    assert len(main_run["results"]["after"]["tokens"]) == 2
    tree = Trace(main_run).tree(request_id(main_run, "after"))
    assert tree["request"]["trace_id"] == AFTER[1]
    assert "error.type" not in tree["request"]["attributes"]
    assert all(tree[n] is not None for n in ("llm.router.request", "llm.infer.request"))


@pytest.mark.case("C02")
def test_a_consumer_closing_the_stream_ends_the_request_span_as_aborted(main_run):
    assert len(main_run["results"]["closed"]["tokens"]) == 2
    tree = Trace(main_run).tree(request_id(main_run, "closed"))
    assert tree["request"]["attributes"]["error.type"] == "aborted"
    assert tree["request"]["attributes"]["gen_ai.usage.output_tokens"] == 2
    # LightLLM itself only stops on is_disconnected(); the engine side finished the request
    assert tree["llm.infer.request"]["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]


@pytest.mark.parametrize("layout", ["main", "v1_0"])
def test_health_probes_are_not_traced(runs, layout):
    """LightLLM's own health check (GET /health) sends a probe through every process: main marks it
    (is_health_req, a negative id); v1.0.x does not (an ordinary positive id from the same
    generator), so only the health_check call site tells it apart. Neither becomes a trace."""
    run = runs[layout]
    assert run["results"]["health"]["healthy"] is True  # the probe came back through router and worker
    served = {
        str(tokens[0] - tokens[0] % 8 + i)
        for r in run["results"].values()
        for tokens in r["tokens"][:1]
        for i in range(8)
    }
    ids = {s["attributes"].get("llm.request.id") for s in run["spans"]} - {None}
    assert ids and ids <= served, ids - served  # every traced id is one of the clients' requests
    assert not any(i.startswith("-") for i in ids)
    names = {s["name"] for s in run["spans"]}
    assert names <= {
        f"text_completion {MODEL}",
        f"chat {MODEL}",
        "llm.prompt",
        "llm.token_stream",
        "llm.router.request",
        "llm.infer.request",
        "llm.engine.step",
        "llm.logit_dist",
    }, names


# --- C10: concurrent requests keep their own parents, no context errors ----------------------
@pytest.mark.case("C10")
def test_concurrent_requests_each_get_their_own_trace_and_parents(main_run):
    t = Trace(main_run)
    for (traceparent, trace_id, span_id), name in zip(CONCURRENT, ("c0", "c1", "c2")):
        tree = t.tree(request_id(main_run, name))
        assert (tree["request"]["trace_id"], tree["request"]["parent_span_id"]) == (trace_id, span_id)
        for stage in ("llm.prompt", "llm.token_stream", "llm.router.request", "llm.infer.request"):
            assert tree[stage]["trace_id"] == trace_id, stage
        assert tree["request"]["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert Trace(main_run).requests(request_id(main_run, "c2"))[0]["name"] == f"chat {MODEL}"
    assert "Failed to detach context" not in main_run["stderr"]
    assert "Traceback" not in main_run["stderr"]


# --- C06: each known layout resolves and traces the whole life -------------------------------
@pytest.mark.parametrize("layout", ["main", "v1_0", "pr965"])
@pytest.mark.case("C06")
def test_each_known_layout_traces_the_full_tree_without_warnings(runs, layout):
    run = runs[layout]
    assert "unknown layout" not in run["stderr"] and "not found" not in run["stderr"]
    t = Trace(run)
    for name, (_, trace_id, _span), n_in, n_out in (("stop", STOP, 4, 4), ("length", LENGTH, 6, 3)):
        tree = t.tree(request_id(run, name))
        assert tree["request"]["trace_id"] == trace_id
        for stage in ("llm.prompt", "llm.token_stream", "llm.router.request", "llm.infer.request"):
            assert tree[stage] is not None, (layout, stage)
        assert tree["llm.infer.request"]["attributes"]["gen_ai.usage.output_tokens"] == n_out
        assert tree["llm.router.request"]["attributes"]["gen_ai.usage.input_tokens"] == n_in
    # the router drives steps in main and v1.0; in PR #965 the workers step on their own
    assert bool(t.named("llm.engine.step")) == (layout != "pr965")


def test_v1_0_logit_dist_from_its_post_process_sample(runs):
    """v1.0.x has no mode_backend/generic_post_process.py: sample lives in
    continues_batch/post_process.py, and the hook there gives the same llm.logit_dist."""
    t = Trace(runs["v1_0"])
    (req,) = t.requests(request_id(runs["v1_0"], "stop"))
    (dist,) = t.children(req, "llm.logit_dist")
    assert dist["attributes"]["llm.logit.steps"] == 4
    steps = [e for e in dist["events"] if e["name"] == "llm.logit.step"]
    assert [e["attributes"]["llm.logit.sampled_logprob"] for e in steps] == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4], abs=1e-5
    )


def test_router_step_spans_honour_the_step_span_budget(runs):
    """LLM_OTEL_STEP_SPANS_PER_S (the vLLM engine core's token bucket): with 0.001/s the v1.0 run's
    router, which steps once per generated token (more than 9 steps here), emits one step span;
    main's default (10/s) emits more than one."""
    assert len(Trace(runs["v1_0"]).named("llm.engine.step")) == 1
    assert len(Trace(runs["main"]).named("llm.engine.step")) > 1


# --- C05: an unknown layout: one warning per process naming what is missing ------------------
@pytest.mark.case("C05")
def test_unknown_layout_warns_once_per_process_and_http_spans_still_work(receiver, tmp_path_factory):
    run = run_layout("unknown", receiver, tmp_path_factory, REQUESTS[:1])
    # an unrecognised module: one warning listing what it lacks; a module whose layout was
    # recognised (infer_batch still looks like main) but lacks a target: one warning naming it
    warnings = [line for line in run["stderr"].splitlines() if line.startswith("llm-otel: LightLLM module")]
    http = [w for w in warnings if "httpserver.manager" in w]
    router = [w for w in warnings if "router.manager" in w]
    infer = [w for w in warnings if "infer_batch" in w]
    # one warning in each process that imports a module of unknown shape: the HTTP process (which
    # also imports the router module to start the router, as LightLLM's launcher does), the router
    # (which imports the worker module to spawn the worker) and the worker
    assert (len(http), len(router), len(infer)) == (1, 2, 2), run["stderr"][-3000:]
    assert len(warnings) == 5
    # and nothing else from llm-otel (no other instrumentor's hook-target noise)
    assert [line for line in run["stderr"].splitlines() if "llm-otel" in line] == warnings, run["stderr"][-3000:]
    assert "HttpServerManager.transfer_to_next_module" in http[0] and "HttpServerManager.abort" in http[0]
    assert "RouterManager.add_req" in router[0] and "RouterManager._add_req" in router[0]
    assert "InferReq.set_next_gen_token_id" in infer[0]
    assert "Traceback" not in run["stderr"]
    assert len(run["results"]["stop"]["tokens"]) == 4
    tree = Trace(run).tree(request_id(run, "stop"))
    assert tree["request"]["trace_id"] == STOP[1]
    assert tree["request"]["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert tree["request"]["attributes"]["gen_ai.usage.input_tokens"] == 4  # from the yielded metadata
    assert tree["llm.prompt"] is not None and tree["llm.token_stream"] is not None
    # without the transfer hook no carrier crossed: the other stages are simply not traced
    assert not Trace(run).named("llm.router.request") and not Trace(run).named("llm.infer.request")


def test_token_ids_stay_out_of_spans_without_content_capture(runs):
    """The v1.0 and router-refactor runs have content capture off (the default): their worker and
    HTTP token events carry index and latency, never the token id."""
    for layout in ("v1_0", "pr965"):
        events = [e for span in runs[layout]["spans"] for e in span["events"] if e["name"] == "llm.token"]
        assert events, layout
        assert all("llm.token.id" not in e["attributes"] for e in events), layout
        assert all("llm.token.latency" in e["attributes"] for e in events), layout


# --- process identity: each LightLLM process says which one it is (process/identity.py) --------
ROUTER_TARGET = "lightllm.server.router.manager:start_router_process"
WORKER_TARGET = "lightllm.server.router.model_infer.model_rpc:_init_env"
IDENTITY = (
    "llm.process.role",
    "process.pid",
    "service.instance.id",
    "llm.process.name",
    "llm.process.tensor_parallel.rank",
    "llm.process.data_parallel.rank",
    "llm.process.inherited_instance_id",
)


def identities(run: dict) -> dict[str, dict]:
    """span name -> the identity part of the resource of the process that made it (one each)."""
    out: dict[str, set] = {}
    for span in run["spans"]:
        out.setdefault(span["name"], set()).add(tuple((k, span["resource"].get(k)) for k in IDENTITY))
    for name, found in out.items():
        assert len(found) == 1 or name in ("llm.infer.request", "llm.logit_dist"), (name, found)
    return {name: dict(sorted(found)[0]) for name, found in out.items()}


@pytest.mark.parametrize("layout", ["main", "v1_0", "pr965", "v1_0_0"])
def test_each_lightllm_process_reports_its_own_role_pid_and_instance(runs, layout):
    """The HTTP worker is the frontend, the router says router (and which LightLLM function it runs),
    the model-infer process says worker with its TP and DP rank - each with its own pid and
    service.instance.id, derived from the pod's where OTEL_RESOURCE_ATTRIBUTES sets one."""
    run = runs[layout]
    ids = identities(run)
    http, router, worker = ids[f"text_completion {MODEL}"], ids["llm.router.request"], ids["llm.infer.request"]
    assert ids["llm.prompt"] == ids["llm.token_stream"] == http
    assert http["llm.process.role"] == "frontend"
    assert (router["llm.process.role"], router["llm.process.name"]) == ("router", ROUTER_TARGET)
    assert (worker["llm.process.role"], worker["llm.process.name"]) == ("worker", WORKER_TARGET)
    assert (worker["llm.process.tensor_parallel.rank"], worker["llm.process.data_parallel.rank"]) == (0, 0)
    for proc in (http, router):
        assert proc["llm.process.tensor_parallel.rank"] is None and proc["llm.process.data_parallel.rank"] is None
    assert len({p["process.pid"] for p in (http, router, worker)}) == 3
    assert len({p["service.instance.id"] for p in (http, router, worker)}) == 3
    if layout in ("pr965", "v1_0_0"):  # <inherited>/<role>[.dp<r>][.tp<r>].<pid>
        assert http["service.instance.id"] == f"{POD}/frontend.{http['process.pid']}"
        assert router["service.instance.id"] == f"{POD}/router.{router['process.pid']}"
        assert worker["service.instance.id"] == f"{POD}/worker.dp0.tp0.{worker['process.pid']}"
        assert {p["llm.process.inherited_instance_id"] for p in (http, router, worker)} == {POD}
    else:  # a UUID v4 per process
        assert all(re.fullmatch(r"[0-9a-f-]{36}", p["service.instance.id"]) for p in (http, router, worker))
    if layout in ("main", "v1_0"):  # the router's step spans carry the router's resource
        assert ids["llm.engine.step"] == router


def test_v1_0_0_only_the_master_rank_emits_worker_spans(runs):
    """LightLLM v1.0.0 runs sampling and set_next_gen_token_id on every TP rank and has no
    get_current_rank_in_dp; only rank 0 (tp_rank < dp_size: the rank whose results it writes to
    shared memory) reports: one llm.infer.request and one llm.logit_dist per request, from rank 0."""
    run = runs["v1_0_0"]
    t = Trace(run)
    for name, n_out in (("stop", 4), ("length", 3)):
        assert len(run["results"][name]["tokens"]) == n_out
        (req,) = t.requests(request_id(run, name))
        infer = t.children(req, "llm.infer.request")
        dist = t.children(req, "llm.logit_dist")
        assert len(infer) == 1 and len(dist) == 1, (name, len(infer), len(dist))
        assert infer[0]["attributes"]["gen_ai.usage.output_tokens"] == n_out
        for span in infer + dist:
            assert span["resource"]["llm.process.role"] == "worker"
            assert span["resource"]["llm.process.tensor_parallel.rank"] == 0
    assert {
        s["resource"]["llm.process.tensor_parallel.rank"]
        for s in run["spans"]
        if s["name"] in ("llm.infer.request", "llm.logit_dist")
    } == {0}
