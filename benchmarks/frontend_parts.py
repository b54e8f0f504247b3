"""Serving-process CPU of one traced request with the exporter process, by part: ``start_request``
(+ queued/scheduled events), 64 ``on_tokens`` calls, ``finish`` (the metric record(s), span records,
the tree record), and the writer thread's pickling of what they queued. The writer is held (its
lock taken), so only the caller side is timed; wall time per request, best of 5 rounds of N. Also:
records per request in the span and metric queues, and the garbage-collector-tracked objects a
finished request leaves queued (:func:`tracked_per_request`).

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/frontend_parts.py [sampler]   # always_on

Compare checkouts by running it with each one's ``src`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import pickle
import sys
import time


def measure(tel, buf, n: int) -> list[float]:
    """us per request for (start, 64 tokens, finish, pickle), then records and metric observations per request."""
    now, mono = time.time(), time.monotonic()
    recs = []
    t0 = time.perf_counter()
    for _ in range(n):
        rec = tel.start_request("req", operation="text_completion", provider="vllm", model="tiny", arrival_s=now,
                                input_tokens=32)
        rec.on_event("queued", mono)
        rec.on_event("scheduled", mono + 0.001)
        recs.append(rec)
    t1 = time.perf_counter()
    for rec in recs:
        for i in range(64):
            rec.on_tokens([i], mono + 0.002 + i * 1e-3)
    t2 = time.perf_counter()
    for rec in recs:
        rec.finish_reason = "length"
        tel.finish(rec)
    t3 = time.perf_counter()
    spans, metrics = list(buf._queue), list(buf._mqueue)  # noqa: SLF001 - what the writer would send
    buf._queue.clear()  # noqa: SLF001
    buf._mqueue.clear()  # noqa: SLF001
    t4 = time.perf_counter()
    pickle.dumps(("spans", spans), protocol=pickle.HIGHEST_PROTOCOL)
    pickle.dumps(("metrics", metrics), protocol=pickle.HIGHEST_PROTOCOL)
    t5 = time.perf_counter()
    return [(t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, (t3 - t2) / n * 1e6, (t5 - t4) / n * 1e6,
            len(spans) / n, len(metrics) / n]


def tracked_per_request(tel, buf, n: int) -> float:
    """Objects the garbage collector tracks that one finished request leaves in the buffers until
    the writer thread sends them (what the collector's passes must traverse meanwhile; each
    allocation also counts towards the next pass): counted over ``n`` requests, the rest of the
    heap frozen."""
    import gc

    buf._queue.clear()  # noqa: SLF001
    buf._mqueue.clear()  # noqa: SLF001
    gc.collect()
    gc.freeze()
    before = len(gc.get_objects())
    now, mono = time.time(), time.monotonic()
    for _ in range(n):
        rec = tel.start_request("req", operation="text_completion", provider="vllm", model="tiny", arrival_s=now,
                                input_tokens=32)
        rec.on_event("queued", mono)
        rec.on_event("scheduled", mono + 0.001)
        for i in range(64):
            rec.on_tokens([i], mono + 0.002 + i * 1e-3)
        rec.finish_reason = "length"
        tel.finish(rec)
    del rec
    gc.collect()
    tracked = (len(gc.get_objects()) - before) / n
    gc.unfreeze()
    return tracked


def main() -> None:
    os.environ["LLM_OTEL_EXPORT_PROCESS"] = "true"
    os.environ["OTEL_TRACES_SAMPLER"] = sys.argv[1] if len(sys.argv) > 1 else "always_on"
    os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = "600000"
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"  # nothing is sent: the writer is held
    from llm_otel.config import Settings
    from llm_otel.export.offload import request_outlets
    from llm_otel.process.providers import build_providers
    from llm_otel.telemetry import Telemetry

    tp, mp = build_providers(Settings.from_env(), shutdown_on_exit=False)
    tel = Telemetry(tp, mp, outlets=request_outlets(tp, mp))  # as instrument() wires it
    buf = tp.buffer
    buf._lock.acquire()  # noqa: SLF001 - the writer never sends: the caller side alone is timed
    buf.capacity = buf.metric_capacity = 10**9
    measure(tel, buf, 300)
    runs = [measure(tel, buf, 2000) for _ in range(5)]
    best = [min(r[i] for r in runs) for i in range(6)]
    print("us per request: start %.1f  64 tokens %.1f  finish %.1f  pickle %.1f  | records %.1f metric records %.1f"
          " | GC-tracked objects queued %.1f" % (*best, tracked_per_request(tel, buf, 1000)))
    os._exit(0)  # the held writer and the exporter process are not waited for


if __name__ == "__main__":
    main()
