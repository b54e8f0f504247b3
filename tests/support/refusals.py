"""Requests a real vLLM OpenAI server refuses, and what their telemetry must be (case C26): each
one SERVER span under the caller's ``traceparent``, named for the route's operation and a bounded
model, with ``error.type`` and the ``llm.request.rejected`` event, and counted once in
``llm.server.requests`` and ``gen_ai.server.request.duration`` - read back from what the server
exported to an OTLP receiver (tests/support/otlp_receiver.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import httpx

SERVER = "SPAN_KIND_SERVER"
PARENT = "00f067aa0ba902b7"


def traceparent(trace_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{PARENT}-{'01' if sampled else '00'}"


@dataclasses.dataclass
class Refusal:
    """One refused request and the telemetry it must leave.

    ``body``: JSON-able, or ``bytes`` sent as they are (``content-type: application/json``);
    ``status``: the HTTP status vLLM answers; ``span_name``: ``{operation} {model}``;
    ``error_type``: its ``error.type``."""

    what: str
    path: str
    body: Any
    status: int
    span_name: str
    error_type: str
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    def attributes(self) -> dict[str, str]:
        """The ``llm.server.requests`` / duration attributes the refusal is counted with."""
        operation, model = self.span_name.split(" ", 1)
        return {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "vllm",
            "gen_ai.request.model": model,
            "error.type": self.error_type,
        }


def latest(rx, name: str, service: str, attributes: dict[str, Any]) -> dict | None:
    """The newest point of metric ``name`` that service ``service`` exported with exactly
    ``attributes``, or None."""
    points = [
        p
        for p in rx.metrics(name, latest=False)
        if p["resource"].get("service.name") == service and p["attributes"] == attributes
    ]
    return max(points, key=lambda p: p["time_ns"]) if points else None


def counted(rx, service: str, attributes: dict[str, Any]) -> tuple[int, int]:
    """(``llm.server.requests`` value, ``gen_ai.server.request.duration`` count) with ``attributes``
    as ``service`` last exported them (cumulative; 0 before its first point)."""
    requests = latest(rx, "llm.server.requests", service, attributes)
    duration = latest(rx, "gen_ai.server.request.duration", service, attributes)
    return (int(requests["value"]) if requests else 0, int(duration["count"]) if duration else 0)


def check_refusals(
    rx, base: str, service: str, refusals: list[Refusal], trace_prefix: str, export_interval_s: float = 1.0
) -> list[tuple[str, int, str, str, int]]:
    """Send each refusal (its own trace id: ``trace_prefix`` + index, sampled) and check its
    telemetry: the HTTP status, exactly one SERVER span (no second one within two export
    intervals), its name, ``error.type``, ERROR status and ``llm.request.rejected`` event, and the
    count of its attribute set grown by exactly the number of refusals that share it. Returns the
    table rows (what, HTTP status, span name, error.type, how many times it was counted)."""
    keys = {tuple(sorted(r.attributes().items())) for r in refusals}
    # settled: what earlier requests to this server (another test's refusals, in any order) still
    # had to export has arrived - two snapshots two export intervals apart agree
    before = {k: counted(rx, service, dict(k)) for k in keys}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(2 * export_interval_s + 0.5)
        now = {k: counted(rx, service, dict(k)) for k in keys}
        if now == before:
            break
        before = now
    expected = {k: sum(tuple(sorted(r.attributes().items())) == k for r in refusals) for k in keys}
    ids = []
    for i, refusal in enumerate(refusals):
        trace_id = f"{trace_prefix}{i:0{32 - len(trace_prefix)}x}"
        ids.append(trace_id)
        headers = {"traceparent": traceparent(trace_id), **refusal.headers}
        if isinstance(refusal.body, bytes):
            headers.setdefault("content-type", "application/json")
            r = httpx.post(base + refusal.path, content=refusal.body, headers=headers, timeout=60)
        else:
            r = httpx.post(base + refusal.path, json=refusal.body, headers=headers, timeout=60)
        assert r.status_code == refusal.status, (refusal.what, r.status_code, r.text[:300])
    for trace_id in ids:
        rx.wait_for_spans(1, trace_id=trace_id, kind=SERVER, timeout=20)
    # every count grown by exactly the refusals that share its attributes, and no more afterwards
    deadline = time.monotonic() + 20
    while True:
        after = {k: counted(rx, service, dict(k)) for k in keys}
        grown = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in keys}
        if all(g >= (expected[k], expected[k]) for k, g in grown.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    time.sleep(2 * export_interval_s + 0.5)  # a second span or count would have arrived by now
    after = {k: counted(rx, service, dict(k)) for k in keys}
    rows = []
    for refusal, trace_id in zip(refusals, ids):
        spans = rx.spans(trace_id=trace_id, kind=SERVER)
        assert len(spans) == 1, (refusal.what, [s["name"] for s in spans])
        (span,) = spans
        a = span["attributes"]
        assert span["name"] == refusal.span_name, (refusal.what, span["name"])
        assert span["parent_span_id"] == PARENT
        assert a["error.type"] == refusal.error_type, (refusal.what, a["error.type"])
        assert a["gen_ai.operation.name"] == refusal.attributes()["gen_ai.operation.name"]
        assert span["status_code"] == "STATUS_CODE_ERROR"
        assert [e["name"] for e in span["events"]] == ["llm.request.rejected"]
        k = tuple(sorted(refusal.attributes().items()))
        grown = (after[k][0] - before[k][0], after[k][1] - before[k][1])
        assert grown == (expected[k], expected[k]), (refusal.what, refusal.attributes(), before[k], after[k])
        rows.append((refusal.what, refusal.status, span["name"], a["error.type"], grown[0] // expected[k]))
    return rows


def table(rows: list[tuple[str, int, str, str, int]]) -> str:
    """The rows of :func:`check_refusals` as a Markdown table (docs/vllm.md, "Refused requests")."""
    lines = ["| refusal | HTTP | span name | error.type | counted |", "|---|---|---|---|---|"]
    lines += [f"| {what} | {status} | `{name}` | `{etype}` | {n} |" for what, status, name, etype, n in rows]
    return "\n".join(lines)
