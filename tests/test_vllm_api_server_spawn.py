"""A spawned API server under ``opentelemetry-instrument`` (``vllm serve --api-server-count N``).

vLLM's launcher starts each API server with ``multiprocessing`` (``ApiServer_<i>``, vllm/v1/utils.py).
Under ``spawn`` the child's ``sitecustomize`` (opentelemetry-instrument) runs before multiprocessing
has named it, so the vLLM instrumentor defers (``_pending``); vLLM's plugin loader then calls our
``vllm.general_plugins`` entry point in the named child. The fresh-install review of issue 21 found
that the frontend branch called ``llm_otel.instrument()``, which skipped the instrumentor as already
instrumented: the API servers ran with no hooks and no request spans at all.

Real components: ``opentelemetry-instrument``, multiprocessing ``spawn`` with vLLM's process name,
vLLM's own plugin loader (``vllm.plugins.load_general_plugins``) and entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# a program under opentelemetry-instrument that imports vLLM in a spawned API server (close to a minute)
pytestmark = pytest.mark.slow

APP = """
    import json, multiprocessing, sys

    def api_server(queue):
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # what vLLM's API server does before building its engine client
        from vllm.v1.engine.output_processor import OutputProcessor
        from llm_otel.instrumentation.vllm import VLLMInstrumentor
        from llm_otel.process.identity import tracked_identity
        inst = VLLMInstrumentor()
        ident = tracked_identity() or {}
        queue.put({"name": multiprocessing.current_process().name, "role": inst.role,
                   "resource": {k: ident.get(k) for k in ("llm.process.role", "llm.process.name",
                                                          "llm.process.api_server.index")},
                   "adapter": inst.adapter is not None, "pending": inst._pending is not None,
                   "hooked": hasattr(OutputProcessor.add_request, "__wrapped__")})

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=api_server, args=(queue,), name="ApiServer_0")
        proc.start()
        print("RESULT " + json.dumps(queue.get(timeout=240)), flush=True)
        proc.join(60)
"""


def test_a_spawned_api_server_under_opentelemetry_instrument_is_instrumented(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    out = subprocess.run(
        [instrument, sys.executable, str(app)], env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result == {
        "name": "ApiServer_0",
        "role": "frontend",
        "adapter": True,
        "pending": False,
        "hooked": True,
        "resource": {
            "llm.process.role": "frontend",
            "llm.process.name": "ApiServer_0",
            "llm.process.api_server.index": 0,
        },
    }, (result, out.stderr[-3000:])
