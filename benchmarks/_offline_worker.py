"""One configuration of the offline overhead benchmark, in its own process (see overhead.py).

Builds a vLLM ``LLM`` on the tiny model, instrumented as configuration ``--config`` says, prints
``{"ready": true}``, then answers each ``run`` line on stdin with one JSON line
``{"output_tokens": N, "seconds": S}`` for one pass of the fixed workload; ``quit`` flushes the
telemetry and exits. The workload is fixed by ``--prompts``/``--tokens`` and the engine seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _workload


def build(config: str, model: str, sink: str):
    """The engine for ``config`` (a..g), instrumented the way a user of that tool would do it."""
    from vllm import LLM

    kwargs = dict(model=model, dtype="float32", max_model_len=_workload.MAX_MODEL_LEN, seed=0,
                  block_size=32)
    if config in ("b", "c", "f", "g"):
        import llm_otel  # providers from OTEL_* (OTLP gRPC to the sink), set by overhead.py

        llm_otel.instrument()
    elif config == "d":
        # vLLM's own tracing: one span per finished request, built from the iteration stats it
        # only keeps with log stats on
        kwargs.update(otlp_traces_endpoint=sink, disable_log_stats=False)
    elif config == "e":
        import openlit

        openlit.init(otlp_endpoint=sink, disable_metrics=False, collect_system_metrics=False)
    return LLM(**kwargs)


def _group(child) -> str:
    """``exporter`` for llm-otel's span exporter process (``python -m llm_otel.export.offload``,
    a child of the frontend that is not part of the engine), else ``engine``."""
    try:
        return "exporter" if "llm_otel.export.offload" in child.cmdline() else "engine"
    except Exception:  # noqa: BLE001 - exited meanwhile
        return "engine"


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process ("frontend") and by its child
    processes ("engine": vLLM's engine core and anything it started; "exporter": llm-otel's span
    exporter process), all threads included."""
    import psutil

    me = psutil.Process()
    out = {"frontend": sum(me.cpu_times()[:2]), "engine": 0.0, "exporter": 0.0}
    for child in me.children(recursive=True):
        try:
            out[_group(child)] += sum(child.cpu_times()[:2])
        except psutil.Error:  # a helper process that just exited
            pass
    return out


def head_probability() -> float | None:
    """The probability that this process's tracer provider keeps a new root trace now (llm-otel's
    adaptive sampler follows engine occupancy on CPU hosts); None for a provider we cannot read."""
    from opentelemetry import trace

    from llm_otel.telemetry.metrics import sampling_probability_reader

    read = sampling_probability_reader(getattr(trace.get_tracer_provider(), "sampler", None))
    return None if read is None else read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--sink", required=True, help="OTLP gRPC endpoint of the sink")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    llm = build(args.config, args.model, args.sink)
    prompts, params = _workload.offline(args.prompts, args.tokens)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        p_start = head_probability()  # what this pass's requests are decided at (all added at once)
        cpu0 = cpu_seconds()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds().items()}
        print(json.dumps({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt,
                          "cpu_s": cpu, "head_p": [p_start, head_probability()]}), flush=True)
    from opentelemetry import metrics, trace

    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        flush = getattr(provider, "force_flush", None)
        if flush:
            flush()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
