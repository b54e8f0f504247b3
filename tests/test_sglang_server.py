"""SGLang 0.5.23's real server on CPU (tests/support/sglang_server.py) under ``opentelemetry-instrument``:
every count on llm-otel's spans equals SGLang's own ``meta_info`` / ``usage`` for the same request.

One server per module (about a minute to start), the tiny random Llama, short completions. Verified
code paths: SGLang's normal scheduler loop (``--disable-overlap-schedule``; the overlap scheduler,
SGLang's GPU default, is not run on CPU), no CUDA graphs, the torch-native attention backend, one
tokenizer worker (several tokenizer workers need ``--tokenizer-worker-num`` > 1, which is not run
here). Skipped outside CI when .venv-sglang is absent; in CI .ci/install.sh makes it.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import secrets
import time

import pytest
from support import sglang_server, tools
from support.otlp_receiver import OTLPReceiver

from llm_otel.demo.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.sglang

_REASON = sglang_server.unavailable_reason()
if _REASON and not tools.in_ci():  # under CI the fixture fails instead (support/tools.py)
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    assert _REASON is None, _REASON  # in CI the environment must exist
    rx = OTLPReceiver().start()
    server = sglang_server.start(
        str(ensure_tiny_model()),
        rx.grpc_endpoint,
        tmp_path_factory.mktemp("sglang") / "server.log",
        # the serving signals (docs/signals.md): request classes from a header and the engine's
        # priority field, a tier table
        env_overrides={
            "LLM_OTEL_CLASS_HEADERS": "tenant:x-tenant-id,priority:engine:priority",
            "LLM_OTEL_TIERS": "premium tenant=acme ttft=60; standard * e2e=120",
        },
    )
    try:
        # the serving processes' exporter processes, before any request (issue 30 item 4: started
        # when the process builds its TokenizerManager / Scheduler, not with its first spans)
        server.exporters_before_requests = _exporter_parents(server.process.pid, want=2, wait_s=20)
        yield server, rx
    finally:
        server.stop()
        rx.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _request_span(rx, rid: str) -> dict:
    """The one SERVER span whose llm.request.id is SGLang's ``meta_info["id"]``."""
    deadline = time.monotonic() + 30
    while True:
        spans = [s for s in rx.spans(kind="SPAN_KIND_SERVER") if s["attributes"].get("llm.request.id") == rid]
        if spans or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(spans) == 1, f"request span of {rid}: {len(spans)}"
    return spans[0]


def _children(rx, span: dict) -> dict[str, dict]:
    rx.wait_for_spans(2, timeout=30, trace_id=span["trace_id"], parent_span_id=span["span_id"])
    return {s["name"]: s for s in rx.spans(trace_id=span["trace_id"], parent_span_id=span["span_id"])}


