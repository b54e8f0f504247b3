"""The core owns every span and instrument (issue 21): adapters under ``instrumentation/`` read
their engine or client library and call :class:`llm_otel.telemetry.Telemetry`; they never reach
the OpenTelemetry tracer or meter themselves. Checked statically, on the source (AST), so a path
no test exercises cannot hide a span built in an adapter."""

from __future__ import annotations

import ast
import pathlib

import llm_otel

INSTRUMENTATION = pathlib.Path(llm_otel.__file__).parent / "instrumentation"

# the tracer / meter themselves (``telemetry.tracer``, ``self.meter``)
_HANDLES = frozenset({"tracer", "meter", "tracer_provider", "meter_provider"})
# OpenTelemetry API calls that make tracers, meters, spans or instruments, or change a span
_CALLS = frozenset(
    {
        "get_tracer",
        "get_meter",
        "get_tracer_provider",
        "get_meter_provider",
        "start_span",
        "start_as_current_span",
        "use_span",
        "create_histogram",
        "create_counter",
        "create_up_down_counter",
        "create_gauge",
        "create_observable_gauge",
        "create_observable_counter",
        "create_observable_up_down_counter",
        "set_attribute",
        "set_attributes",
        "set_status",
        "add_event",
        "add_link",
        "record_exception",
        "update_name",
        "end",
    }
)
# modules whose import would let an adapter do the above under another name
_MODULES = ("opentelemetry.trace", "opentelemetry.metrics", "opentelemetry.sdk")


