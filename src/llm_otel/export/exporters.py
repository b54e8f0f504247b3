"""OTLP exporters that survive ``fork`` and never send a request a collector would reject.

:class:`ProcessSpanExporter` and :class:`ProcessMetricExporter` wrap the exporters llm-otel builds
from the ``OTEL_*`` environment (``export/providers.py``):

* **Per process.** The wrapped exporter (its gRPC channel or HTTP session) is built in the process
  that uses it. In a forked child (vLLM's engine processes under ``fork``, gunicorn ``--preload``,
  Celery prefork) the first export builds a new one from the same factory; the parent's channel is
  never used from the child (a gRPC channel inherited across ``fork`` hangs or crashes, an HTTP
  keep-alive socket shared by two processes interleaves their requests). A vLLM engine process
  that builds its own providers for its role calls :func:`disown_inherited` so that the
  frontend's providers it inherited send nothing from it (they would duplicate the frontend's
  series under the frontend's identity).
* **Bounded request size** (spans). One OTLP request stays under ``max_request_bytes``
  (``LLM_OTEL_OTLP_MAX_REQUEST_BYTES``, default 3 MiB, under the 4 MiB that gRPC servers and the
  OpenTelemetry Collector accept by default): a batch is split by an upper-bound estimate of each
  span's encoded size, and a span that alone is larger has its largest string attributes shortened
  - captured GenAI messages (``gen_ai.input.messages`` / ``gen_ai.output.messages``) are shortened
  inside their JSON so they stay valid JSON. Without this one long captured prompt gets the whole
  batch of 512 spans rejected (CASES.md C17).
* **Accounting.** Spans and metric exports that failed, and those still in flight when a final
  flush gave up, are counted (:attr:`ProcessSpanExporter.failed`, ``.in_flight``) for the one log
  line the lifecycle writes at exit (:mod:`llm_otel.process.lifecycle`); lost spans also go to the
  counter ``llm_otel.spans.dropped`` and one log line per outage (:mod:`llm_otel.export.drops`).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llm_otel.config import Settings
from llm_otel.errors import process_errors
from llm_otel.export.drops import DropCounter
from llm_otel.semconv import attributes as A

logger = logging.getLogger("llm_otel")

# how long a final flush may take when LLM_OTEL_FLUSH_DEADLINE_S is not read (its default): the
# process lifecycle (llm_otel.process.lifecycle) and the exporter process bound their exit with it
DEFAULT_DEADLINE_S: float = Settings().flush_deadline_s

DEFAULT_MAX_REQUEST_BYTES: int = Settings().otlp_max_request_bytes  # LLM_OTEL_OTLP_MAX_REQUEST_BYTES's default
# captured GenAI messages: JSON lists of {"role", "parts": [{"type", "content"}]}
_MESSAGE_ATTRIBUTES = (A.GEN_AI_INPUT_MESSAGES, A.GEN_AI_OUTPUT_MESSAGES)
# Fixed part of one encoded span (ids, times, kind, status, flags, name framing) and the framing
# of one attribute (KeyValue + AnyValue tags and lengths): generous upper bounds.
_SPAN_OVERHEAD = 256
_ATTRIBUTE_OVERHEAD = 16
_NUMBER_SIZE = 11

_EXPORTERS: weakref.WeakSet[_PerProcess[Any]] = weakref.WeakSet()

_Inner = TypeVar("_Inner", SpanExporter, MetricExporter)


def register(exporter) -> None:
    """Have :func:`disown_inherited` cover ``exporter`` too (held weakly); it keeps
    ``_created_pid`` (the pid that created it) and ``_disowned_pid`` (set here in a process that
    disowned it), as this module's exporters do (the exporter process's buffer,
    :class:`~llm_otel.export.offload.writer.OffloadBuffer`)."""
    _EXPORTERS.add(exporter)


def disown_inherited() -> int:
    """In a forked process: every exporter created by an ancestor process drops what it is given
    from now on (returns how many). Called by a vLLM engine process forked from the frontend before
    it builds the providers of its own role."""
    pid = os.getpid()
    n = 0
    for exporter in list(_EXPORTERS):
        if exporter._created_pid != pid:
            exporter._disowned_pid = pid
            n += 1
    return n


class _PerProcess(Generic[_Inner]):
    """The wrapped exporter of this process, built by ``factory()`` on first use in each process."""

    def __init__(self, factory: Callable[[], _Inner], endpoint: str = "") -> None:
        self._factory: Callable[[], _Inner] = factory
        self.endpoint = endpoint
        self._created_pid = os.getpid()
        self._disowned_pid: int | None = None
        self._inner: _Inner = factory()
        self._pid = self._created_pid
        self._inherited: list[_Inner] = []  # parents' exporters: kept, never closed from here
        self._lock = threading.Lock()
        self.failed = 0
        self.in_flight = 0
        self.last_error: str | None = None
        _EXPORTERS.add(self)

    @property
    def disowned(self) -> bool:
        return self._disowned_pid == os.getpid()

    def inner(self) -> _Inner:
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    # closing the parent's channel from here would tear down state the parent owns
                    self._inherited.append(self._inner)
                    self._inner = self._factory()
                    self._pid = pid
                    self.failed = self.in_flight = 0
                    drops = getattr(self, "drops", None)
                    if drops is not None:
                        drops.reset()
        return self._inner


class ProcessSpanExporter(_PerProcess[SpanExporter], SpanExporter):
    """Span exporter wrapper: per-process inner exporter, bounded request size, failure counts.

    Args:
        factory: builds the real exporter (e.g. an OTLP gRPC ``OTLPSpanExporter``); called once
            now and once in each forked process that exports.
        max_request_bytes: upper bound for one export request, in bytes (estimated from the
            spans' attributes, events and links; see the module docstring).
        endpoint: for log lines only.
    """

    def __init__(
        self,
        factory: Callable[[], SpanExporter],
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        endpoint: str = "",
    ) -> None:
        super().__init__(factory, endpoint)
        self.max_request_bytes = max(4096, int(max_request_bytes))
        self.truncated_spans = 0
        self.drops = DropCounter(endpoint)

    def bind(self, meter_provider) -> None:
        """Count this process's lost spans in ``llm_otel.spans.dropped`` of ``meter_provider``."""
        self.drops.bind(meter_provider)

    @property
    def dropped(self) -> int:
        """Spans this process's exporter failed to export so far."""
        return self.drops.dropped

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.disowned:
            return SpanExportResult.SUCCESS
        inner = self.inner()
        result = SpanExportResult.SUCCESS
        try:
            chunks = self._chunks(spans)
        except Exception as exc:  # noqa: BLE001 - an odd span: send the batch as it is
            process_errors().report("export.exporters.split", exc, "could not size a span batch; it is sent whole")
            chunks = [spans]
        for chunk in chunks:
            self.in_flight += len(chunk)
            try:
                outcome = inner.export(chunk)
            except Exception as exc:  # noqa: BLE001 - silent: counted as a failed export (last_error, SDK result); the batch thread lives
                outcome = SpanExportResult.FAILURE
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self.in_flight -= len(chunk)
            if outcome is SpanExportResult.SUCCESS:
                self.drops.succeeded()
            else:
                self.failed += len(chunk)
                self.drops.failed(len(chunk))
                result = SpanExportResult.FAILURE
        return result

    def _chunks(self, spans: Sequence[ReadableSpan]) -> list[Sequence[ReadableSpan]]:
        """``spans`` split so that each chunk's estimated size is under the cap (usually one chunk)."""
        cap = self.max_request_bytes
        sizes = [estimate_span_bytes(s) for s in spans]
        if sum(sizes) <= cap:
            return [spans]
        chunks: list[Sequence[ReadableSpan]] = []
        current: list[ReadableSpan] = []
        used = 0
        for span, size in zip(spans, sizes, strict=False):
            if size > cap:
                span, size = self._shrink(span, size), cap
            if current and used + size > cap:
                chunks.append(current)
                current, used = [], 0
            current.append(span)
            used += size
        if current:
            chunks.append(current)
        return chunks

    def _shrink(self, span: ReadableSpan, size: int) -> ReadableSpan:
        """A copy of ``span`` whose string attributes are cut so that it fits the cap."""
        self.truncated_spans += 1
        if self.truncated_spans == 1:
            logger.warning(
                "llm-otel: span %r is about %d bytes encoded, over LLM_OTEL_OTLP_MAX_REQUEST_BYTES=%d; "
                "its largest attributes are shortened (captured messages stay valid JSON). "
                "Lower LLM_OTEL_CONTENT_MAX_CHARS to avoid this",
                span.name,
                size,
                self.max_request_bytes,
            )
        try:
            return shrink_span(span, self.max_request_bytes)
        except Exception as exc:  # noqa: BLE001 - worst case the collector rejects this one request
            process_errors().report(
                "export.exporters.shrink", exc, f"could not shorten span {span.name!r}; it is sent at its full size"
            )
            return span

    def shutdown(self, timeout_millis: float | None = None) -> None:
        """Shut the wrapped exporter down (bounded by ``timeout_millis`` where it takes one: the
        batch processor passes what is left of its own shutdown time)."""
        if self.disowned or self._pid != os.getpid():
            return
        # SpanExporter.shutdown() takes no timeout; the OTLP exporters' does (checked here)
        inner_shutdown: Callable[..., None] = self._inner.shutdown
        if timeout_millis is not None and "timeout_millis" in inspect.signature(inner_shutdown).parameters:
            inner_shutdown(timeout_millis=timeout_millis)
        else:
            inner_shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self.disowned or self._pid != os.getpid():
            return True
        return self._inner.force_flush(timeout_millis)


class ProcessMetricExporter(_PerProcess[MetricExporter], MetricExporter):
    """Metric exporter wrapper: per-process inner exporter and failure counts (metric requests are
    small - one point per series - so they are not split)."""

    def __init__(self, factory: Callable[[], MetricExporter], endpoint: str = "") -> None:
        _PerProcess.__init__(self, factory, endpoint)
        MetricExporter.__init__(
            self,
            preferred_temporality=self._inner._preferred_temporality,
            preferred_aggregation=self._inner._preferred_aggregation,
        )

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if self.disowned:
            return MetricExportResult.SUCCESS
        inner = self.inner()
        self.in_flight += 1
        try:
            outcome = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001 - silent: counted as a failed export (last_error, the SDK's export result)
            outcome = MetricExportResult.FAILURE
            self.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        if outcome is not MetricExportResult.SUCCESS:
            self.failed += 1
        return outcome

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        if self.disowned or self._pid != os.getpid():
            return True
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        if self.disowned or self._pid != os.getpid():
            return
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


# --- size estimate ------------------------------------------------------------------------------
def _value_bytes(value) -> int:
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_value_bytes(v) + 2 for v in value) + 4
    return _NUMBER_SIZE


def _attributes_bytes(attributes) -> int:
    if not attributes:
        return 0
    return sum(len(k) + _value_bytes(v) + _ATTRIBUTE_OVERHEAD for k, v in attributes.items())


def estimate_span_bytes(span: ReadableSpan) -> int:
    """Upper bound of ``span``'s size in an OTLP protobuf request, in bytes (resource and scope
    framing included once per span, so a batch's sum over-counts them)."""
    size = _SPAN_OVERHEAD + len(span.name) + _attributes_bytes(span.attributes)
    for event in span.events:
        size += 32 + len(event.name) + _attributes_bytes(event.attributes)
    for link in span.links:
        size += 64 + _attributes_bytes(link.attributes)
    ts = span.context.trace_state if span.context is not None else None
    if ts:
        size += sum(len(k) + len(v) + 2 for k, v in ts.items())
    if span.resource is not None:
        size += _attributes_bytes(span.resource.attributes)
    return size


def _shorten_message_json(raw: str, budget: int) -> str:
    """``raw`` (a GenAI messages JSON list) with every text part cut by the same fraction so that
    the result is valid JSON of at most ``budget`` bytes (UTF-8); ``"[]"`` if it is not JSON or
    nothing fits."""
    try:
        messages = json.loads(raw)
    except ValueError:
        return "[]"
    parts = [
        part
        for m in messages
        if isinstance(m, dict)
        for part in m.get("parts", ())
        if isinstance(part, dict) and isinstance(part.get("content"), str)
    ]
    texts = [p["content"] for p in parts]
    ascii_only = raw.isascii()

    def dump(fraction: float) -> str:
        for part, text in zip(parts, texts, strict=False):
            part["content"] = text[: int(len(text) * fraction)]
        return json.dumps(messages, ensure_ascii=ascii_only)

    def size(text: str) -> int:
        return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))

    full, fixed = size(raw), size(dump(0.0))  # escapes and framing scale with the text: cut in proportion
    if fixed > budget:
        return "[]"
    fraction = min(1.0, (budget - fixed) / max(1, full - fixed))
    for _ in range(8):
        out = dump(fraction)
        if size(out) <= budget:
            return out
        fraction *= 0.9
    return "[]"


def shrink_span(span: ReadableSpan, max_bytes: int) -> ReadableSpan:
    """A copy of ``span`` whose largest string attributes are shortened until its estimated
    size is under ``max_bytes``. Captured GenAI messages stay valid JSON; other strings are cut."""
    attributes = dict(span.attributes or {})
    excess = estimate_span_bytes(span) - max_bytes + 1024
    # every long string gives up the same fraction (a 5 MB prompt and a 3 MB completion both keep
    # their start), rather than the longest one all of it
    big = {k: _value_bytes(v) for k, v in attributes.items() if isinstance(v, str) and len(v) > 1024}
    total = sum(big.values())
    for key, before in big.items():
        if excess <= 0 or not total:
            break
        budget = max(0, before - int(excess * before / total) - 64)
        value = cast(str, attributes[key])  # big holds the string attributes only
        if key in _MESSAGE_ATTRIBUTES:
            attributes[key] = _shorten_message_json(value, budget)
        else:
            attributes[key] = value.encode("utf-8", "surrogatepass")[:budget].decode("utf-8", "ignore")
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )
