"""A tiny vLLM engine serving Prometheus metrics the way an operator would run it: configured only
through the environment (``OTEL_METRICS_EXPORTER=prometheus``, ``OTEL_EXPORTER_PROMETHEUS_PORT``)
and ``llm_otel.instrument()``. Used by tests/test_ops_live.py as a subprocess.

Usage: python ops_engine_app.py MODEL_DIR. Prints ``READY`` after the first batch, then keeps
generating (shared-prefix prompts, so the prefix cache hits; one over-long prompt per round, which
vLLM rejects) until its standard input closes.
"""

from __future__ import annotations

import os
import sys
import threading


def main() -> int:
    from vllm import LLM, SamplingParams

    import llm_otel

    llm_otel.instrument()
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0, block_size=32, enable_prefix_caching=True)
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    shared = "def handler(request, context):\n    " * 12  # > 2 blocks of 32 tokens shared by all
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1)
    round_no = 0
    while not stop.is_set():
        prompts = [f"{shared}# variant {round_no}-{i}\n" for i in range(6)]
        llm.generate(prompts, params, use_tqdm=False)
        try:
            llm.generate(["token " * 1500], params, use_tqdm=False)  # longer than max_model_len
        except Exception:  # noqa: BLE001 - expected: vLLM rejects it, llm-otel counts it
            pass
        if round_no == 0:
            print("READY", flush=True)
        round_no += 1
        stop.wait(0.3)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    sys.exit(main())
