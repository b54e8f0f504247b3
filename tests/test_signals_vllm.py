"""Serving signals on the real tiny vLLM engine (session ``engine`` fixture): the KV-cache
estimate against vLLM's own KV accounting, request classes from engine fields and headers, tier
SLO checks, the pressure event, token efficiency absent on CPU, and the in-process /healthz."""

from __future__ import annotations

import contextvars
import json
import time
import urllib.error
import urllib.request

import pytest
from conftest import HAS_VLLM
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from starlette.datastructures import Headers

from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.signals import Signals, SignalsConfig, kv_source_for
from llm_otel.signals.kv import KVSpec

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]

GIB = 1 << 30


def adapter_state(engine):
    adapter = engine.instrumentor.adapter
    return adapter, adapter._states[engine.llm.llm_engine.output_processor]


def points(reader, name):
    data = reader.get_metrics_data()
    return [
        p
        for rm in (data.resource_metrics if data else [])
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


def generate(engine, prompt_ids: list[int], max_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return engine.llm.generate(
        [TokensPrompt(prompt_token_ids=prompt_ids)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
        use_tqdm=False,
    )


def request_span(engine, request_id: str):
    """The request span of ``RequestOutput.request_id`` (vLLM's engine id adds a ``-suffix``)."""
    (span,) = [
        s
        for s in engine.captured.finished()
        if str(s.attributes.get(A.LLM_REQUEST_ID, "")).partition("-")[0] == request_id
    ]
    return span


@pytest.fixture
def signals(engine):
    """A Signals configured for the test, swapped into the engine's telemetry and restored after."""
    adapter, state = adapter_state(engine)
    telemetry = adapter.telemetry
    original = telemetry.signals
    made = []

    def make(env: dict) -> tuple[Signals, InMemoryMetricReader]:
        reader = InMemoryMetricReader()
        sig = Signals(
            MeterProvider(metric_readers=[reader]).get_meter("test"),
            SignalsConfig.from_env(env),
            poller=original.poller,
        )
        sig.attach_kv_source(kv_source_for(state, lambda s: s.kv))
        telemetry.signals = sig
        made.append(sig)
        return sig, reader

    yield make
    telemetry.signals = original
    for sig in made:
        sig.stop()


def test_kv_geometry_matches_the_engines_kv_pool(engine, tiny_model):
    _, state = adapter_state(engine)
    spec = state.kv
    config = json.loads((tiny_model / "config.json").read_text())
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert spec == KVSpec(
        layers=config["num_hidden_layers"],
        kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        dtype_bytes=4,
        block_size=32,
        num_blocks=cache.num_gpu_blocks,
    )
    assert spec.bytes_per_token == 2 * 2 * 2 * 64 * 4
    # vLLM sized its pool from VLLM_CPU_KVCACHE_SPACE=1 (GiB) with its own per-layer page size:
    # our bytes per block must divide that budget into exactly the blocks vLLM made
    assert cache.num_gpu_blocks == GIB // spec.bytes_per_block
    assert cache.kv_cache_size_tokens == spec.num_blocks * spec.block_size


@pytest.mark.parametrize("prompt_len", [40, 100])
def test_kv_footprint_follows_the_engines_own_block_accounting(engine, prompt_len):
    """vLLM's scheduler reports kv_cache_usage = used blocks / (pool - the null block) every step;
    for one request at step k (k tokens out) it must hold blocks(prompt + k - 1) - our formula."""
    _, state = adapter_state(engine)
    spec = state.kv
    core = engine.llm.llm_engine.engine_core
    original = core.get_output
    used_blocks = []

    def get_output(*args, **kwargs):
        out = original(*args, **kwargs)
        stats = out.scheduler_stats
        if stats is not None and stats.num_running_reqs:
            used_blocks.append(round(stats.kv_cache_usage * (spec.num_blocks - 1)))
        return out

    core.get_output = get_output
    try:
        engine.clear()
        start = 7 + prompt_len * 3  # distinct token ids per case: no prefix-cache hits
        (out,) = generate(engine, list(range(start, start + prompt_len)), 30)
    finally:
        del core.get_output
    assert len(out.outputs[0].token_ids) == 30
    # the finishing step's stats come after vLLM freed the request: 29 running steps
    assert used_blocks == [spec.blocks(prompt_len + k - 1) for k in range(1, 30)]
    span = request_span(engine, out.request_id)
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_PROMPT_BYTES] == used_blocks[0] * spec.bytes_per_block
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_FINAL_BYTES] == spec.bytes(prompt_len + 29)
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_BLOCKS] == spec.blocks(prompt_len + 29) >= max(used_blocks)
    assert span.attributes[A.LLM_REQUEST_KV_CACHE_CACHED_BLOCKS] == 0
    sizes = {
        (p.attributes[A.LLM_KV_CACHE_PHASE]) for p in engine.captured.metric_points(M.LLM_SERVER_REQUEST_KV_CACHE_SIZE)
    }
    assert sizes == {"admission", "finish"}


