"""Prometheus pull endpoint: the OpenTelemetry Prometheus exporter, with exemplars.

``OTEL_METRICS_EXPORTER=prometheus`` (or ``llm_otel.instrument(prometheus_port=...)``) makes each
instrumented process serve its metrics over HTTP, on ``OTEL_EXPORTER_PROMETHEUS_HOST``
(default ``localhost``) and a port per process role, so that vLLM's processes never collide:

==============================  ==========================================  ============================
process                         port                                        metrics
==============================  ==========================================  ============================
frontend (API server *i*)       ``OTEL_EXPORTER_PROMETHEUS_PORT`` (9464)     per-request (TTFT, TPOT, ITL,
                                minus *i* (``ApiServer_<i>``; 0 when there  ...), requests by finish
                                is one frontend)                            reason, sampling probability,
                                                                            self-metrics
engine core                     port + 1 + data-parallel rank               KV cache, prefix cache, queue,
(``EngineCore_DP<rank>``)                                                   GPU utilisation/memory by phase
workers                         none (they record no metrics)
``vllm serve`` launcher of      none (it serves no requests)
several API servers
==============================  ==========================================  ============================

The scheme, and when a vLLM frontend binds its port (once it serves requests), are
:mod:`llm_otel.process.ports`'s (it hands the port to :func:`prometheus_reader`).

Exemplars: the upstream exporter (``opentelemetry-exporter-prometheus``) drops them; the reader
here attaches each histogram bucket's SDK exemplar (``trace_id``, ``span_id`` labels) to that
bucket's sample. A bucket shows its latest exemplar on every OpenMetrics scrape, whoever scrapes
(an HA pair, a ``curl``); plain-text scrapes show none and take none away. Prometheus keeps them when it scrapes the OpenMetrics format (it asks for it)
and runs with ``--enable-feature=exemplar-storage``.

Each process serves its own ``prometheus_client`` registry (not the global one vLLM's API server
exposes on ``/metrics``). A port already in use is logged once and metrics stay unexposed in that
process; the engine is unaffected. Importing this module needs ``opentelemetry-exporter-prometheus``
(``pip install 'llm-otel[prometheus]'``); :func:`llm_otel.process.ports.prometheus_reader_from_env`
reports its absence instead.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader  # opentelemetry-exporter-prometheus
from prometheus_client import CollectorRegistry, start_http_server

from llm_otel.config import PROMETHEUS_HOST, PROMETHEUS_PORT, prometheus_host
from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")

DEFAULT_PORT = PROMETHEUS_PORT  # OpenTelemetry's default for OTEL_EXPORTER_PROMETHEUS_PORT
DEFAULT_HOST = PROMETHEUS_HOST


def prometheus_reader(
    env: Mapping[str, str],
    role: str,
    port: int | None,
    defer: Callable[[Callable[[], bool]], bool | None] | None = None,
):
    """A metric reader serving this process's metrics on ``port`` (from
    :func:`llm_otel.process.ports.prometheus_port`), or None (no port: a worker; or the port is
    busy: logged). ``defer``: how to start the endpoint later (a vLLM frontend binds once it serves
    requests, :func:`llm_otel.process.ports.when_serving`: it returns None while it waits, and until
    then the reader collects nothing); None starts it now. ``role`` names the process in log lines."""
    if port is None:
        return None
    host = prometheus_host(env)
    registry = CollectorRegistry(auto_describe=False)
    reader = ExemplarPrometheusMetricReader(registry=registry)

    def start() -> bool:
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            process_errors().report(
                "export.prometheus.serve",
                exc,
                f"cannot serve Prometheus metrics on {host}:{port}; this {role} process's metrics are not exposed",
            )
            return False
        logger.info("llm-otel: Prometheus metrics of this %s process on http://%s:%d/metrics", role, host, port)
        return True

    started = defer(start) if defer is not None else start()
    return None if started is False else reader  # None: deferred until this process serves


class _ExemplarIndex:
    """Latest exemplar per histogram bucket, keyed by sanitized metric name -> label set -> {le: exemplar}.

    The SDK's exemplar reservoirs are emptied by every collection, and every scrape (OpenMetrics or
    plain text, from any scraper) runs one; so the index is part of the reader's state, like the
    cumulative histogram itself: :meth:`merged` keeps a bucket's exemplar until a newer measurement
    in that bucket replaces it, and a scrape only reads it."""

    def __init__(self) -> None:
        self.by_metric: dict[str, dict[frozenset, dict[str, Any]]] = {}

    @classmethod
    def build(cls, metrics_data, scope_labels: bool) -> _ExemplarIndex:
        from opentelemetry.exporter.prometheus._mapping import sanitize_attribute, sanitize_full_name
        from opentelemetry.sdk.metrics.export import Histogram
        from prometheus_client.samples import Exemplar

        index = cls()
        for rm in metrics_data.resource_metrics:
            for sm in rm.scope_metrics:
                scope = {}
                if scope_labels:
                    scope = {
                        "otel_scope_name": sm.scope.name or "",
                        "otel_scope_version": sm.scope.version or "",
                        "otel_scope_schema_url": sm.scope.schema_url or "",
                    }
                    for key, value in (sm.scope.attributes or {}).items():
                        scope[sanitize_attribute("otel_scope_" + key)] = _label_value(value)
                for metric in sm.metrics:
                    if not isinstance(metric.data, Histogram):
                        continue
                    points = index.by_metric.setdefault(sanitize_full_name(metric.name), {})
                    for point in metric.data.data_points:
                        labels = dict(scope)
                        for key, value in (point.attributes or {}).items():
                            labels[sanitize_attribute(key)] = _label_value(value)
                        bounds = list(point.explicit_bounds)
                        by_le = {}
                        for ex in point.exemplars:
                            if not ex.trace_id:
                                continue
                            i = bisect.bisect_left(bounds, ex.value)
                            le = f"{bounds[i]}" if i < len(bounds) else "+Inf"
                            by_le[le] = Exemplar(
                                {"trace_id": f"{ex.trace_id:032x}", "span_id": f"{ex.span_id:016x}"},
                                ex.value,
                                ex.time_unix_nano / 1e9,
                            )
                        points[_key(labels)] = by_le  # present, even without new exemplars
        return index

    def merged(self, previous: _ExemplarIndex | None) -> _ExemplarIndex:
        """This collection's exemplars over ``previous``'s: a bucket keeps its last exemplar until a
        newer one replaces it; series no longer collected are dropped (bounded by the SDK's series)."""
        if previous is not None:
            for name, points in self.by_metric.items():
                old_points = previous.by_metric.get(name, {})
                for key, by_le in points.items():
                    old = old_points.get(key)
                    if old:
                        points[key] = {**old, **by_le}
        for name in list(self.by_metric):
            points = self.by_metric[name]
            for key in [k for k, v in points.items() if not v]:
                del points[key]
            if not points:
                del self.by_metric[name]
        return self

    def attach(self, family) -> None:
        """Put the exemplars on ``family``'s ``_bucket`` samples (a prometheus_client Metric)."""
        names = [n for n in self.by_metric if family.name == n or family.name.startswith(n + "_")]
        if not names:
            return
        points = self.by_metric[max(names, key=len)]
        if not points:
            return
        for i, sample in enumerate(family.samples):
            if not sample.name.endswith("_bucket"):
                continue
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            ex = points.get(_key(labels), {}).get(le)
            if ex is not None:
                family.samples[i] = sample._replace(exemplar=ex)


def _key(labels: Mapping[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in labels.items() if v != "")


def _label_value(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value, default=str)


class _ExemplarCollector:
    """Wraps the upstream collector: its families, with exemplars on histogram buckets."""

    def __init__(self, inner, reader) -> None:
        self._inner = inner
        self._reader = reader

    def collect(self):
        for family in self._inner.collect():  # runs the reader's collection first
            if family.type == "histogram" and self._reader._index is not None:
                try:
                    self._reader._index.attach(family)
                except Exception as exc:  # noqa: BLE001 - a scrape without exemplars beats no scrape
                    self._reader._warn(exc)
            yield family


class ExemplarPrometheusMetricReader(PrometheusMetricReader):
    """``PrometheusMetricReader`` whose histogram buckets carry the SDK's exemplars (``trace_id``,
    ``span_id`` labels). Arguments are the upstream reader's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._index: _ExemplarIndex | None = None
        self._index_lock = threading.Lock()  # concurrent scrapes (prometheus_client serves in threads)
        self._scope_labels = kwargs.get("scope_info_enabled", True)
        self._registry.unregister(self._collector)
        self._wrapper = _ExemplarCollector(self._collector, self)
        self._registry.register(self._wrapper)

    def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        if metrics_data is not None:
            try:
                with self._index_lock:
                    self._index = _ExemplarIndex.build(metrics_data, self._scope_labels).merged(self._index)
            except Exception as exc:  # noqa: BLE001 - keep the previous exemplars, expose the metrics
                self._warn(exc)
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)

    def _warn(self, exc: BaseException) -> None:
        process_errors().report(
            "export.prometheus.exemplars", exc, "Prometheus exemplars unavailable; metrics are exposed without them"
        )

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._registry.unregister(self._wrapper)