def test_request_tree_joins_inbound_traceparent_and_counts_equal_meta_info(served):
    server, rx = served
    traceparent, trace_id, parent_id = _traceparent()
    out = server.post(
        "/generate",
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        {"traceparent": traceparent},
    )
    meta = out["meta_info"]
    span = _request_span(rx, meta["id"])
    assert span["trace_id"] == trace_id and span["parent_span_id"] == parent_id
    attrs = span["attributes"]
    assert attrs["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == meta["completion_tokens"] == len(out["output_ids"])
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == meta["cached_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.provider.name"] == "sglang"
    kids = _children(rx, span)
    assert {"llm.prompt", "llm.token_stream"} <= set(kids)
    assert kids["llm.token_stream"]["attributes"]["gen_ai.usage.output_tokens"] == meta["completion_tokens"]
    assert span["status_code"] != "STATUS_CODE_ERROR"

    # llm.engine.step in the scheduler process, linked to this request span: the prefill step and
    # one decode step per further token (SGLang's scheduler runs one batch per token here)
    def linked() -> list[dict]:
        return [
            s
            for s in rx.spans(name="llm.engine.step")
            if any(link["span_id"] == span["span_id"] for link in s["links"])
        ]

    deadline = time.monotonic() + 30  # the scheduler process exports its step spans on its own
    while len(linked()) < meta["completion_tokens"] and time.monotonic() < deadline:
        time.sleep(0.2)
    steps = linked()
    assert len(steps) == meta["completion_tokens"]
    prefill = [s for s in steps if "llm.engine.step.prefill_tokens" in s["attributes"]]
    assert len(prefill) == 1
    assert prefill[0]["attributes"]["llm.engine.step.prefill_tokens"] == meta["prompt_tokens"] - meta["cached_tokens"]
    assert {s["resource"]["llm.process.role"] for s in steps} == {"engine_core"}
    assert span["resource"]["llm.process.role"] != "engine_core"


def test_streaming_without_traceparent_random_128_bit_trace_and_token_batches(served):
    server, rx = served
    chunks = server.stream(
        "/generate",
        {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    )
    meta = chunks[-1]["meta_info"]
    span = _request_span(rx, meta["id"])
    assert span["parent_span_id"] == ""
    assert not span["trace_id"].startswith("0" * 16)  # random 128-bit ids (SGLang's own are 64-bit)
    assert span["attributes"]["gen_ai.usage.output_tokens"] == meta["completion_tokens"] == 6
    stream = _children(rx, span)["llm.token_stream"]
    # one streamed chunk per output batch from SGLang: the first token opens llm.token_stream
    assert len(chunks) == meta["completion_tokens"]
    assert stream["start_ns"] < stream["end_ns"]


def test_n2_two_choice_spans_and_no_span_for_the_prefix_warm_up(served):
    server, rx = served
    traceparent, trace_id, _ = _traceparent()
    out = server.post(
        "/v1/completions",
        {"model": "m", "prompt": "Hello there", "max_tokens": 5, "n": 2, "temperature": 1.0},
        {"traceparent": traceparent},
    )
    rx.wait_for_spans(2, timeout=30, trace_id=trace_id, kind="SPAN_KIND_SERVER")
    spans = rx.spans(trace_id=trace_id, kind="SPAN_KIND_SERVER")
    assert sorted(s["attributes"]["llm.request.choice.index"] for s in spans) == [0, 1]
    assert sum(s["attributes"]["gen_ai.usage.output_tokens"] for s in spans) == out["usage"]["completion_tokens"]
    assert {s["attributes"]["gen_ai.usage.input_tokens"] for s in spans} == {out["usage"]["prompt_tokens"]}
    assert all(s["attributes"]["gen_ai.request.choice.count"] == 2 for s in spans)


def test_logit_dist_from_the_sampler_equals_sglangs_own_logprobs(served):
    """llm.logit_dist (the scheduler's full-vocabulary logits around SGLang's sampler, row i = request
    i of the batch) against SGLang's own log-probs of the same greedy request: one step per output
    token, the sampled token's log-prob and the top-3 log-probs equal SGLang's ``meta_info``."""
    server, rx = served
    out = server.post(
        "/generate",
        {
            "text": "1 2 3 4",
            "return_logprob": True,
            "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    )
    meta = out["meta_info"]
    span = _request_span(rx, meta["id"])
    assert span["attributes"]["gen_ai.usage.output_tokens"] == meta["completion_tokens"]
    (dist,) = rx.wait_for_spans(1, timeout=30, trace_id=span["trace_id"], name="llm.logit_dist")
    assert dist["parent_span_id"] == span["span_id"]
    assert dist["attributes"]["llm.logit.steps"] == meta["completion_tokens"] == len(meta["output_token_logprobs"])
    events = [e for e in dist["events"] if e["name"] == "llm.logit.step"]
    assert len(events) == meta["completion_tokens"]
    for event, sampled, top in zip(events, meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert event["attributes"]["llm.logit.sampled_logprob"] == pytest.approx(sampled[0], abs=1e-3)
        ours = event["attributes"]["llm.logit.top_logprobs"][:3]
        assert ours == pytest.approx([t[0] for t in top], abs=1e-3)
    (infer,) = rx.wait_for_spans(1, timeout=30, trace_id=span["trace_id"], name="llm.infer.request")
    assert infer["resource"]["llm.process.role"] == "engine_core"


def test_client_disconnect_ends_the_request_as_aborted(served):
    server, rx = served
    traceparent, trace_id, _ = _traceparent()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "text": "Tell me a long story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    conn.request(
        "POST", "/generate", json.dumps(body), {"content-type": "application/json", "traceparent": traceparent}
    )
    response = conn.getresponse()
    first = response.readline()
    assert first.startswith(b"data:")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    (span,) = rx.wait_for_spans(1, timeout=60, trace_id=trace_id, kind="SPAN_KIND_SERVER")
    assert span["attributes"].get("error.type") == "aborted"
    assert span["status_code"] == "STATUS_CODE_ERROR"
    assert 0 < span["attributes"]["gen_ai.usage.output_tokens"] < 400


def test_genai_metrics_count_every_request(served):
    server, rx = served

    def count() -> int:
        points = rx.metrics("gen_ai.server.request.duration")
        return sum(p["count"] for p in points)

    rx.wait_for_metric("gen_ai.server.request.duration", timeout=30)
    before, stable_since = count(), time.monotonic()
    while time.monotonic() - stable_since < 2.0:  # settle: earlier requests' points still arriving
        time.sleep(0.25)
        if count() != before:
            before, stable_since = count(), time.monotonic()
    for _ in range(3):
        server.post("/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 2}})
    # n=2: two choice spans, one request for the request-level metrics
    server.post("/v1/completions", {"model": "m", "prompt": "x y", "max_tokens": 2, "n": 2})
    for _ in range(150):
        if count() >= before + 4:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a fifth point would show up within two export intervals
    assert count() == before + 4


def _session_processes(session: int) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process in the server's session (Linux /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat[3]) == session:
            out[int(entry)] = (int(stat[1]), cmd)
    return out


def _exporter_parents(session: int, want: int = 0, wait_s: float = 0.0) -> list[str]:
    """Command lines of the processes in the session that have an exporter process, waiting up to
    ``wait_s`` for ``want`` of them."""
    deadline = time.monotonic() + wait_s
    while True:
        procs = _session_processes(session)
        parents = [procs.get(ppid, (0, "?"))[1] for ppid, cmd in procs.values() if "llm_otel.export.offload" in cmd]
        if len(parents) >= want or time.monotonic() >= deadline:
            return parents
        time.sleep(0.2)


def test_only_serving_processes_get_an_exporter_process(served):
    """The HTTP process and the scheduler each start llm-otel's exporter process - when they build
    their TokenizerManager / Scheduler, before any request; the detokenizer (it imports the
    TokenizerManager and Scheduler modules, constructs neither, emits nothing) has none: no
    providers, no exporter process, no hooks there."""
    server, _ = served
    early = server.exporters_before_requests
    assert len([p for p in early if "sglang::scheduler" in p]) == 1, early
    assert early.count(_session_processes(server.process.pid)[server.process.pid][1]) == 1, early  # the HTTP process
    server.post("/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 2}})
    procs = _session_processes(server.process.pid)
    parents = [procs.get(ppid, (0, "?"))[1] for ppid, cmd in procs.values() if "llm_otel.export.offload" in cmd]
    detokenizers = [cmd for _, cmd in procs.values() if "sglang::detokenizer" in cmd]
    assert len(detokenizers) == 1, procs
    assert not [p for p in parents if "sglang::detokenizer" in p], parents
    assert len([p for p in parents if "sglang::scheduler" in p]) == 1, parents
    assert len([p for p in parents if p == procs[server.process.pid][1]]) == 1, parents


def test_serving_signals_classes_tiers_slo_checks_and_kv_footprint_from_sglangs_own_fields(served):
    """Request classes from the HTTP header and SGLang's ``priority`` field, bounded (a hostile
    header value becomes ``other``); the tier's SLO checks counted; the KV footprint from SGLang's
    ModelConfig/ServerArgs (tiny Llama: 2 layers x 2 KV heads x head dim 64 x float32 x K+V = 2048 B
    per token, page size 1) equals the bytes of the tokens SGLang reports in meta_info."""
    server, rx = served

    def slo(tier: str, objective: str) -> int:
        return sum(
            p["value"]
            for p in rx.metrics("llm.server.slo.checks")
            if p["attributes"].get("llm.request.tier") == tier
            and p["attributes"].get("llm.slo.objective") == objective
            and p["attributes"].get("llm.slo.outcome") == "met"
        )

    keys = [("premium", "availability"), ("premium", "ttft"), ("standard", "e2e")]
    before, stable_since = {k: slo(*k) for k in keys}, time.monotonic()
    while time.monotonic() - stable_since < 2.0:  # settle: earlier tests' checks may still be arriving
        time.sleep(0.25)
        if {k: slo(*k) for k in keys} != before:
            before, stable_since = {k: slo(*k) for k in keys}, time.monotonic()
    body = {"text": "Hello there my friend", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    acme = server.post("/generate", {**body, "priority": 3}, {"x-tenant-id": "acme"})["meta_info"]
    hostile = server.post("/generate", body, {"x-tenant-id": 'acme"}) or 1=1 {' + "x" * 300})["meta_info"]
    spans = {m["id"]: _request_span(rx, m["id"])["attributes"] for m in (acme, hostile)}
    a, h = spans[acme["id"]], spans[hostile["id"]]
    assert (a["llm.request.tenant"], a["llm.request.priority"], a["llm.request.tier"]) == ("acme", "3", "premium")
    assert (h["llm.request.tenant"], h["llm.request.tier"]) == ("other", "standard")
    assert "llm.request.priority" not in h  # absent from the request: no dimension
    for meta, attrs in ((acme, a), (hostile, h)):
        tokens = meta["prompt_tokens"] + meta["completion_tokens"] - 1  # the last token's KV is never written
        assert attrs["llm.request.kv_cache.final_bytes"] == 2048 * tokens
        assert attrs["llm.request.kv_cache.prompt_bytes"] == 2048 * meta["prompt_tokens"]
    deadline = time.monotonic() + 30
    want = {("premium", "availability"): 1, ("premium", "ttft"): 1, ("standard", "e2e"): 1}
    while time.monotonic() < deadline and any(slo(*k) - before[k] < n for k, n in want.items()):
        time.sleep(0.2)
    assert {k: slo(*k) - before[k] for k in want} == want
    collapsed = rx.metrics("llm_otel.request_class.collapsed")
    assert any(p["attributes"].get("llm.request.class.key") == "tenant" for p in collapsed), collapsed