def test_engine_request_classes_tier_slo_checks_and_pressure_event(engine, signals):
    from llm_otel.instrumentation.vllm import inbound as vllm_inbound

    sig, reader = signals(
        {
            "LLM_OTEL_CLASS_HEADERS": "priority:engine:priority,tenant:x-tenant-id",
            "LLM_OTEL_TIERS": "premium tenant=acme ttft=120 tpot=60; standard * e2e=120",
            "LLM_OTEL_MODEL_REVISION": "stable",
            "LLM_OTEL_VRAM_WARN_HOLD_S": "0",
            "LLM_OTEL_VRAM_CRITICAL_HOLD_S": "0",
        }
    )
    engine.clear()
    # as vLLM's OpenAI handler sees it: raw_request.headers is a Starlette Headers
    inbound = vllm_inbound.Inbound(None, "text_completion", Headers({"x-tenant-id": "acme"}))

    def served():
        vllm_inbound.INBOUND.set(inbound)
        return generate(engine, [11, 12, 13, 14, 15], 4)

    (premium,) = contextvars.copy_context().run(served)
    sig.pressure.update(0.95, 0.0, "kv_cache")  # held 0 s is enough with these hold times
    (standard,) = generate(engine, [21, 22, 23, 24, 25], 4)
    a = request_span(engine, premium.request_id).attributes
    assert (
        a[A.LLM_REQUEST_TENANT],
        a[A.LLM_REQUEST_PRIORITY],
        a[A.LLM_REQUEST_TIER],
        a[A.LLM_REQUEST_MODEL_REVISION],
    ) == ("acme", "0", "premium", "stable")
    span = request_span(engine, standard.request_id)
    assert span.attributes[A.LLM_REQUEST_TIER] == "standard" and A.LLM_REQUEST_TENANT not in span.attributes
    (event,) = [e for e in span.events if e.name == "llm.vram.pressure"]
    assert event.attributes[A.LLM_VRAM_PRESSURE_LEVEL] == "critical"
    assert not [e for e in request_span(engine, premium.request_id).events if e.name == "llm.vram.pressure"]
    checks = {
        (p.attributes[A.LLM_REQUEST_TIER], p.attributes[A.LLM_SLO_OBJECTIVE], p.attributes[A.LLM_SLO_OUTCOME]): p.value
        for p in points(reader, M.LLM_SERVER_SLO_CHECKS)
    }
    assert checks == {
        ("premium", "availability", "met"): 1,
        ("premium", "ttft", "met"): 1,
        ("premium", "tpot", "met"): 1,
        ("standard", "availability", "met"): 1,
        ("standard", "e2e", "met"): 1,
    }
    tiers = {
        p.attributes.get(A.LLM_REQUEST_TIER) for p in engine.captured.metric_points(M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
    }
    assert {"premium", "standard"} <= tiers


def test_token_efficiency_is_absent_on_cpu_while_tokens_flow(engine, signals):
    sig, reader = signals({})
    generate(engine, [31, 32, 33], 8)
    assert sum(n for _, n in sig._steps) == 8  # the engine's steps were counted...
    assert sig.token_efficiency() is None  # ...but without NVML there is no GiB to divide by
    assert points(reader, M.LLM_SERVER_TOKEN_EFFICIENCY) == []
    assert sig.usage()[1] == "kv_cache"  # pressure comes from the engine's KV pool instead


def test_in_process_healthz_on_the_engine(engine, signals):
    sig, _ = signals(
        {
            "LLM_OTEL_HEALTH_PORT": "0",
            "LLM_OTEL_HEALTH_WARMUP_S": "0",
            "LLM_OTEL_HEALTH_TTFT_TARGET_S": "60",
            "LLM_OTEL_VRAM_CRITICAL_HOLD_S": "0",
        }
    )
    generate(engine, [41, 42, 43], 4)
    sig.tick()  # (the signals thread does this every second)
    url = f"http://127.0.0.1:{sig.health_server.port}/healthz"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
        assert r.status == 200
    assert body["status"] == "ok" and body["score"] == 1.0 and body["factors"]["gpu"] is None
    assert body["vram_pressure"] == "ok"  # from the KV pool, updated by the signals thread
    sig.pressure.update(1.0, time.monotonic(), "kv_cache")  # critical hold 0 s; clearing takes 30 s
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(url, timeout=10)
    assert info.value.code == 503 and "VRAM pressure critical" in json.loads(info.value.read())["reasons"]
