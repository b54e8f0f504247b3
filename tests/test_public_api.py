"""instrument()/uninstrument(), the entry point for opentelemetry-instrument, and `llm-otel doctor`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points

import pytest
from conftest import HAS_VLLM

import llm_otel
from llm_otel.cli import doctor

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")


def run_py(code: str, env: dict | None = None, argv_prefix: list[str] | None = None, timeout=240):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full_env.update(env or {})
    cmd = (argv_prefix or []) + [sys.executable, "-c", textwrap.dedent(code)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_vllm
@pytest.mark.slow
def test_instrument_is_idempotent_and_uninstrument_restores_every_attribute_exactly():
    out = run_py("""
        import importlib, llm_otel
        from llm_otel.instrumentation._hooks import _resolve, missing_hooks
        from llm_otel.instrumentation.vllm.hooks import HOOKS
        assert missing_hooks(HOOKS) == []
        owners = []
        for h in HOOKS:
            try:
                owners.append(_resolve(h))
            except (ImportError, AttributeError):
                assert h.group, h.qualname  # only another layout's alternative may be absent
        before = [vars(o)[a] for o, a in owners]
        assert llm_otel.instrument(engines=["vllm"]) == ["vllm"]
        wrapped = [vars(o)[a] for o, a in owners]
        assert all(w is not b for w, b in zip(wrapped, before)), "every hook applied"
        assert llm_otel.instrument(engines=["vllm"]) == ["vllm"]
        assert all(vars(o)[a] is w for (o, a), w in zip(owners, wrapped)), "second instrument() is a no-op"
        llm_otel.uninstrument()
        assert all(vars(o)[a] is b for (o, a), b in zip(owners, before)), "exact restore"
        llm_otel.instrument(); llm_otel.uninstrument()
        assert all(vars(o)[a] is b for (o, a), b in zip(owners, before))
        print("OK", len(owners))
    """)
    assert out.split() == ["OK", "40"]  # 42 hooks, 2 of them the older OpenAI-server layout


@needs_vllm
@pytest.mark.slow
def test_zero_code_opentelemetry_instrument_applies_the_vllm_hooks():
    out = run_py(
        """
        from opentelemetry import trace
        from vllm.v1.engine.output_processor import OutputProcessor
        import wrapt
        print(type(vars(OutputProcessor)["process_outputs"]).__name__, type(trace.get_tracer_provider()).__name__)
    """,
        env={"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
        argv_prefix=[os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")],
    )
    assert out.split() == ["FunctionWrapper", "TracerProvider"]


def test_entry_point_names_the_vllm_instrumentor():
    (ep,) = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "vllm"]
    assert ep.value == "llm_otel.instrumentation.vllm:VLLMInstrumentor"
    assert ep.load().__name__ == "VLLMInstrumentor"


def test_instrument_without_endpoint_sets_up_console_output_and_without_vllm_is_harmless():
    out = run_py("""
        import sys, types, importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name in ("vllm", "tritonclient") else real(name, *a)
        import llm_otel
        from opentelemetry import trace
        assert llm_otel.instrument() == []
        tp = trace.get_tracer_provider()
        procs = tp._active_span_processor._span_processors
        print(type(tp).__name__, type(procs[0].span_exporter).__name__)
    """)
    assert out.split() == ["TracerProvider", "ConsoleTreeExporter"]


def test_instrument_with_otlp_endpoint_uses_a_batch_otlp_exporter():
    out = run_py(
        """
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "vllm" else real(name, *a)
        import llm_otel
        from opentelemetry import trace
        llm_otel.instrument()
        (proc,) = trace.get_tracer_provider()._active_span_processor._span_processors
        # the OTLP exporter inside llm-otel's wrapper: per process, size-capped, drops counted and logged once
        exporter = proc._batch_processor._exporter
        print(type(proc).__name__, type(exporter).__name__, type(exporter.inner()).__module__)
    """,
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "LLM_OTEL_EXPORT_PROCESS": "false",
        },
    )
    assert out.split() == [
        "BatchSpanProcessor",
        "ProcessSpanExporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ]


def test_instrument_with_otlp_endpoint_exports_spans_from_an_exporter_process_by_default():
    out = run_py(
        """
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "vllm" else real(name, *a)
        import llm_otel
        from opentelemetry import trace
        llm_otel.instrument()
        provider = trace.get_tracer_provider()
        print(type(provider).__name__, provider.buffer.endpoint)
    """,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
    )
    assert out.split() == ["OffloadTracerProvider", "http://127.0.0.1:9/v1/traces"]


def test_instrument_rejects_unknown_engines_and_bad_config(monkeypatch):
    with pytest.raises(ValueError, match="unknown engine"):
        llm_otel.instrument(engines=["tgi"])
    from llm_otel.config import ConfigError

    monkeypatch.setenv("LLM_OTEL_TOKEN_EVENTS", "lots")
    with pytest.raises(ConfigError, match="LLM_OTEL_TOKEN_EVENTS"):
        llm_otel.instrument(engines=[])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.case("C04")
def test_doctor_reports_a_broken_exporter(protocol, capsys):
    port = _closed_port()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_METRICS_EXPORTER": "none",
    }
    assert doctor(env) == 1
    out = capsys.readouterr().out
    assert "[FAIL] OTLP exporter" in out and "did not accept a probe span" in out
    assert f"127.0.0.1:{port}" in out  # the endpoint the environment named, not a default


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.case("C04")
def test_doctor_confirms_a_working_exporter(protocol, receiver, capsys, monkeypatch):
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}.items():
        monkeypatch.setenv(k, v)
    assert doctor() == 0
    assert "[  ok] OTLP exporter" in capsys.readouterr().out
    assert receiver.wait_for_spans(1, name="llm_otel.doctor.probe")


def test_doctor_rejects_an_unsupported_protocol(capsys):
    assert doctor({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) == 1
    out = capsys.readouterr().out
    assert "[FAIL] configuration: OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in out
    assert "[  ok]" not in out  # never "configuration valid" and then a failure of the same thing


@pytest.mark.parametrize(
    "env, name",
    [
        ({"OTEL_METRICS_EXPORTER": "prometeus"}, "OTEL_METRICS_EXPORTER"),
        ({"OTEL_METRICS_EXPORTER": "foo"}, "OTEL_METRICS_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpcc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),  # no endpoint set
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpcc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
    ],
)
def test_doctor_fails_the_configuration_on_a_bad_exporter_variable(env, name, capsys):
    assert doctor(env) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"[FAIL] configuration: {name}=") and "[  ok]" not in out


def test_doctor_says_where_spans_go_when_exporters_are_off(capsys):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }
    assert doctor(env) == 0
    out = capsys.readouterr().out
    assert "OTEL_TRACES_EXPORTER=none: spans are not exported" in out
    assert "OTEL_METRICS_EXPORTER=none: metrics are not exported" in out
    assert "console" not in out and "no OTEL_EXPORTER_OTLP_ENDPOINT" not in out
    assert doctor({"OTEL_METRICS_EXPORTER": "none", "LLM_OTEL_CONSOLE": "off"}) == 0
    assert "LLM_OTEL_CONSOLE=off: spans are not exported" in capsys.readouterr().out


def test_instrument_rejects_a_bad_exporter_variable_before_creating_providers():
    out = run_py("""
        import llm_otel
        from opentelemetry import trace
        from llm_otel.config import ConfigError
        for env in ({"OTEL_METRICS_EXPORTER": "prometeus"}, {"OTEL_TRACES_EXPORTER": "zipkin"},
                    {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpcc"}):
            import os
            os.environ.update(env)
            try:
                llm_otel.instrument(engines=[])
            except ConfigError as exc:
                print(next(iter(env)) in str(exc))
            else:
                print("accepted", env)
            for k in env:
                del os.environ[k]
        print(type(trace.get_tracer_provider()).__name__)
    """)
    assert out.split() == ["True", "True", "True", "ProxyTracerProvider"]


def test_instrument_takes_one_engine_name_as_a_string():
    out = run_py(
        """
        import llm_otel
        try:
            llm_otel.instrument(engines="nope")
        except ValueError as exc:
            print("nope" in str(exc) and "'n'" not in str(exc))
        import importlib.util
        print(llm_otel.instrument(engines="vllm") == (["vllm"] if importlib.util.find_spec("vllm") else []))
        llm_otel.uninstrument()
    """,
        env={"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
    )
    assert out.split() == ["True", "True"]


@pytest.mark.parametrize("port", [True, False, -1, 0, 65535, 70000, "9464", 9464.0])
def test_invalid_prometheus_port_raises_and_leaves_the_environment_untouched(port, monkeypatch):
    from llm_otel.config import ConfigError

    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_PROMETHEUS_PORT", raising=False)
    before = dict(os.environ)
    with pytest.raises(ConfigError, match="prometheus_port"):
        llm_otel.instrument(engines=[], prometheus_port=port)
    assert dict(os.environ) == before


def test_prometheus_port_is_applied_only_after_the_rest_validates(monkeypatch):
    from llm_otel.config import ConfigError

    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_PROMETHEUS_PORT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    before = dict(os.environ)
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        llm_otel.instrument(engines=[], prometheus_port=9500)
    assert dict(os.environ) == before


@pytest.mark.case("C04")
def test_doctor_probes_the_metrics_exporter_too(receiver, capsys):
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
    }
    assert doctor(env) == 1
    out = capsys.readouterr().out
    assert "[  ok] OTLP exporter" in out and "[FAIL] OTLP metric exporter" in out
    env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = receiver.grpc_endpoint
    assert doctor(env) == 0
    assert "[  ok] OTLP metric exporter" in capsys.readouterr().out
    assert receiver.wait_for_metric("llm_otel.doctor.probe")
    assert doctor({**env, "OTEL_METRICS_EXPORTER": "none"}) == 0


def test_version_lives_in_version_py_matches_pyproject_and_no_layer_imports_the_package_face_for_it():
    """``llm_otel.__version__`` is ``llm_otel.version.__version__`` and equals pyproject's
    version; no module under src/llm_otel/ takes the version from the package face (``from
    llm_otel import __version__`` was the core's one upward import)."""
    import pathlib

    import tomllib

    from llm_otel.version import __version__

    root = pathlib.Path(__file__).resolve().parents[1]
    assert llm_otel.__version__ is __version__
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"] == __version__
    offenders = [
        str(p.relative_to(root))
        for p in (root / "src" / "llm_otel").rglob("*.py")
        if "from llm_otel import __version__" in p.read_text()
    ]
    assert offenders == []


def test_a_bad_variable_under_opentelemetry_instrument_is_one_error_line_and_other_instrumentations_run(tmp_path):
    """Bad input at start, zero-code (fresh-install review of issue 21): an instrumentor raising
    ConfigError made opentelemetry-instrument abort the whole auto-instrumentation - every other
    library's instrumentation too - with two tracebacks. Now: one ERROR line naming the variable,
    llm-otel instruments nothing, the SDK's auto-initialisation completes and the app runs."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_"))}
    env.update(
        LLM_OTEL_TOKEN_EVENTS="bad",
        OTEL_TRACES_EXPORTER="none",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
    )
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    app = (
        "from llm_otel.instrumentation.vllm import VLLMInstrumentor\n"
        "from llm_otel.instrumentation.triton import TritonClientInstrumentor\n"
        "print('app ran', VLLMInstrumentor().adapter is None, TritonClientInstrumentor().adapter is None)\n"
    )
    out = subprocess.run(
        [instrument, sys.executable, "-c", app], env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path)
    )
    assert out.returncode == 0 and "app ran True True" in out.stdout, out.stderr[-3000:]
    ours = [line for line in out.stderr.splitlines() if "llm-otel" in line]
    assert len(ours) == 1 and "LLM_OTEL_TOKEN_EVENTS" in ours[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Failed to auto initialize" not in out.stderr, out.stderr[-3000:]


@needs_vllm
def test_application_providers_get_no_second_global_pipeline_from_the_vllm_plugin():
    """An application that instrumented vLLM with its own providers: vLLM's plugin (run in the
    frontend when ``LLM()`` is built) calls ``llm_otel.instrument(engines=["vllm"])``, which must
    stay a no-op - no global providers from ``OTEL_*`` and no exporter process beside the
    application's pipeline (fresh-install review of issue 19, F5; fails on the old code)."""
    out = run_py(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider
        import llm_otel
        from llm_otel.instrumentation.vllm import plugin
        llm_otel.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider(), engines=["vllm"])
        plugin.register()
        print("RESULT", type(trace.get_tracer_provider()).__name__)
    """,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "LLM_OTEL_ENABLED": "1"},
    )
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT ProxyTracerProvider"], out[-3000:]


ENGINE_PROCESS_APP = """
    import multiprocessing, sys, time
    from importlib.metadata import entry_points
    multiprocessing.current_process().name = sys.argv[1]  # as vLLM names its spawned engine processes
    import psutil
    for ep in entry_points(group="opentelemetry_instrumentor"):  # what opentelemetry-instrument runs
        if ep.value.startswith("llm_otel."):
            ep.load()().instrument()
    from opentelemetry import trace
    from vllm.tracing import instrument

    @instrument(span_name="EngineCoreProc init")  # vLLM's own start-up tracing: the global provider
    def start_up():
        pass

    start_up()
    time.sleep(1.0)
    kids = [c for c in psutil.Process().children() if "llm_otel.export.offload" in " ".join(c.cmdline())]
    print("RESULT", type(trace.get_tracer_provider()).__name__, len(kids), flush=True)
    from llm_otel.process.lifecycle import lifecycle
    lifecycle().flush()  # what the engine process's orderly exit does
"""


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("name, role", [("EngineCore", "engine_core"), ("VllmWorker-0", "worker")])
def test_vllm_engine_processes_export_in_process_and_start_no_exporter_process_under_opentelemetry_instrument(
    name, role, receiver
):
    """docs/architecture.md: engine-core and worker processes export in process, on providers of
    their own. ``opentelemetry-instrument`` runs every installed instrumentor in every process; the
    Triton and LightLLM instrumentors installed global providers at ``instrument()`` whatever the
    process, so every engine core and worker got a global exporter-process provider, and vLLM's own
    start-up spans started an exporter process in each (~63 MB each, for the server's life; the
    spans labelled ``frontend``). Their providers now come at the first import of a module they
    hook (fresh-install review of issue 19, F2; fails on the old code), and the engine process's own
    provider is the global one: vLLM's start-up spans that start after the instrumentation (in a
    real engine process: after vLLM loads its plugins) are exported from it, with its role (review
    of the F2 fix: they were lost)."""
    service = f"start-up-{name}"
    out = run_py(
        ENGINE_PROCESS_APP.replace("sys.argv[1]", repr(name)),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_SERVICE_NAME": service,
        },
    )
    line = [x for x in out.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT TracerProvider 0"], out[-3000:]
    mine: list = []
    deadline = time.monotonic() + 15
    while not mine and time.monotonic() < deadline:
        time.sleep(0.2)
        mine = [
            sp for sp in receiver.spans(name="EngineCoreProc init") if sp["resource"].get("service.name") == service
        ]
    assert [sp["resource"].get("llm.process.role") for sp in mine] == [role]


def test_triton_instrumentation_builds_providers_and_hooks_at_the_first_tritonclient_import():
    """The other side of the test above: the Triton client instrumentation waits for tritonclient -
    no providers and no import of it at ``instrument()``; the import wraps its targets, on global
    providers built from ``OTEL_*`` then, and ``uninstrument()`` restores them."""
    pytest.importorskip("tritonclient.grpc")
    out = run_py(
        """
        import sys
        from opentelemetry import trace
        from llm_otel.instrumentation.triton import TritonClientInstrumentor
        inst = TritonClientInstrumentor()
        inst.instrument()
        print("BEFORE", type(trace.get_tracer_provider()).__name__, inst.adapter is None,
              any(m.startswith("tritonclient") for m in sys.modules))
        import tritonclient.grpc as grpcclient
        wrapped = type(grpcclient.InferenceServerClient.__dict__["infer"]).__name__
        print("AFTER", type(trace.get_tracer_provider()).__name__, inst.adapter is not None, wrapped)
        inst.uninstrument()
        print("RESTORED", type(grpcclient.InferenceServerClient.__dict__["infer"]).__name__)
    """,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "OTEL_METRICS_EXPORTER": "none"},
    )
    lines = [x for x in out.splitlines() if x.split(" ")[0] in ("BEFORE", "AFTER", "RESTORED")]
    assert lines == [
        "BEFORE ProxyTracerProvider True False",
        "AFTER OffloadTracerProvider True FunctionWrapper",
        "RESTORED function",
    ], out[-3000:]


@needs_vllm
@pytest.mark.slow
def test_vllm_instrumentation_waits_for_the_process_to_import_vllm_under_opentelemetry_instrument():
    """opentelemetry-instrument runs the vLLM instrumentor in every process of a served tree;
    applying its hooks imports vLLM (and torch): multiprocessing's resource tracker, which never
    uses vLLM, grew from 63 to 455 MB RSS (300 MB USS). Now nothing of vLLM is imported until the
    process imports ``vllm`` itself; then every hook is applied at once."""
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    out = run_py(
        """
        import sys
        from llm_otel.instrumentation.vllm import VLLMInstrumentor
        from llm_otel.instrumentation.vllm.hooks import HOOKS
        inst = VLLMInstrumentor()
        print("BEFORE", inst.is_instrumented_by_opentelemetry, inst.adapter is None,
              "vllm" in sys.modules, "torch" in sys.modules)
        import vllm
        from llm_otel.instrumentation._hooks import _resolve
        resolvable = []
        for h in HOOKS:
            try:
                resolvable.append(_resolve(h))
            except (ImportError, AttributeError):
                pass  # another layout's target
        wrapped = sum(type(vars(owner)[name]).__name__ == "FunctionWrapper" for owner, name in resolvable)
        print("AFTER", inst.adapter is not None, len(inst._applied) == wrapped == len(resolvable) > 0)
    """,
        env={"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"},
        argv_prefix=[instrument],
    )
    lines = [x for x in out.splitlines() if x.split(" ")[0] in ("BEFORE", "AFTER")]
    assert lines == ["BEFORE True True False False", "AFTER True True"], out[-3000:]
