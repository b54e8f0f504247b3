"""``llm-otel demo``: a real vLLM engine on a tiny local model, traced by llm-otel.

Prints each request's span tree and a metrics summary; with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set,
exports there (e.g. Jaeger) instead and prints the trace ids to look up.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.renderers.chat_utils import ChatCompletionMessageParam

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass",
    "for key, value in sorted(",
    "The quick brown fox",
    "try:\n    return self.",
    "while True:\n    line =",
    "assert isinstance(",
    "with open(path) as f:",
]


class _Progress:
    """A one-line ticker on stderr while the engine starts (20-90 s on CPU)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        tty = sys.stderr.isatty()
        while not self._stop.wait(1.0 if tty else 10.0):
            if tty:
                print(f"\r{self.text} {time.monotonic() - start:4.0f} s", end="", file=sys.stderr, flush=True)
            else:
                print(".", end="", file=sys.stderr, flush=True)

    def __enter__(self) -> _Progress:
        print(self.text, end="", file=sys.stderr, flush=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        print(" done", file=sys.stderr, flush=True)


def run_demo(prompts: int = 4, max_tokens: int = 24, model_dir: str | None = None) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("LLM_OTEL_LOGIT_DIST_RATIO", "1")  # show llm.logit_dist on every request
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        # the console sees this process's spans only: build llm.logit_dist here, from the log-probs
        # vLLM returns, not in the worker process (whose spans need an OTLP endpoint to travel)
        os.environ.setdefault("LLM_OTEL_VLLM_WORKER_LOGITS", "false")

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    import llm_otel
    from llm_otel.config import Settings
    from llm_otel.demo.tiny_model import ensure_tiny_model
    from llm_otel.export.console import ConsoleMetricsSummary, ConsoleTreeExporter
    from llm_otel.export.providers import SystemRandomIdGenerator
    from llm_otel.process.providers import build_providers

    settings = Settings.from_env()
    otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    trees = io.StringIO()
    summary = None
    if otlp:
        tracer_provider, meter_provider = build_providers(settings)
    else:
        tracer_provider = TracerProvider(id_generator=SystemRandomIdGenerator())
        tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleTreeExporter(trees)))
        summary = ConsoleMetricsSummary(io.StringIO())
        meter_provider = MeterProvider(metric_readers=[summary])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    llm_otel.instrument(tracer_provider, meter_provider, engines=["vllm"])

    t0 = time.monotonic()
    print("llm-otel demo: building the tiny local model (cached after the first run)...", file=sys.stderr, flush=True)
    path = ensure_tiny_model(model_dir, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(f"  model: {path} ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)

    from vllm import LLM, SamplingParams

    with _Progress("llm-otel demo: starting the vLLM engine on CPU (20-90 s)..."):
        llm = LLM(model=str(path), dtype="float32", max_model_len=512, seed=0, enable_prefix_caching=True)
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    tracer = trace.get_tracer("llm_otel.demo")
    with tracer.start_as_current_span("demo batch") as root:
        t1 = time.monotonic()
        outputs = llm.generate(batch, params, use_tqdm=False)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a haiku about tracing."}]
        chat = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
        wall = time.monotonic() - t1
        trace_id = root.get_span_context().trace_id
    n_out = sum(len(c.token_ids) for o in outputs + chat for c in o.outputs)
    tracer_provider.force_flush()
    print(f"\nvLLM served {len(outputs) + len(chat)} requests, {n_out} output tokens in {wall:.2f} s", flush=True)
    if otlp:
        print(
            f"spans exported over OTLP; look up trace {trace_id:032x} (service "
            f"'{os.environ.get('OTEL_SERVICE_NAME', 'unknown_service')}') in Jaeger at http://localhost:16686",
            flush=True,
        )
    else:
        print(
            "\nspan trees (the demo's trace: llm-otel's request spans under the application's 'demo batch'"
            " span; vLLM's own start-up spans may print as separate traces):\n",
            flush=True,
        )
        print(trees.getvalue(), flush=True)
        if summary is not None:  # always without OTLP
            print(summary.summary(), flush=True)
    llm_otel.uninstrument()
    meter_provider.shutdown()
    tracer_provider.shutdown()
    return 0
