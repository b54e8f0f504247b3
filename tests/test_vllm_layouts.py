"""Cases C05/C06: the vLLM hook table against module trees shaped like other vLLM releases
(tests/vllm_layouts/<layout>/ over the modules they share in tests/vllm_layouts/common/), in a
fresh interpreter where that tree *is* `vllm`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import json, logging, time
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("llm_otel").addHandler(Keep())
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from llm_otel.config import Settings
    from llm_otel.instrumentation.vllm import HOOKS, VLLMInstrumentor
    import vllm
    exporter = InMemorySpanExporter()
    tp = TracerProvider(); tp.add_span_processor(SimpleSpanProcessor(exporter))
    inst = VLLMInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=MeterProvider(), settings=Settings(), skip_dep_check=True)
    applied = [a.hook.qualname for a in inst._applied]
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    engine = LLMEngine()
    engine.output_processor.add_request(EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=2), time.time()), None)
    t = time.monotonic()
    engine.output_processor.process_outputs([EngineCoreOutput("r1", [5])], engine_core_timestamp=t)
    engine.output_processor.process_outputs([EngineCoreOutput("r1", [6], finish_reason=1)], engine_core_timestamp=t + 0.01)
    spans = {s.name: dict(s.attributes) for s in exporter.get_finished_spans()}
    inst.uninstrument()
    print(json.dumps({"version": vllm.__version__, "hooks": len(HOOKS), "applied": applied,
                      "warnings": [r for r in records if "not found" in r], "spans": spans}))
""")


def run_layout(layout: str, tmp_path) -> dict:
    tree = tmp_path / layout
    shutil.copytree(os.path.join(HERE, "vllm_layouts", "common"), tree)
    shutil.copytree(os.path.join(HERE, "vllm_layouts", layout), tree, dirs_exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# each layout: the targets llm-otel warns about, and how many targets do not resolve at all
# (the OpenAI handlers of the other layout resolve under their alternative module: no warning)
@pytest.mark.parametrize(
    "layout, version, missing, unresolved",
    [
        (
            "v0_7",
            "0.7.3",
            {
                "vllm.v1.engine.core_client:EngineCoreClient.make_async_mp_client",
                "vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin.beam_search",
                "vllm.entrypoints.generate.beam_search.online:BeamSearchOnlineMixin.beam_search",
                "vllm.entrypoints.generate.beam_search.offline:BeamSearchOfflineMixin._beam_search_step",
                "vllm.entrypoints.pooling.offline:PoolingOfflineMixin.score",
                "vllm.entrypoints.pooling.base.serving:PoolingBaseServing.__call__",
                "vllm.entrypoints.pooling.base.serving:PoolingBaseServing._init_ctx",
                "vllm.v1.core.sched.scheduler:Scheduler.add_request",
                "vllm.v1.core.sched.scheduler:Scheduler.schedule",
                "vllm.v1.core.sched.scheduler:Scheduler.make_stats",
                "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
                "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
                "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
                "vllm.v1.worker.gpu.sample.sampler:Sampler.add_request",
                "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__",
                "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
                "vllm.v1.engine.utils:shutdown",
                "vllm.v1.utils:shutdown",
                "vllm.v1.engine.core:EngineCore.shutdown",
                "vllm.v1.executor.multiproc_executor:WorkerProc.shutdown",
                "vllm.entrypoints.launchers.app:build_app",
                "vllm.entrypoints.launchers.api_server.entry:build_app",
            },
            27,
        ),
        # 0.33 has every target (tests/contracts/vllm-0.33.0.json); only the old OpenAI handler
        # modules of the <= 0.11 layout do not resolve, and their 0.33 alternatives do: no warning
        ("v0_33", "0.33.0", set(), 2),
    ],
)
@pytest.mark.case("C06")
def test_other_vllm_layouts_skip_missing_hooks_with_one_warning_each_and_still_trace(
    layout, version, missing, unresolved, tmp_path
):
    result = run_layout(layout, tmp_path)
    assert result["version"] == version  # the stand-in tree, not the installed vLLM
    assert len(result["warnings"]) == len(missing)
    assert {w.split(" hook target ")[1].split(" ")[0] for w in result["warnings"]} == missing
    assert len(result["applied"]) == result["hooks"] - unresolved
    assert any("create_completion" in a for a in result["applied"])  # the handler of this layout
    assert not missing & set(result["applied"])
    # the hooks that did resolve still produce a correct request tree
    assert set(result["spans"]) == {"text_completion fake-model", "llm.prompt", "llm.token_stream"}
    assert result["spans"]["text_completion fake-model"]["gen_ai.usage.output_tokens"] == 2
    assert result["spans"]["text_completion fake-model"]["gen_ai.usage.input_tokens"] == 3


def test_the_033_stand_in_tree_has_the_033_wheels_parameters():
    """tests/vllm_layouts/v0_33 is checked against vLLM 0.33.0's real source: each hooked function
    it defines has the parameters the golden read from the 0.33.0 wheel."""
    from contracts import signatures, vllm_golden

    with open(vllm_golden.golden_path("0.33.0"), encoding="utf-8") as fh:
        real = json.load(fh)["targets"]
    tree = os.path.join(HERE, "vllm_layouts", "v0_33")
    stand_in = signatures.extract(tree, [tuple(key.split(":")) for key in real])
    present = {k: v for k, v in stand_in.items() if v["found"] and v["params"] is not None}
    assert len(present) >= 10
    for key, entry in present.items():
        assert entry["params"] == real[key]["params"], key
