"""Decision cost of llm-otel's adaptive sampler (with and without its trace budget) vs the SDK's
TraceIdRatioBased (root spans).

    .venv/bin/python benchmarks/sampler_cost.py [--n 200000]

Both measured side by side in one process, alternating, best of 5 rounds; prints ns per decision.
"""

from __future__ import annotations

import argparse
import random
import time

from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from llm_otel.gpu.nvml import UtilizationPoller
from llm_otel.sampling import TraceBudget, UtilizationPolicy, adaptive_sampler


class _Fixed:
    def read(self) -> float:
        return 0.8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    poller = UtilizationPoller(_Fixed(), alpha=1.0)
    poller.sample()
    samplers = {
        "sdk ParentBased(TraceIdRatioBased(0.25))": ParentBasedTraceIdRatio(0.25),
        "llm_otel adaptive": adaptive_sampler(UtilizationPolicy(floor=0.25, ceiling=0.25), poller=poller),
        # the trace budget on every root decision: not binding (a huge budget) and binding (10/s
        # at hundreds of thousands of decisions a second: a threshold computed per decision)
        "llm_otel adaptive + budget, not binding": adaptive_sampler(
            UtilizationPolicy(floor=0.25, ceiling=0.25), poller=poller, budget=TraceBudget(1e12)),
        "llm_otel adaptive + budget 10/s, binding": adaptive_sampler(
            UtilizationPolicy(floor=0.25, ceiling=0.25), poller=poller, budget=TraceBudget(10.0)),
    }
    ids = [random.getrandbits(128) for _ in range(args.n)]
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}
    best = {name: float("inf") for name in samplers}
    for _ in range(5):
        for name, sampler in samplers.items():
            t = time.perf_counter_ns()
            for tid in ids:
                sampler.should_sample(None, tid, "chat m", None, attrs)
            best[name] = min(best[name], (time.perf_counter_ns() - t) / len(ids))
    for name, ns in best.items():
        print(f"{name:45s} {ns:8.0f} ns/decision")
    base = best["sdk ParentBased(TraceIdRatioBased(0.25))"]
    for name in samplers:
        if name.startswith("llm_otel"):
            print(f"ratio {name}/sdk: {best[name] / base:.2f}")


if __name__ == "__main__":
    main()
