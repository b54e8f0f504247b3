"""What the core hands finished work to when it is not built or recorded in this process.

The core builds spans and records metrics through the OpenTelemetry API. Where spans leave this
process as compact records for another one to build (the exporter process,
:mod:`llm_otel.export.offload`), a finished request's ``llm.prompt`` / ``llm.token_stream`` and its
per-request metric observations can go there as records too. The core declares here what it needs;
the export side implements it, and whoever builds :class:`~llm_otel.telemetry.Telemetry` passes the
object in (``Telemetry(..., outlets=...)``, as ``llm_otel.export.offload.request_outlets`` makes it
for a pair of providers). The core never imports the export side and never looks for these
capabilities on the providers it is given: without outlets everything is built and recorded here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanContext, Tracer

    from llm_otel.config import Settings
    from llm_otel.telemetry.record import RequestRecord

__all__ = ["MetricInstrument", "MetricsOutlet", "RequestOutlets", "SpanTreeOutlet"]


class SpanTreeOutlet(Protocol):
    """Where a finished request's ``llm.prompt`` and ``llm.token_stream`` are built
    (:class:`~llm_otel.telemetry.spans.SpanBuilder` asks it first)."""

    def ship_children(self, rec: RequestRecord, end_ns: int, settings: Settings) -> bool:
        """Hand ``rec``'s children over to be built elsewhere by
        :meth:`~llm_otel.telemetry.spans.SpanBuilder.children` (their ids and sampling decided
        now); ``end_ns``: the request's end, epoch ns, >= arrival. False, having done nothing, when
        it cannot take this request (the core builds the children itself)."""
        ...


class MetricInstrument(Protocol):
    """The part of an OpenTelemetry histogram or counter the core calls."""

    def record(
        self, amount: float, attributes: Mapping[str, Any] | None = None, context: Context | None = None
    ) -> None: ...

    def add(
        self, amount: float, attributes: Mapping[str, Any] | None = None, context: Context | None = None
    ) -> None: ...


class MetricsOutlet(Protocol):
    """Where the per-request metric observations are recorded (the same instruments, elsewhere)."""

    def instrument(self, name: str) -> MetricInstrument:
        """The stand-in for the core's per-request instrument ``name``: an attribute name of
        :class:`~llm_otel.telemetry.metrics.Instruments` (``duration``, ``ttft``, ``tpot``,
        ``itl``, ``token_rate``, ``queue``, ``tokens``, ``requests``) or of
        :class:`~llm_otel.signals.Signals` (``kv_size``, ``slo_checks``)."""
        ...

    def push_request(self, observations: tuple[Any, ...], span_context: SpanContext | None) -> None:
        """One finished request's observations (:meth:`Instruments.observations
        <llm_otel.telemetry.metrics.Instruments.observations>`), recorded elsewhere by
        :meth:`~llm_otel.telemetry.metrics.Instruments.apply`; ``span_context``: the request
        span's (None when it is not recording), for the exemplars. O(1), never blocks."""
        ...


class RequestOutlets(Protocol):
    """What :class:`~llm_otel.telemetry.Telemetry` is handed at wiring time (its ``outlets``)."""

    def span_tree(self, tracer: Tracer) -> SpanTreeOutlet | None:
        """Where the request trees of spans started by ``tracer`` (the core's) go; None: built here."""
        ...

    def request_metrics(self, scope: tuple[str, str, str], itl_every: int) -> MetricsOutlet | None:
        """Where the per-request observations of the core's meter (``scope``: name, version,
        schema_url; ``itl_every``: the ITL sampling of its instruments) go; None: recorded here."""
        ...
