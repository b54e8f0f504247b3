"""Live semantic-conventions check: every span name, event name and attribute llm-otel emits must
be declared in semconv/model with the declared type.

``SpanLog`` collects what llm-otel's tracers emitted during the test session (spans from the SDK,
plus spans decoded by the OTLP test receiver from other processes); ``check()`` compares them with
the registry and returns the problems.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

from llm_otel._semconv_registry import Registry

OUR_SCOPES = re.compile(r"^llm_otel($|\.instrumentation\.)")


def value_type(value: Any) -> str:
    """The registry type of an attribute value as OpenTelemetry would encode it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        kinds = {value_type(v) for v in value}
        if len(kinds) == 1:
            return kinds.pop() + "[]"
        return "mixed[]" if kinds else "empty[]"
    return type(value).__name__


class SpanLog:
    """Thread-safe record of (scope, span name, attributes, events) tuples, deduplicated by shape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seen: dict[tuple, dict] = {}
        self.count = 0

    def add(self, scope: str, name: str, attributes: dict, events: Iterable[tuple[str, dict]]) -> None:
        if not OUR_SCOPES.match(scope or ""):
            return
        key = (
            name,
            tuple(sorted((k, value_type(v)) for k, v in attributes.items())),
            tuple(sorted((e, tuple(sorted((k, value_type(v)) for k, v in a.items()))) for e, a in events)),
        )
        with self._lock:
            self.count += 1
            if key not in self.seen:
                self.seen[key] = {
                    "name": name,
                    "attributes": dict(attributes),
                    "events": [(e, dict(a)) for e, a in events],
                }


def _name_matches(template: str, name: str, attributes: dict) -> bool:
    def fill(match: re.Match) -> str:
        return str(attributes.get(match.group(1), "\0missing"))

    return re.sub(r"\{([a-z0-9_.]+)\}", fill, template) == name


def check(log: SpanLog, reg: Registry) -> list[str]:
    """Problems: undeclared span/event names, undeclared attributes, attributes of another type."""
    problems: list[str] = []
    span_templates = reg.span_names()
    events = reg.event_names()

    def check_attrs(where: str, attrs: dict) -> None:
        for key, value in attrs.items():
            if key not in reg.attributes:
                problems.append(f"{where}: attribute {key!r} is not declared in semconv/")
                continue
            declared = reg.attribute_python_type(key)
            actual = value_type(value)
            if actual != declared and not (actual == "empty[]" and declared.endswith("[]")):
                problems.append(f"{where}: attribute {key!r} emitted as {actual}, declared {declared}")

    for entry in log.seen.values():
        name = entry["name"]
        if not any(_name_matches(t, name, entry["attributes"]) for t in span_templates):
            problems.append(f"span {name!r} is not declared in semconv/")
        check_attrs(f"span {name!r}", entry["attributes"])
        for ev_name, ev_attrs in entry["events"]:
            if ev_name not in events:
                problems.append(f"span {name!r}: event {ev_name!r} is not declared in semconv/")
            check_attrs(f"event {ev_name!r}", ev_attrs)
    return sorted(set(problems))
