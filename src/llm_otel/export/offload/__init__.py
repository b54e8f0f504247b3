"""Span export out of the serving process: light recording spans here, SDK spans and OTLP in a
separate exporter process (``LLM_OTEL_EXPORT_PROCESS``, default on for the process that builds
its providers with :func:`llm_otel.export.providers.build_providers` and exports over OTLP).

Why: in a vLLM frontend the OpenTelemetry SDK's span machinery (attribute validation, locks, span
processors) and the batch processor's OTLP protobuf encoding (about 80 us per span, in a thread
that competes with the frontend for the GIL) cost about a millisecond per traced request. The
same idea as SGLang's ``SGLANG_TRACE_ASYNC``: the serving process decides everything that other
processes depend on - trace and span ids (from :class:`~llm_otel.export.providers.SystemRandomIdGenerator`),
the sampling decision and its ``tracestate`` (``ot=th``), parents and links - and keeps a span's
data as plain tuples; each ended span becomes one compact record in a bounded buffer. A daemon
thread pickles batches of records to the exporter process's stdin; the exporter process
(``python -m llm_otel.export.offload``) rebuilds SDK :class:`~opentelemetry.sdk.trace.ReadableSpan`
objects with the same ids, times, resource and scope (attribute and event limits applied there, as
the SDK would have here) and exports them through the same stack as the in-process path
(``BatchSpanProcessor`` + :class:`~llm_otel.export.exporters.ProcessSpanExporter`: request size
cap, OTLP settings from the ``OTEL_EXPORTER_OTLP_*`` environment it inherits).

Guarantees:

* **Request children built there.** ``llm.prompt`` and ``llm.token_stream`` of a finished request
  go as one tree record (:meth:`~recorder.OffloadTracer.ship_children`): ids and sampling decided here, the
  record's raw arrays; the exporter process runs the same
  :meth:`~llm_otel.telemetry.spans.SpanBuilder.children` on them (:func:`~replay.expand_trees`). A tree
  counts as its spans in the drop counters and the exporter process's acknowledgements.
* **Never blocks, bounded memory.** ``span.end()`` appends to a deque; when
  ``LLM_OTEL_EXPORT_PROCESS_BUFFER`` records (default 8192 spans) are waiting, new spans are
  dropped and counted in ``llm_otel.spans.dropped`` (``error.type=export_process_backlog``).
* **Exporter process death**: the spans of a batch that could not be written and those the dead
  process had not reported exported are counted (``error.type=export_process_down``), and so are
  the metric points it had recorded after the last export the collector accepted
  (``llm_otel.metric_points.dropped``; :class:`~replay.ChildMetrics` reports each export's mark), one log line
  per outage (:class:`~llm_otel.export.drops.DropCounter`), and a new exporter process is started
  for the next batch (at most one start per ``_RESPAWN_S`` seconds; in between, spans are dropped
  and counted). Nothing is raised into the caller.
* **Export failures in the exporter process** (collector down) are reported back in its status
  frames and counted here, in this process's ``llm_otel.spans.dropped`` (``export_failed``) - the
  metric stays where the serving process's metrics are. The exporter process exports on a thread
  of its own behind a queue bounded by the same ``LLM_OTEL_EXPORT_PROCESS_BUFFER`` in spans
  (:func:`~main.main`): a collector outage never stops it reading the pipe, so GenAI request metrics
  keep arriving and are aggregated through the outage, as in process; span frames the queue cannot
  take are reported lost at once (``export_process_backlog``: the exporter process fell behind, the
  collector did not fail).
* **Shutdown**: :meth:`~recorder.OffloadTracerProvider.shutdown` (called by the lifecycle's final flush)
  sends what is buffered, asks the exporter process to flush and exit within the remaining
  deadline, and waits for its answer; spans it had not delivered are reported (``failed``,
  ``in_flight``) in the lifecycle's exit line.
* **Fork**: the buffer, thread and exporter process belong to the process that created them; in
  a forked child, spans go to a new buffer and exporter process of the child's own (the parent's
  pipe is never written), unless the child disowned the inherited exporters
  (:func:`llm_otel.export.exporters.disown_inherited`, vLLM engine processes): then they are
  dropped uncounted, as with the in-process exporters.
* **Start**: the exporter process starts with the first span or metric observation (under
  ``opentelemetry-instrument`` every Python process builds providers, most never make a span);
  :func:`~recorder.prewarm` starts it at once where llm-otel knows the process will export (a vLLM
  frontend when it starts building ``LLMEngine``/``AsyncLLM``; LightLLM's HTTP worker, router and
  master model-infer workers when they are re-labelled; SGLang's HTTP process and schedulers start
  theirs during their own start-up anyway), so that its start-up overlaps the server's instead of
  the first requests (a router's first step spans waited for it under load); a process that merely
  has the engine installed, or exports nothing (a detokenizer), starts none. It runs
  without the auto-instrumentation ``sitecustomize`` its environment would otherwise carry.
* **Re-labels** (:func:`llm_otel.process.identity.relabel`, also after fork): a ``resource`` frame
  goes in order with the spans (spans ended before keep the old resource); the exporter process's
  meter provider is re-labelled in place, as the serving process's is; a forked child's own
  exporter process starts with the child's resource.
* **Values pickle cannot encode** (an object another instrumentation set as an attribute): that
  frame is encoded record by record and the values the SDK would reject are dropped and counted
  (``attributes_dropped``, one log line), not the frame; lists are copied when set, as the SDK does.

**Per-request metrics built there too** (when llm-otel built the meter provider for OTLP: the
core's metrics outlet, :meth:`~recorder.OffloadOutlets.request_metrics`): a finished request's
GenAI observations go as one record (:meth:`~llm_otel.telemetry.metrics.Instruments.observations`:
values, attribute sets and the request span's ids), and the exporter process records them with the same
:meth:`~llm_otel.telemetry.metrics.Instruments.apply` into the same instruments, the exemplar
context rebuilt from those ids. Other metrics (gauges, the drop counters, the application's own
meter provider) stay in the serving process.

Modules, one concept each: :mod:`~llm_otel.export.offload.recorder` (recording in the serving
process: tracer provider, light spans, request trees, the core's outlets), :mod:`~llm_otel.export.offload.writer`
(bounded record buffer, writer thread, exporter-process starts and status, remote instruments),
:mod:`~llm_otel.export.offload.frames` (the frame protocol and record layouts),
:mod:`~llm_otel.export.offload.main` (the exporter process's main loop, ``__main__`` runs it) and
:mod:`~llm_otel.export.offload.replay` (SDK spans rebuilt from records, request trees expanded,
metrics replayed into the same instruments). How the telemetry core reaches them: it declares its
outlets in :mod:`llm_otel.telemetry.outlets`; :func:`request_outlets` makes this package's for a
pair of providers, and whoever builds ``Telemetry`` passes them in (``Telemetry(..., outlets=...)``).
"""

from llm_otel.export.offload.recorder import (
    OffloadOutlets,
    OffloadSpan,
    OffloadTracer,
    OffloadTracerProvider,
    prewarm,
    request_outlets,
)
from llm_otel.export.offload.replay import expand_trees
from llm_otel.export.offload.writer import (
    BACKLOG,
    DEFAULT_BUFFER,
    DOWN,
    ENCODING,
    MetricAccount,
    OffloadBuffer,
    RemoteInstrument,
)

__all__ = [
    "BACKLOG",
    "DEFAULT_BUFFER",
    "DOWN",
    "ENCODING",
    "MetricAccount",
    "OffloadBuffer",
    "OffloadOutlets",
    "OffloadSpan",
    "OffloadTracer",
    "OffloadTracerProvider",
    "RemoteInstrument",
    "expand_trees",
    "prewarm",
    "request_outlets",
]
