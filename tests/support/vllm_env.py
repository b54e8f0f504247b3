"""The environment every vLLM test process runs with, and waiting for a vLLM server to be ready."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    # tests look at particular steps and tokens: a span for every step (not 10 a second) and an
    # inter-token-latency observation for every token gap (not one in 16)
    "LLM_OTEL_STEP_SPANS_PER_S": "inf",
    "LLM_OTEL_ITL_SAMPLE_EVERY": "1",
    # tests count every request's tree, sent a handful at once: no trace budget (a burst from idle
    # keeps only its first 7-8 roots whole); tests/test_trace_budget.py tests the budget itself
    "LLM_OTEL_TRACES_PER_S": "inf",
}
# The same for the in-process telemetry of unit tests (make_captured without settings).
EXACT = {k: VLLM_ENV[k] for k in ("LLM_OTEL_STEP_SPANS_PER_S", "LLM_OTEL_ITL_SAMPLE_EVERY")}


def wait_for_vllm_server(proc, base: str, log_path, timeout_s: float, what: str = "vLLM server") -> None:
    """Poll ``base + "/health"`` until it answers 200; fail the test with the tail of ``log_path``
    when the server process exits first or ``timeout_s`` passes (then its process group is killed)."""
    import signal
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{what} not ready in {timeout_s:.0f} s:\n{log_path.read_text()[-5000:]}")
        time.sleep(0.5)
