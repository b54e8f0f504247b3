"""Under ``opentelemetry-instrument`` every installed instrumentor runs in every process: a process
that imports none of vLLM, tritonclient or LightLLM gets nothing from llm-otel (no providers, no
import of vLLM and torch), and an application's own provider set before it imports an engine is the
one used. Both failed before: the vLLM instrumentor took any non-engine process for a ``frontend``,
built global providers and imported vLLM to apply its hooks (fresh-eyes review of the issue 19 F2
fix; vLLM's resource tracker grew from 65 to 650 MB RSS). Real ``opentelemetry-instrument``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_instrumented(code: str, **env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        OTEL_METRICS_EXPORTER="none",
        DEAD_PORT=str(_closed_port()),
        **env_extra,
    )
    done = subprocess.run(
        [INSTRUMENT, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_opentelemetry_instrument_gives_a_program_that_imports_no_engine_no_providers_and_no_vllm_import():
    """A Python program that never imports vLLM, tritonclient or LightLLM, run with
    ``opentelemetry-instrument`` where llm-otel[vllm] is installed, must get no global providers
    from llm-otel (docs/architecture.md: global providers are built by "the vLLM instrumentor in
    vLLM's frontend", Triton/LightLLM "at the first import of a module they hook") and must not be
    made to import vLLM and torch (~600 MB RSS and seconds of start-up per process). Today the vLLM
    instrumentor classifies any non-engine process as ``frontend``: ensure_providers at
    instrument() and apply_hooks imports vllm."""
    pytest.importorskip("vllm")
    out = _run_instrumented("""
        import sys
        from opentelemetry import trace
        print("RESULT", type(trace.get_tracer_provider()).__name__, "vllm" in sys.modules, "torch" in sys.modules)
    """)
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT ProxyTracerProvider False False"], out[-3000:]


def test_triton_spans_go_to_the_tracer_provider_the_application_sets_after_opentelemetry_instrument():
    """The application sets its own global TracerProvider after ``opentelemetry-instrument`` ran the
    instrumentors and before it imports tritonclient: the Triton client span must be recorded by the
    application's provider (98fcfee: providers are built at the first tritonclient import, and
    ensure_providers leaves the application's alone). With vLLM installed the vLLM instrumentor has
    already set llm-otel's OffloadTracerProvider at instrument(): the SDK logs "Overriding of current
    TracerProvider is not allowed" and the application's provider records nothing. (Passes with
    ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm``.)"""
    pytest.importorskip("tritonclient.http")
    out = _run_instrumented("""
        import os
        import numpy as np
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        mem = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(mem))
        trace.set_tracer_provider(tp)
        import tritonclient.http as httpclient
        client = httpclient.InferenceServerClient(f"127.0.0.1:{os.environ['DEAD_PORT']}")
        inp = httpclient.InferInput("TEXT", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"hi"], dtype=object))
        try:
            client.infer("m", [inp], request_id="r1")
        except Exception:
            pass  # nothing listens on DEAD_PORT: the span ends with an error
        print("RESULT", trace.get_tracer_provider() is tp, [s.name for s in mem.get_finished_spans()])
    """)
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT True ['infer m']"], out[-3000:]


ENGINE_CHILD_APP = """
    import multiprocessing, os

    def engine_core():  # what vLLM's engine core does first: load the general plugins
        from vllm.plugins import load_general_plugins
        load_general_plugins()

    if __name__ == "__main__":
        import vllm  # the deferred activation meets the invalid exporter setting here
        print("RESULT enabled", os.environ.get("LLM_OTEL_ENABLED"), flush=True)
        child = multiprocessing.get_context("spawn").Process(target=engine_core, name="EngineCore")
        child.start()
        child.join()
        print("RESULT child", child.exitcode, flush=True)
