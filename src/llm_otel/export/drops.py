"""Spans lost on the way to the collector: counted and logged once, never raised.

A collector that is down or slower than ``OTEL_EXPORTER_OTLP_TIMEOUT`` must not reach the engine:
the batch span processor's worker thread waits for the exporter (the engine's threads only append
to its bounded queue), and a batch the exporter gives up on is lost. The OpenTelemetry SDK logs
every retry and every failed batch - a warning every few seconds for as long as the outage lasts -
and counts nothing unless its internal metrics are switched on. :class:`DropCounter` does this for
the OTLP span exporter llm-otel builds for a process
(:class:`llm_otel.export.exporters.ProcessSpanExporter`):

* each batch the exporter returns as failed adds its span count to the counter
  ``llm_otel.spans.dropped`` (``{span}``, ``error.type="export_failed"``) of the process's meter
  provider (bound after that provider exists; drops before are counted once it is bound);
* the first failure of an outage is logged once at WARNING with the endpoint and what happens
  next; the first success after it once at INFO; nothing in between;
* the SDK's own per-retry / per-batch lines of the OTLP trace exporters are filtered out of the
  log while llm-otel reports them (only the trace exporters' lines, only those two messages; the
  metric exporter's stay).

Spans the batch processor drops because its queue is full (``OTEL_BSP_MAX_QUEUE_SIZE``, 2048)
are logged by the SDK itself (rate-limited) and not counted here.
"""

from __future__ import annotations

import logging
import threading

from llm_otel.errors import process_errors
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")

# the OTLP trace exporters' loggers and the messages they repeat for every retry / failed batch
_SDK_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)
_SDK_REPEATED = ("Transient error", "Failed to export")


class _RepeatedExportFailures(logging.Filter):
    """Drops the OTLP exporters' per-retry and per-batch failure lines (llm-otel logs the outage once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_SDK_REPEATED)):
            return True
        # the gRPC module's logger serves the metric and log exporters too: keep their lines
        return record.name != _SDK_EXPORTER_LOGGERS[0] or "traces" not in (record.args or ())


_FILTER = _RepeatedExportFailures()


class DropCounter:
    """Counts and logs the spans a process's exporter fails to export.

    Used by :class:`llm_otel.export.exporters.ProcessSpanExporter` (the OTLP span exporter llm-otel
    builds for each process). ``endpoint``: where it sends, for the log line. :meth:`bind` gives it
    the meter provider whose counter ``llm_otel.spans.dropped`` it adds to. Runs on the batch
    processor's worker thread, never on the engine's; never raises.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.dropped = 0  # spans lost so far in this process
        self._unbound: dict[str, int] = {}  # of which not yet added to a counter, by error.type
        self._counter = None
        self._failing = False
        self._lock = threading.Lock()
        for name in _SDK_EXPORTER_LOGGERS:
            sdk_logger = logging.getLogger(name)
            if _FILTER not in sdk_logger.filters:
                sdk_logger.addFilter(_FILTER)

    def reset(self) -> None:
        """A new process (forked): nothing lost here yet, nothing bound."""
        self.dropped = 0
        self._unbound = {}
        self._counter = None
        self._failing = False
        self._lock = threading.Lock()

    def bind(self, meter_provider) -> None:
        """Create the counter on ``meter_provider`` and add the drops counted before it existed."""
        try:
            counter = meter_provider.get_meter("llm_otel").create_counter(
                M.LLM_OTEL_SPANS_DROPPED,
                unit=M.LLM_OTEL_SPANS_DROPPED_UNIT,
                description="Spans this process could not export to its collector.",
            )
        except Exception as exc:  # noqa: BLE001 - a metrics problem must not stop tracing
            process_errors().report(
                "export.drops.counter",
                exc,
                f"cannot create {M.LLM_OTEL_SPANS_DROPPED}; dropped spans are logged, not counted",
            )
            return
        with self._lock:
            self._counter, pending, self._unbound = counter, self._unbound, {}
        for error_type, n in pending.items():
            counter.add(n, {A.ERROR_TYPE: error_type})

    def succeeded(self) -> None:
        if self._failing:
            self._failing = False
            logger.info(
                "llm-otel: span export to %s works again (%d span(s) lost in all so far)", self.endpoint, self.dropped
            )

    def failed(self, n: int, error_type: str = "export_failed", why: str | None = None) -> None:
        """``n`` spans lost; ``error_type`` says why (``export_failed``: the collector did not take
        them; ``export_process_backlog`` / ``export_process_down`` / ``export_process_encoding``:
        :mod:`llm_otel.export.offload`); ``why``: the error text for the log line."""
        with self._lock:
            self.dropped += n
            counter = self._counter
            if counter is None:
                self._unbound[error_type] = self._unbound.get(error_type, 0) + n
            first = not self._failing
            self._failing = True
        if counter is not None:
            counter.add(n, {A.ERROR_TYPE: error_type})
        if first:
            # the line names the failing part: the collector, or this process's own exporter process
            what = _WHAT.get(error_type, "span export to {endpoint} failed").format(endpoint=self.endpoint)
            logger.warning(
                "llm-otel: %s%s, %d span(s) dropped; the engine keeps serving. Further drops are "
                "counted in %s{error.type=%s}, not logged, until an export succeeds",
                what,
                f" ({why})" if why else "",
                n,
                M.LLM_OTEL_SPANS_DROPPED,
                error_type,
            )


# the failing part per error.type, for the one log line of an outage (export_failed: the collector)
_WHAT = {
    "export_process_down": "the span exporter process is not running (a new one is started within 5 s; "
    "the collector at {endpoint} was not reached)",
    "export_process_backlog": "the span exporter process is falling behind (its buffer is full; "
    "LLM_OTEL_EXPORT_PROCESS_BUFFER)",
    "export_process_encoding": "span data could not be encoded for the exporter process",
}
