"""The telemetry core owns every span and instrument: adapters under ``instrumentation/`` fill
records and call :class:`llm_otel.telemetry.Telemetry`, never the tracer or meter (issue 21)."""

from __future__ import annotations

import ast
import os
import textwrap

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "llm_otel")

# names that only code building spans or instruments touches: the tracer/meter objects, the
# OpenTelemetry calls that get them, the calls that make spans and instruments, and the core's
# span builders that take a tracer (a provider is not one: process.py hands the tracer provider to
# the exporter process's prewarm, which builds no span)
_LIGHTLLM_TRACER_OR_METER = {
    "tracer", "meter", "get_tracer", "get_meter", "start_span", "start_as_current_span", "create_counter", "create_up_down_counter", "create_histogram",
    "create_gauge", "create_observable_counter", "create_observable_up_down_counter",
    "create_observable_gauge", "emit_logit_dist", "SpanBuilder", "Instruments", "emit_stage",
}


def _lightllm_tracer_or_meter_uses(source: str, allowed: set[str]) -> list[str]:
    """``"Class.function:line name"`` for each use of a tracer/meter name in ``source`` outside the
    functions named in ``allowed`` (qualified ``Class.function``)."""
    found: list[str] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
                if inner in allowed:
                    continue
                visit(child, inner)
                continue
            name = None
            if isinstance(child, ast.Attribute):
                name = child.attr
            elif isinstance(child, ast.Name):
                name = child.id
            elif isinstance(child, ast.alias):
                name = (child.asname or child.name).rsplit(".", 1)[-1]
            if name in _LIGHTLLM_TRACER_OR_METER:
                found.append(f"{scope or '<module>'}:{getattr(child, 'lineno', '?')} {name}")
            visit(child, scope)

    visit(ast.parse(source), "")
    return found


def test_lightllm_adapter_builds_no_request_or_stage_spans():
    """Nothing in instrumentation/lightllm/ touches the tracer or meter: the request spans come
    from Telemetry.start_request/finish, the router's llm.router.request and the worker's
    llm.infer.request (with its token events and llm.logit_dist) from Telemetry.start_stage/
    end_stage (telemetry/stages.py). The one exception is the router's step-span function
    RouterAdapter._step (llm.engine.step), which moves into telemetry/steps.py separately."""
    allowed = {"RouterAdapter._step"}
    package = os.path.join(SRC, "instrumentation", "lightllm")
    files = sorted(f for f in os.listdir(package) if f.endswith(".py"))
    assert "adapter.py" in files and "hooks.py" in files, files
    uses = {}
    for name in files:
        with open(os.path.join(package, name), encoding="utf-8") as f:
            found = _lightllm_tracer_or_meter_uses(f.read(), allowed)
        if found:
            uses[name] = found
    assert uses == {}, uses

    # the check sees what it is meant to: a span started from the telemetry's tracer, an imported
    # span helper, a meter's instrument - and lets the allowed function through
    probe = textwrap.dedent("""
        from llm_otel.telemetry.spans import emit_logit_dist
        class RouterAdapter:
            def _released(self, st):
                self.telemetry.tracer.start_span("llm.router.request").end()
            def _step(self):
                self.telemetry.tracer.start_span("llm.engine.step").end()
        def counter(telemetry):
            return telemetry.meter.create_counter("x")
    """)
    assert _lightllm_tracer_or_meter_uses(probe, allowed) == [
        "<module>:2 emit_logit_dist", "RouterAdapter._released:5 start_span", "RouterAdapter._released:5 tracer",
        "counter:9 create_counter", "counter:9 meter"]
