"""Cost of the serving signals (docs/signals.md) on the paths the engine touches.

    .venv/bin/python benchmarks/signals_cost.py [--n 20000]

Per request: classify (two class headers in a Starlette ``Headers`` of four, tier lookup) +
admit (KV estimate, histogram) + finish (KV, SLO-check counters, health window), minus building
the RequestRecord itself. Per engine step: ``on_tokens``. Off the engine's path (signals thread /
metric collection): the health score over a full window and one pressure tick over 1000 live
requests. Best of 5 rounds.
"""

from __future__ import annotations

import argparse
import time
import timeit

from opentelemetry.sdk.metrics import MeterProvider
from starlette.datastructures import Headers

from llm_otel.gpu.nvml import UtilizationPoller
from llm_otel.signals import Signals, SignalsConfig, kv_source_for
from llm_otel.signals.kv import KVSpec
from llm_otel.telemetry.record import RequestRecord


def best(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20000)
    n = parser.parse_args().n
    cfg = SignalsConfig.from_env({"LLM_OTEL_CLASS_HEADERS": "tenant:x-tenant-id,priority:x-priority",
                                  "LLM_OTEL_TIERS": "premium tenant=acme ttft=0.3 tpot=0.05; free * ttft=1.2"})
    signals = Signals(MeterProvider().get_meter("bench"), cfg, poller=UtilizationPoller(None))
    headers = Headers({"x-tenant-id": "acme", "x-priority": "high", "user-agent": "bench",
                       "content-type": "application/json"})
    spec = KVSpec(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16, num_blocks=100_000)

    def record() -> RequestRecord:
        return RequestRecord("r", operation="chat", provider="vllm", model="m", arrival_s=time.time(), input_tokens=500)

    def request() -> None:
        rec = record()
        _, labels, tier = signals.classify(headers, None)
        signals.admit(rec, labels, tier, spec)
        rec.on_tokens([1], time.monotonic())
        rec.on_tokens([2], time.monotonic())
        signals.on_finish(rec, 0.5)

    print(f"classify:                            {best(lambda: signals.classify(headers, None), n) * 1e6:8.2f} us/request")
    print(f"classify + admit + finish:           {(best(request, n) - best(record, n)) * 1e6:8.2f} us/request")
    print(f"on_tokens:                           {best(lambda: signals.on_tokens(64, 1.0), n * 10) * 1e9:8.0f} ns/step")
    for _ in range(4096):
        signals.health.observe(0.1, False)
    print(f"health score, 4096 requests:         {best(signals.health.compute, 50) * 1e3:8.2f} ms/collection")

    class Owner:
        records = {str(i): RequestRecord(str(i), operation="chat", provider="vllm", model="m", arrival_s=0,
                                         input_tokens=700) for i in range(1000)}
        kv = spec

    owner = Owner()  # kv_source_for holds it weakly
    signals._kv_sources.append(kv_source_for(owner, lambda o: o.kv))
    print(f"pressure tick, 1000 live requests:   {best(signals.tick, 50) * 1e3:8.3f} ms/s (signals thread)")


if __name__ == "__main__":
    main()
