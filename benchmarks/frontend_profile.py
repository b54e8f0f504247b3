"""The vLLM frontend's main thread over one offline pass (256 prompts x 64 tokens, the overhead
benchmark's workload, 100 % sampling, OTLP to a receiver in this process): thread CPU and
garbage-collector time of two unprofiled passes (``time.thread_time``: this thread only, ns
resolution - the overhead benchmark's per-process figure counts 10 ms ticks), then a thread-CPU
``cProfile`` of a third pass (profiling inflates small calls several-fold: read its shares, not its
seconds). One warm-up pass first. About 1.5 minutes; it starts a real engine, so under
``flock /tmp/llm-otel-heavy.lock``.

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/frontend_profile.py OUT.prof [uninstrumented]

``uninstrumented``: no ``llm_otel.instrument()`` (the baseline; no profile). Compare checkouts by
running it with each one's ``src`` on PYTHONPATH.
"""

import cProfile
import gc
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def main() -> None:
    from support.otlp_receiver import OTLPReceiver

    rx = OTLPReceiver().start()
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                      OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_TRACES_SAMPLER="always_on",
                      VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="ERROR")
    import _workload

    from llm_otel.demo.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    uninstrumented = "uninstrumented" in sys.argv[2:]
    if not uninstrumented:
        import llm_otel

        llm_otel.instrument()
    from vllm import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=_workload.MAX_MODEL_LEN, seed=0, block_size=32)
    prompts, params = _workload.offline(256, 64)
    llm.generate(prompts, params, use_tqdm=False)
    collected = [0.0, 0, 0, 0]  # seconds, collections of generation 0 / 1 / 2
    began = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - began[0]
            collected[1 + info["generation"]] += 1

    for _ in range(2):
        gc.callbacks.append(on_gc)
        t = time.thread_time()
        llm.generate(prompts, params, use_tqdm=False)
        cpu = time.thread_time() - t
        gc.callbacks.remove(on_gc)
        print("unprofiled pass: main-thread cpu %.3f s, gc %.3f s (collections gen0/1/2: %d/%d/%d)"
              % (cpu, *collected), flush=True)
        collected[:] = [0.0, 0, 0, 0]
    if not uninstrumented:
        profile = cProfile.Profile(time.thread_time)
        t = time.thread_time()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
        print("profiled pass: main-thread cpu %.3f s" % (time.thread_time() - t))
        profile.dump_stats(sys.argv[1])
        stats = pstats.Stats(sys.argv[1])
        stats.sort_stats("cumulative").print_stats("llm_otel", 40)
        stats.sort_stats("tottime").print_stats("llm_otel", 25)
    sys.stdout.flush()
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # the receiver's and the providers' threads are not waited for


if __name__ == "__main__":
    main()