"""


def _run_engine_child_app(tmp_path, **env_vars: str) -> subprocess.CompletedProcess:
    """ENGINE_CHILD_APP under opentelemetry-instrument with only ``env_vars`` of the OTEL_/LLM_OTEL_
    kind set; asserts it and its engine child exited 0."""
    pytest.importorskip("vllm")
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(ENGINE_CHILD_APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(env_vars)
    done = subprocess.run([INSTRUMENT, sys.executable, str(app)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "RESULT child 0" in done.stdout, done.stdout + done.stderr
    return done


@pytest.mark.slow
def test_an_invalid_exporter_setting_is_one_line_for_the_frontend_and_the_engine_processes_it_starts(tmp_path):
    """``OTEL_TRACES_EXPORTER=bogus`` under ``opentelemetry-instrument``: the frontend says so in one
    ERROR line at its ``import vllm`` and instruments nothing; ``LLM_OTEL_ENABLED``, set at
    ``instrument()`` so that vLLM's children follow, is taken back, so the engine processes it
    starts stay silent instead of each failing on the same variable with a line of its own
    (second fresh-eyes review of the issue 19 F2 fix; on 8e16663 the child logged two lines)."""
    done = _run_engine_child_app(tmp_path, OTEL_TRACES_EXPORTER="bogus", OTEL_METRICS_EXPORTER="none")
    assert "RESULT enabled None" in done.stdout, done.stdout + done.stderr
    lines = [x for x in done.stderr.splitlines() if "bogus" in x]
    assert len(lines) == 1, "\n".join(lines)


@pytest.mark.slow
def test_with_llm_otel_enabled_set_by_the_user_an_invalid_exporter_setting_is_one_line_for_the_tree(tmp_path):
    """The same with ``LLM_OTEL_ENABLED=1`` set by the user (the documented zero-code form), which
    the frontend does not take back: the engine process it starts meets the same error at its
    plugin activation - its bootstrap-time providers leave the error to that - and, having
    inherited what the frontend reported, logs it at DEBUG (the third review of the F2 fix found
    two lines per engine process, one of them from the bootstrap)."""
    done = _run_engine_child_app(
        tmp_path, OTEL_TRACES_EXPORTER="bogus", OTEL_METRICS_EXPORTER="none", LLM_OTEL_ENABLED="1"
    )
    assert "RESULT enabled 1" in done.stdout, done.stdout + done.stderr
    lines = [x for x in done.stderr.splitlines() if "bogus" in x]
    assert len(lines) == 1 and "invalid configuration" in lines[0], "\n".join(lines)
    assert "at its start" not in done.stderr and "could not instrument" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_an_invalid_llm_otel_setting_is_one_error_line_for_the_whole_process_tree(tmp_path):
    """``LLM_OTEL_TOKEN_EVENTS=bad`` under ``opentelemetry-instrument`` is validated at every
    Python process's start - the application, multiprocessing's resource tracker, the engine core
    it spawns. The first says so in one ERROR line; the processes it starts inherit what it
    reported (``LLM_OTEL_CONFIG_REFUSED``) and log it at DEBUG (before: one ERROR line each, 3
    here)."""
    done = _run_engine_child_app(
        tmp_path, LLM_OTEL_TOKEN_EVENTS="bad", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none"
    )
    lines = [x for x in done.stderr.splitlines() if "LLM_OTEL_TOKEN_EVENTS" in x]
    assert len(lines) == 1 and "invalid configuration" in lines[0], "\n".join(lines)


BOOTSTRAP_TWICE = """
    import multiprocessing
    from multiprocessing.process import BaseProcess
    from llm_otel.instrumentation.vllm import engine_processes

    original = BaseProcess.__dict__["_bootstrap"]
    engine_processes.providers_at_bootstrap()
    engine_processes.providers_at_bootstrap()  # a second instrument() in a child not yet bootstrapped
    child = multiprocessing.Process(target=print, args=("RESULT target ran",), name="EngineCore")
    code = child._bootstrap()  # what spawn's child does with the Process its parent pickled
    print("RESULT", code, BaseProcess.__dict__["_bootstrap"] is original, "run" in child.__dict__)
    engine_processes.providers_at_bootstrap()
    engine_processes.remove_bootstrap_patch()  # uninstrument() before the bootstrap
    print("RESULT removed", BaseProcess.__dict__["_bootstrap"] is original)