def otel_uses(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: what`` for each tracer/meter use in ``source`` (empty: the module only calls
    the core)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in _HANDLES:
            what = f".{node.attr}"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _CALLS:
                what = f"{name}()"
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith(_MODULES) or (
                module == "opentelemetry" and {a.name for a in node.names} & {"trace", "metrics"}
            ):
                what = f"from {module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.startswith(_MODULES)]
            if bad:
                what = f"import {', '.join(bad)}"
        if what is not None:
            found.append(f"{filename}:{node.lineno}: {what}")
    return found


def package_uses(package: pathlib.Path) -> list[str]:
    return [
        use
        for path in sorted(package.rglob("*.py"))
        for use in otel_uses(path.read_text(), str(path.relative_to(package.parent)))
    ]


def test_the_check_finds_tracer_and_meter_use():
    """The checker itself: each way an adapter could build a span or instrument is reported."""
    source = "\n".join(
        [
            "from opentelemetry import trace",
            "from opentelemetry.metrics import get_meter",
            "import opentelemetry.trace.propagation",
            "span = self.tracer.start_span('x')",
            "m = get_meter('x').create_histogram('h')",
            "with trace.use_span(span): pass",
            "span.set_status(s); span.add_event('e'); span.end()",
            "self.telemetry.meter",
        ]
    )
    uses = otel_uses(source)
    for what in (
        "from opentelemetry import trace",
        "from opentelemetry.metrics import get_meter",
        "import opentelemetry.trace.propagation",
        ".tracer",
        "start_span()",
        "get_meter()",
        "create_histogram()",
        "use_span()",
        "set_status()",
        "add_event()",
        "end()",
        ".meter",
    ):
        assert any(u.endswith(f": {what}") for u in uses), (what, uses)
    assert otel_uses("self.calls.finish(call, error=exc)\nstate.add(call)\n") == []


def test_triton_adapter_never_calls_the_tracer_or_meter():
    """Spans, their times and the GenAI client metrics of tritonclient calls are built in
    ``telemetry/client.py``; ``instrumentation/triton/`` only reads tritonclient and calls it."""
    package = INSTRUMENTATION / "triton"
    assert (package / "adapter.py").is_file()
    assert package_uses(package) == []


# Uses of the OpenTelemetry API under instrumentation/vllm/ that are not the span model, each with
# why it stays there; anything else (a new use, or one more of these) fails the test below.
_VLLM_ALLOWED = {
    # VLLMInstrumentor resolves the process's tracer provider to hand it to Telemetry (setup)
    ("vllm/__init__.py", "from opentelemetry import trace"): 1,
    ("vllm/__init__.py", "get_tracer_provider()"): 2,
    # the request span's kind (SERVER or INTERNAL), a value passed to Telemetry.start_request
    ("vllm/adapter.py", "from opentelemetry.trace import SpanKind"): 1,
    ("vllm/pooling.py", "from opentelemetry.trace import SpanKind"): 1,  # pooling requests' spans
    ("vllm/beam_search.py", "from opentelemetry.trace import SpanKind"): 1,  # a beam search's request span
    # (the providers of vLLM's engine-core and worker processes are built by the process runtime's
    # one recipe, llm_otel.process.providers.engine_process_providers: plugin.py builds none)
    # StepTracker.end(ctx): the core's step API, not Span.end
    ("vllm/worker.py", "end()"): 1,
}
_STEP_SPAN_NAMES = frozenset({"LLM_ENGINE_STEP", "LLM_ENGINE_STEP_DEVICE", "llm.engine.step", "llm.engine.step.device"})


def step_span_names(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: name`` for each mention of the step spans' names (semconv constant or literal)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str) and name in _STEP_SPAN_NAMES:
            found.append(f"{filename}:{node.lineno}: {name}")
    return found


def test_the_step_span_check_finds_what_the_vllm_engine_core_used_to_do():
    before = "span = self.telemetry.tracer.start_span(S.LLM_ENGINE_STEP, links=links)\n"
    assert step_span_names(before) == ["<string>:1: LLM_ENGINE_STEP"]
    assert step_span_names("name = 'llm.engine.step.device'\n") == ["<string>:1: llm.engine.step.device"]
    assert {u.split(": ", 1)[1] for u in otel_uses(before)} == {".tracer", "start_span()"}


def test_vllm_and_lightllm_adapters_never_build_step_spans():
    """``llm.engine.step`` and ``llm.engine.step.device`` are built by ``telemetry/steps.py`` for
    every engine: no vLLM or LightLLM adapter module names them, and nothing under
    ``instrumentation/vllm/`` reaches the tracer or meter (beyond the listed setup uses)."""
    uses: dict[tuple[str, str], int] = {}
    for use in package_uses(INSTRUMENTATION / "vllm"):
        filename, _, what = use.split(":", 2)
        uses[(filename, what.strip())] = uses.get((filename, what.strip()), 0) + 1
    assert uses == _VLLM_ALLOWED
    names = [
        n
        for package in ("vllm", "lightllm")
        for path in sorted((INSTRUMENTATION / package).rglob("*.py"))
        for n in step_span_names(path.read_text(), str(path.relative_to(INSTRUMENTATION)))
    ]
    assert names == []
    # and the core does name them: the check looks for the right names
    steps = INSTRUMENTATION.parent / "telemetry" / "steps.py"
    assert {n.rsplit(": ", 1)[1] for n in step_span_names(steps.read_text())} == {
        "LLM_ENGINE_STEP",
        "LLM_ENGINE_STEP_DEVICE",
    }


# Uses of the OpenTelemetry API under instrumentation/lightllm/ that are not the span model, each
# with why it stays there; anything else (a new use, or one more of these) fails the test below.
_LIGHTLLM_ALLOWED = {
    # the request span's kind (SERVER with an HTTP request, else INTERNAL), a value passed to
    # Telemetry.start_request
    ("lightllm/httpserver.py", "from opentelemetry.trace import SpanKind"): 1,
    # the P/D master's span kind (SERVER with an HTTP request), a value passed to
    # Telemetry.start_forwarded, and the span it returns as a type
    ("lightllm/kv.py", "from opentelemetry.trace import Span, SpanKind"): 1,
    # the HTTP worker hands its tracer provider to the exporter process's prewarm (export setup)
    ("lightllm/process.py", "from opentelemetry import trace"): 1,
    ("lightllm/process.py", "get_tracer_provider()"): 1,
}


def test_lightllm_adapter_builds_no_request_or_stage_spans():
    """instrumentation/lightllm/ never calls the tracer or meter: the HTTP worker's request spans
    come from ``Telemetry.start_request`` / ``finish``, the router's ``llm.router.request`` and the
    model-infer worker's ``llm.infer.request`` (token events, ``llm.logit_dist``) from the
    ``StageRecord`` it fills and ``Telemetry.end_stage`` (telemetry/stages.py), the router's
    ``llm.engine.step`` from ``EngineSteps`` (telemetry/steps.py)."""
    package = INSTRUMENTATION / "lightllm"
    assert (package / "adapter.py").is_file()
    uses: dict[tuple[str, str], int] = {}
    for use in package_uses(package):
        filename, _, what = use.split(":", 2)
        uses[(filename, what.strip())] = uses.get((filename, what.strip()), 0) + 1
    assert uses == _LIGHTLLM_ALLOWED
    # what the adapter did before (the router and the worker building their own spans), the check finds
    before = "\n".join(
        [
            "class RouterAdapter:",
            "    def _released(self, rid, facts):",
            "        span = self.telemetry.tracer.start_span(S.LLM_ROUTER_REQUEST, context=st.parent)",
            "        span.add_event(S.EVENT_LLM_REQUEST_QUEUED, timestamp=st.queued_ns)",
            "        span.set_status(Status(StatusCode.ERROR, 'aborted'))",
            "        span.end(end_time=end_ns)",
        ]
    )
    assert sorted(u.split(": ", 1)[1] for u in otel_uses(before)) == [
        ".tracer",
        "add_event()",
        "end()",
        "set_status()",
        "start_span()",
    ]
