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
_CALLS = frozenset({
    "get_tracer", "get_meter", "get_tracer_provider", "get_meter_provider",
    "start_span", "start_as_current_span", "use_span",
    "create_histogram", "create_counter", "create_up_down_counter", "create_gauge",
    "create_observable_gauge", "create_observable_counter", "create_observable_up_down_counter",
    "set_attribute", "set_attributes", "set_status", "add_event", "add_link", "record_exception",
    "update_name", "end",
})
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
            if module.startswith(_MODULES) or (module == "opentelemetry"
                                                and {a.name for a in node.names} & {"trace", "metrics"}):
                what = f"from {module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.startswith(_MODULES)]
            if bad:
                what = f"import {', '.join(bad)}"
        if what is not None:
            found.append(f"{filename}:{node.lineno}: {what}")
    return found


def package_uses(package: pathlib.Path) -> list[str]:
    return [use for path in sorted(package.rglob("*.py"))
            for use in otel_uses(path.read_text(), str(path.relative_to(package.parent)))]


def test_the_check_finds_tracer_and_meter_use():
    """The checker itself: each way an adapter could build a span or instrument is reported."""
    source = "\n".join([
        "from opentelemetry import trace",
        "from opentelemetry.metrics import get_meter",
        "import opentelemetry.trace.propagation",
        "span = self.tracer.start_span('x')",
        "m = get_meter('x').create_histogram('h')",
        "with trace.use_span(span): pass",
        "span.set_status(s); span.add_event('e'); span.end()",
        "self.telemetry.meter",
    ])
    uses = otel_uses(source)
    for what in ("from opentelemetry import trace", "from opentelemetry.metrics import get_meter",
                 "import opentelemetry.trace.propagation", ".tracer", "start_span()", "get_meter()",
                 "create_histogram()", "use_span()", "set_status()", "add_event()", "end()", ".meter"):
        assert any(u.endswith(f": {what}") for u in uses), (what, uses)
    assert otel_uses("self.calls.finish(call, error=exc)\nstate.add(call)\n") == []


def test_triton_adapter_never_calls_the_tracer_or_meter():
    """Spans, their times and the GenAI client metrics of tritonclient calls are built in
    ``telemetry/client.py``; ``instrumentation/triton/`` only reads tritonclient and calls it."""
    package = INSTRUMENTATION / "triton"
    assert (package / "adapter.py").is_file()
    assert package_uses(package) == []


def _function_lines(source: str, qualname: str) -> range:
    """Lines of the function ``Class.function`` in ``source`` (empty when it is not there)."""
    cls, name = qualname.split(".")
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return range(item.lineno, item.end_lineno + 1)
    return range(0)


# LightLLM uses of the OpenTelemetry API that build no span and no instrument, each with its reason
_LIGHTLLM_DATA = {
    # the span kind the core's start_request takes (SERVER when there is an HTTP request)
    "lightllm/adapter.py": {"from opentelemetry.trace import SpanKind"},
    # the HTTP worker's tracer provider handed to the exporter process's prewarm (export/offload.py)
    "lightllm/process.py": {"from opentelemetry import trace", "get_tracer_provider()"},
}
# the router's llm.engine.step: step spans move into telemetry/steps.py for every engine (issue 21)
_LIGHTLLM_STEP_FUNCTION = "RouterAdapter._step"


def test_lightllm_adapter_builds_no_request_or_stage_spans():
    """instrumentation/lightllm/ never calls the tracer or meter: the HTTP worker's request spans
    come from ``Telemetry.start_request`` / ``finish``, the router's ``llm.router.request`` and the
    model-infer worker's ``llm.infer.request`` (token events, ``llm.logit_dist``) from the
    ``StageRecord`` it fills and ``Telemetry.end_stage`` (telemetry/stages.py). Allowed: the
    router's step-span function until step spans move to telemetry/steps.py, and the data uses in
    ``_LIGHTLLM_DATA``."""
    package = INSTRUMENTATION / "lightllm"
    assert (package / "adapter.py").is_file()
    step = _function_lines((package / "adapter.py").read_text(), _LIGHTLLM_STEP_FUNCTION)
    left = []
    for use in package_uses(package):
        filename, line, what = use.split(":", 2)
        if filename == "lightllm/adapter.py" and int(line) in step:
            continue
        if what.strip() in _LIGHTLLM_DATA.get(filename, ()):
            continue
        left.append(use)
    assert left == []
    # what main's adapter did, the check finds (the router's and the worker's own span building)
    old = "\n".join([
        "class RouterAdapter:",
        "    def _released(self, rid, facts):",
        "        span = self.telemetry.tracer.start_span(S.LLM_ROUTER_REQUEST, context=st.parent)",
        "        span.add_event(S.EVENT_LLM_REQUEST_QUEUED, timestamp=st.queued_ns)",
        "        span.end(end_time=end_ns)",
    ])
    assert sorted(u.split(": ", 1)[1] for u in otel_uses(old)) == [".tracer", "add_event()", "end()", "start_span()"]
