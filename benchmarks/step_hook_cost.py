"""Caller-side cost of the vLLM step hook's own passes over a step's outputs (the
``OutputProcessor.process_outputs`` wrapper of :mod:`llm_otel.instrumentation.vllm.adapter`: events,
cached tokens, tokens), in us per request over 64 steps with 256 live traced requests; no engine, no
finish (``Telemetry.finish`` is ``frontend_parts.py``'s part). The outputs are plain objects with
the ``EngineCoreOutput`` fields the hook reads; best of 7 passes.

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/step_hook_cost.py

Compare checkouts by running it with each one's ``src`` on PYTHONPATH: before issue 19's last cuts
the hook made a pass before vLLM's (returning (record, output) pairs) and one after; now one pass
after, and a pass before only while a request keeps log-probs in the frontend. Both forms are run
as that checkout's wrapper calls them.
"""

from __future__ import annotations

import logging
import os
import time


class Output:
    """The ``EngineCoreOutput`` fields the step hook reads (vllm/v1/engine/__init__.py)."""

    __slots__ = ("request_id", "new_token_ids", "events", "prefill_stats", "new_logprobs", "finish_reason")

    def __init__(self, request_id: str, token: int) -> None:
        self.request_id, self.new_token_ids, self.events, self.prefill_stats = request_id, [token], None, None
        self.new_logprobs = self.finish_reason = None


class OutputProcessor:
    """Stands in for vLLM's ``OutputProcessor``: every request still live (no finish)."""

    def __init__(self) -> None:
        self.request_states: dict = {}


def run(adapter, telemetry, two_passes: bool, n: int = 256, steps: int = 64) -> float:
    processor = OutputProcessor()
    state = adapter._state_for(processor)  # noqa: SLF001 - the per-engine state the hook reads
    now = time.time()
    for i in range(n):
        rid = f"r{i}"
        state.records[rid] = telemetry.start_request(rid, operation="text_completion", provider="vllm", model="m",
                                                     arrival_s=now, input_tokens=8)
        processor.request_states[rid] = True
    outputs = [[Output(rid, k) for rid in state.records] for k in range(steps)]
    mono = time.monotonic()
    t = time.perf_counter()
    for k in range(steps):
        ts = mono + k * 1e-3
        if two_passes:  # main before the last cuts: pairs from the pass before vLLM, then the pass after
            adapter._after_step(state, processor, adapter._before_step(state, outputs[k], ts), ts)  # noqa: SLF001
        else:
            adapter._after_step(state, processor, outputs[k], adapter._before_step(state, outputs[k], ts))  # noqa: SLF001
    dt = time.perf_counter() - t
    state.records.clear()
    return dt / n * 1e6


def main() -> None:
    os.environ.update(LLM_OTEL_EXPORT_PROCESS="true", OTEL_TRACES_SAMPLER="always_on",
                      OTEL_METRIC_EXPORT_INTERVAL="600000", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    logging.getLogger("llm_otel").setLevel(logging.ERROR)  # the synthetic stamps' clock-domain line
    from llm_otel.config import Settings
    from llm_otel.export.offload import request_outlets
    from llm_otel.process.providers import build_providers
    from llm_otel.instrumentation.vllm.adapter import VLLMAdapter
    from llm_otel.telemetry import Telemetry

    tp, mp = build_providers(Settings.from_env(), shutdown_on_exit=False)
    telemetry = Telemetry(tp, mp, outlets=request_outlets(tp, mp))  # as instrument() wires it
    tp.buffer._lock.acquire()  # noqa: SLF001 - nothing is sent: the caller side alone is timed
    adapter = VLLMAdapter(telemetry)
    two_passes = "pending" in adapter._after_step.__code__.co_varnames  # noqa: SLF001
    run(adapter, telemetry, two_passes)
    best = min(run(adapter, telemetry, two_passes) for _ in range(7))
    print(f"step hook us per request (64 steps, 256 live requests, {'two passes' if two_passes else 'one pass'}): "
          f"{best:.1f}")
    os._exit(0)  # the held writer and the exporter process are not waited for


if __name__ == "__main__":
    main()