"""


def test_the_bootstrap_patch_is_applied_once_and_removed_by_uninstrument():
    """``providers_at_bootstrap`` twice (instrument, uninstrument, instrument in a spawned child
    before it is bootstrapped) wraps the process's ``run`` once: the target runs, the child exits 0
    and nothing of the patch stays; ``remove_bootstrap_patch`` (``uninstrument()``) restores
    multiprocessing's own ``_bootstrap`` (third review of the F2 fix: a second call made the child
    die with ``AttributeError: run``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(LLM_OTEL_ENABLED="1", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(BOOTSTRAP_TWICE)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == ["RESULT target ran", "RESULT 0 True False", "RESULT removed True"], done.stdout + done.stderr


@pytest.mark.slow
def test_vllm_imported_by_two_threads_at_once_is_fully_instrumented_before_it_builds_an_engine():
    """An application imports vLLM from two threads at once (a warm-up thread imports
    ``vllm.sampling_params`` while another imports ``vllm.config``). The instrumentation starts
    inside the first thread's ``import vllm``; Python hands its hooks' nested imports a partially
    initialised ``vllm.config``, and the targets that need it are reported missing. vLLM loads its
    general plugins - ours - before it builds an engine (``EngineArgs``), and the plugin applies
    what resolves by then: every target is wrapped (second fresh-eyes review of the issue 19 F2
    fix: on 9d9a75a LLMEngine and the serving classes stayed unwrapped for good)."""
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    code = """
        import threading
        errors = []
        def imp(name):
            try:
                __import__(name)
            except BaseException as exc:
                errors.append((name, repr(exc)))
        threads = [threading.Thread(target=imp, args=(n,)) for n in ("vllm.sampling_params", "vllm.config")]
        [t.start() for t in threads]
        [t.join() for t in threads]
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # what EngineArgs does before LLM() / AsyncLLM build the engine
        from llm_otel.instrumentation._hooks import _resolve
        from llm_otel.instrumentation.vllm import VLLMInstrumentor
        from llm_otel.instrumentation.vllm.hooks import HOOKS
        resolvable = []
        for h in HOOKS:
            try:
                resolvable.append(_resolve(h))
            except (ImportError, AttributeError):
                pass  # another layout's target
        unwrapped = [f"{o.__name__}.{n}" for o, n in resolvable if "Wrapper" not in type(vars(o)[n]).__name__]
        print("RESULT", errors, unwrapped, len(VLLMInstrumentor()._applied) == len(resolvable))
    """
    done = subprocess.run(
        [INSTRUMENT, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT [] [] True"], (done.stdout + done.stderr)[-3000:]


SWITCHED_OFF_APP = """
    import multiprocessing

    def state():
        from opentelemetry import trace
        import vllm.v1.utils
        from llm_otel.instrumentation.vllm import VLLMInstrumentor
        # instrumented: an adapter, providers (not the API's proxy), vLLM's process shutdown wrapped
        return (VLLMInstrumentor().adapter is not None, type(trace.get_tracer_provider()).__name__,
                hasattr(vllm.v1.utils.shutdown, "__wrapped__"))

    def engine_core(queue):  # what vLLM's engine core does first: load the general plugins
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        queue.put(state())

    if __name__ == "__main__":
        import vllm
        import llm_otel
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=engine_core, args=(queue,), name="EngineCore")
        child.start()
        print("RESULT frontend", state(), flush=True)
        print("RESULT engine_core", queue.get(timeout=200), flush=True)
        child.join()
        print("RESULT instrument()", llm_otel.instrument(engines=["vllm"]), state()[0], flush=True)
"""


@pytest.mark.slow
def test_llm_otel_enabled_false_is_off_in_the_frontend_and_the_engine_processes_it_starts(tmp_path):
    """Issue 30 item 5: ``LLM_OTEL_ENABLED=false`` under ``opentelemetry-instrument``. The engine
    processes' ``vllm.general_plugins`` entry point followed it, but the frontend's instrumentor
    (the ``opentelemetry_instrumentor`` entry point) ignored it: request spans without any engine
    span below them (partial trees). Now every process is off - the frontend's instrumentor, the
    plugin in the spawned engine core, and an explicit ``llm_otel.instrument()`` (returns [])."""
    pytest.importorskip("vllm")
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(SWITCHED_OFF_APP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(
        LLM_OTEL_ENABLED="false", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none"
    )
    done = subprocess.run([INSTRUMENT, sys.executable, str(app)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == [
        "RESULT frontend (False, 'ProxyTracerProvider', False)",
        "RESULT engine_core (False, 'ProxyTracerProvider', False)",
        "RESULT instrument() [] False",
    ], (done.stdout + done.stderr)[-3000:]
