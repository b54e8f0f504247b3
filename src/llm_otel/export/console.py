"""Readable console output for when no OTLP endpoint is configured (and for ``llm-otel demo``).

* :class:`ConsoleTreeExporter` prints each trace as an indented tree once its local root ends.
* :class:`JsonLinesExporter` prints one JSON object per span.
* :class:`ConsoleMetricsSummary` is a metric reader that prints a summary table at shutdown.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from opentelemetry.sdk.metrics.export import (
    DataPointT,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llm_otel.semconv import attributes as A

# What the tree shows of each span: (attribute, label, scale, unit)
_KEY_ATTRS = [
    (A.GEN_AI_USAGE_INPUT_TOKENS, "in", None, ""),
    (A.GEN_AI_USAGE_OUTPUT_TOKENS, "out", None, ""),
    (A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, "cached", None, ""),
    (A.GEN_AI_RESPONSE_FINISH_REASONS, "finish", None, ""),
    (A.LLM_TIME_TO_FIRST_TOKEN, "ttft", 1e3, "ms"),
    # the phases of llm.prompt, in order: they add up to the request's TTFT
    (A.LLM_REQUEST_FRONTEND_DURATION, "frontend", 1e3, "ms"),
    (A.LLM_REQUEST_ENGINE_INPUT_WAIT_DURATION, "input_wait", 1e3, "ms"),
    (A.LLM_REQUEST_QUEUE_DURATION, "queue", 1e3, "ms"),
    (A.LLM_REQUEST_PREFILL_DURATION, "prefill", 1e3, "ms"),
    (A.LLM_TIME_PER_OUTPUT_TOKEN, "tpot", 1e3, "ms"),
    (A.LLM_INTER_TOKEN_LATENCY_P99, "itl.p99", 1e3, "ms"),
    (A.LLM_LOGIT_ENTROPY_MEAN, "entropy", None, "nats"),
    (A.LLM_LOGIT_MARGIN_MIN, "margin.min", None, ""),
    (A.LLM_LOGIT_PERPLEXITY, "ppl", None, ""),
    (A.ERROR_TYPE, "error", None, ""),
]


def _fmt(value: object, scale: float | None, unit: str) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        value = value * scale if scale else value
        return f"{value:.3g}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
    return f"{value}{unit}"


def format_tree(spans: Sequence[ReadableSpan]) -> str:
    """Render spans of one trace as an indented tree (children by start time)."""
    by_id = {s.context.span_id: s for s in spans}
    kids: dict[int | None, list[ReadableSpan]] = collections.defaultdict(list)
    for s in spans:
        parent = s.parent.span_id if s.parent is not None and s.parent.span_id in by_id else None
        kids[parent].append(s)
    lines: list[str] = []

    def walk(span: ReadableSpan, prefix: str, last: bool, root: bool) -> None:
        start = span.start_time or 0  # set on every started span
        dur = ((span.end_time or start) - start) / 1e6
        attrs = span.attributes or {}
        keys = " ".join(f"{label}={_fmt(attrs[k], sc, u)}" for k, label, sc, u in _KEY_ATTRS if k in attrs)
        status = " ERROR" if span.status.status_code.name == "ERROR" else ""
        head = "" if root else (prefix + ("└─ " if last else "├─ "))
        extra = f" trace={span.context.trace_id:032x}" if root else ""
        lines.append(f"{head}{span.name}  {dur:.1f} ms{status}  {keys}{extra}".rstrip())
        children = sorted(kids.get(span.context.span_id, []), key=lambda s: s.start_time or 0)
        for i, child in enumerate(children):
            walk(child, prefix if root else prefix + ("   " if last else "│  "), i == len(children) - 1, False)

    for r in sorted(kids[None], key=lambda s: s.start_time or 0):
        walk(r, "", True, True)
    return "\n".join(lines)


class ConsoleTreeExporter(SpanExporter):
    """Buffers spans per trace and prints the trace's tree when a local root span ends.

    Holds at most ``max_spans`` spans; the oldest traces are dropped first.
    """

    def __init__(self, stream: TextIO, max_spans: int = 10_000) -> None:
        self.stream = stream
        self.max_spans = max_spans
        self._traces: collections.OrderedDict[int, list[ReadableSpan]] = collections.OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        out = []
        with self._lock:
            for span in spans:
                tid = span.context.trace_id
                self._traces.setdefault(tid, []).append(span)
                self._count += 1
                if span.parent is None or span.parent.is_remote:
                    done = self._traces.pop(tid)
                    self._count -= len(done)
                    out.append(format_tree(done))
            while self._count > self.max_spans and self._traces:
                _, dropped = self._traces.popitem(last=False)
                self._count -= len(dropped)
        for text in out:
            print(text, file=self.stream, flush=True)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            rest = list(self._traces.values())
            self._traces.clear()
        for spans in rest:
            print(format_tree(spans), file=self.stream, flush=True)


class JsonLinesExporter(SpanExporter):
    """One JSON object per finished span (the SDK's ``ReadableSpan.to_json``, compacted)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            print(json.dumps(json.loads(span.to_json())), file=self.stream, flush=True)
        return SpanExportResult.SUCCESS


_LABELS = {
    A.GEN_AI_OPERATION_NAME: "op",
    A.GEN_AI_TOKEN_TYPE: "type",
    A.ERROR_TYPE: "error",
    A.LLM_INSTRUMENTATION_HOOK: "hook",
}


def format_metrics(metrics_data: MetricsData | None) -> str:
    """A compact table of histogram count/mean and counter totals from SDK ``MetricsData``."""
    rows = []
    if metrics_data is None:
        return ""
    for rm in metrics_data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points: list[DataPointT] = list(metric.data.data_points)
                # the usual labels, plus any attribute that tells this metric's points apart
                varying = {
                    k
                    for p in points
                    for k in (p.attributes or {})
                    if len({(q.attributes or {}).get(k) for q in points}) > 1
                }
                for point in points:
                    attrs = dict(point.attributes or {})
                    label = ",".join(
                        f"{_LABELS.get(k, k.rsplit('.', 1)[-1])}={v}"
                        for k, v in sorted(attrs.items())
                        if k in _LABELS or k in varying
                    )
                    name = metric.name + (f"{{{label}}}" if label else "")
                    if isinstance(point, HistogramDataPoint):
                        mean = point.sum / point.count if point.count else 0.0
                        rows.append(f"  {name:<72} count={point.count:<5} mean={mean:.4g} {metric.unit}")
                    elif isinstance(point, NumberDataPoint):
                        rows.append(f"  {name:<72} value={point.value} {metric.unit}")
    return "\n".join(["metrics:"] + rows) if rows else ""


class ConsoleMetricsSummary(InMemoryMetricReader):
    """In-memory metric reader that prints :func:`format_metrics` once, at shutdown."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def summary(self) -> str:
        return format_metrics(self.get_metrics_data())

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            text = self.summary()
            if text:
                print(text, file=self.stream, flush=True)
        finally:
            super().shutdown(timeout_millis=timeout_millis, **kwargs)
