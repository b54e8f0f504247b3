"""The serving-signal service: instruments, per-request observations and the 1 s thread.

:class:`Signals` is a listener of the core's request lifecycle (:mod:`llm_otel.listeners`):
:meth:`Signals.on_start` classifies and admits a request, :meth:`Signals.on_tokens` counts output
tokens per engine step, :meth:`Signals.on_finish` checks the tier's SLOs; they return what belongs
on the request span and the core puts it there. Formulas, units and sources: docs/signals.md.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.metrics import Meter, Observation

from llm_otel.config.signals import SignalsConfig
from llm_otel.config.tiers import Tier
from llm_otel.errors import guard, process_errors
from llm_otel.listeners import RequestFacts, SpanNotes
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.semconv import spans as S
from llm_otel.signals.classes import DIMENSIONS, ClassExtractor
from llm_otel.signals.health import HealthScore, HealthServer, otlp_endpoint_reachable
from llm_otel.signals.kv import KVSpec
from llm_otel.signals.pressure import LEVELS, PressureMonitor

logger = logging.getLogger("llm_otel")

__all__ = ["Signals", "request_instruments", "kv_source_for"]

GIB = float(1 << 30)


def request_instruments(meter: Meter) -> tuple:
    """``(llm.server.request.kv_cache.size histogram, llm.server.slo.checks counter)`` of ``meter``:
    the per-request signal instruments, created the same way in the serving process
    (:class:`Signals`) and in the exporter process (``llm_otel.export.offload.replay``)."""
    kv_size = meter.create_histogram(
        M.LLM_SERVER_REQUEST_KV_CACHE_SIZE,
        unit=M.LLM_SERVER_REQUEST_KV_CACHE_SIZE_UNIT,
        description="Estimated KV-cache bytes per request at admission and finish.",
        explicit_bucket_boundaries_advisory=list(M.LLM_SERVER_REQUEST_KV_CACHE_SIZE_BUCKETS),
    )
    slo_checks = meter.create_counter(
        M.LLM_SERVER_SLO_CHECKS,
        unit=M.LLM_SERVER_SLO_CHECKS_UNIT,
        description="Finished requests checked against their tier's targets.",
    )
    return kv_size, slo_checks


_BUCKETS = 2048  # token-rate ring: 2000 buckets span the efficiency window (48 spare)
_SLOT_MASK = _BUCKETS - 1


class Signals:
    """Per-``instrument()`` signal state and instruments.

    Args:
        meter: where the signal metrics go.
        config: :class:`SignalsConfig` (from the environment when None).
        poller: a :class:`llm_otel.gpu.nvml.UtilizationPoller` to share (the adaptive sampler's);
            one on NVML is created at :meth:`start` when None.
        instruments: ``(kv_size, slo_checks)`` stand-ins that record the per-request
            observations elsewhere (the exporter process, when llm-otel built the providers; made
            by the core's metrics outlet); None: :func:`request_instruments` of ``meter``.
    """

    error_key = "telemetry.signals"  # lifecycle listener: its failures count under this hook name

    def __init__(
        self, meter: Meter, config: SignalsConfig | None = None, poller: Any = None, instruments: tuple | None = None
    ) -> None:
        self.config = cfg = config or SignalsConfig.from_env()
        self.tiers = cfg.tiers
        self.poller = poller
        # the /healthz port of this process from the configured base: the base itself, unless the
        # engine's adapter says otherwise at wiring (a vLLM API server i listens on base - i,
        # llm_otel.process.ports.frontend_port)
        self.health_port_for: Callable[[int], int] = lambda base: base
        self._collapsed = meter.create_counter(
            M.LLM_OTEL_REQUEST_CLASS_COLLAPSED,
            unit=M.LLM_OTEL_REQUEST_CLASS_COLLAPSED_UNIT,
            description="Request-class values replaced by 'other'.",
        )
        self.classes = ClassExtractor(
            cfg.class_sources,
            cfg.class_max_values,
            cfg.class_max_len,
            reserved=self.tiers.reserved() if self.tiers else None,
            on_collapse=lambda dim, reason: self._collapsed.add(
                1, {A.LLM_REQUEST_CLASS_KEY: dim, A.LLM_REQUEST_CLASS_REASON: reason}
            ),
        )
        # every (dimension, reason) series starts at 0, so rate()/increase() see the first collapse
        for dim in self.classes.sources:
            for reason in ClassExtractor.REASONS:
                self._collapsed.add(0, {A.LLM_REQUEST_CLASS_KEY: dim, A.LLM_REQUEST_CLASS_REASON: reason})
        # per-request instruments: recorded in the exporter process when llm-otel built the providers
        # (stand-ins handed in), else on this meter
        self.kv_size, self.slo_checks = instruments if instruments is not None else request_instruments(meter)
        for name, callback, unit, description in (
            (
                M.LLM_SERVER_TOKEN_EFFICIENCY,
                self._observe_efficiency,
                M.LLM_SERVER_TOKEN_EFFICIENCY_UNIT,
                "Output tokens/s per GiB of GPU memory in use.",
            ),
            (
                M.LLM_SERVER_VRAM_PRESSURE,
                self._observe_pressure,
                M.LLM_SERVER_VRAM_PRESSURE_UNIT,
                "VRAM pressure level: 0 ok, 1 warn, 2 critical.",
            ),
            (
                M.LLM_SERVER_VRAM_USAGE,
                self._observe_usage,
                M.LLM_SERVER_VRAM_USAGE_UNIT,
                "Memory usage fraction behind the pressure level.",
            ),
            (
                M.LLM_SERVER_HEALTH_SCORE,
                self._observe_health,
                M.LLM_SERVER_HEALTH_SCORE_UNIT,
                "Weighted health score in [0, 1].",
            ),
        ):
            meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
        self.pressure = PressureMonitor(
            cfg.vram_warn,
            cfg.vram_warn_hold_s,
            cfg.vram_critical,
            cfg.vram_critical_hold_s,
            cfg.vram_clear_margin,
            cfg.vram_clear_hold_s,
        )
        self.health = HealthScore(
            cfg.health_weights,
            cfg.health_ttft_target_s,
            cfg.health_max_error_rate,
            cfg.health_gpu_knee,
            cfg.health_warmup_s,
            cfg.health_window_s,
            utilization=self._utilization,
        )
        self._kv_sources: list[Callable[[], tuple[int, int] | None]] = []
        # output tokens per time bucket over the efficiency window: a preallocated ring, so any token
        # rate is counted in fixed memory (a bounded list of steps capped the rate it could see:
        # LightLLM reports every token, vLLM steps over a long window - fresh-install review)
        self._bucket_s = max(cfg.efficiency_window_s, 1e-3) / (_BUCKETS - 48)
        self._buckets_per_s = 1.0 / self._bucket_s
        self._bucket_ids = [-1] * _BUCKETS
        self._bucket_tokens = [0] * _BUCKETS
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.health_server: HealthServer | None = None
        self._exporter_checked: tuple[float, bool | None] = (-1e18, None)
        self._own_poller = False

    # --- request path ----------------------------------------------------------------------
    def classify(
        self, headers: Any = None, engine_fields: Mapping[str, str | None] | None = None
    ) -> tuple[dict, dict, Tier | None]:
        """Span attributes, metric attributes and tier of one request (``engine_fields``: see
        :meth:`~llm_otel.signals.classes.ClassExtractor.extract`). Never raises."""
        try:
            values, labels = self.classes.extract(headers, engine_fields)
            if self.config.model_revision is not None and "revision" not in values:
                values["revision"] = labels["revision"] = self.config.model_revision
            tier = self.tiers.tier_for(values) if self.tiers is not None else None
            span_attrs = {DIMENSIONS[d]: v for d, v in values.items()}
            metric_attrs = {DIMENSIONS[d]: v for d, v in labels.items()}
            if tier is not None:
                span_attrs[A.LLM_REQUEST_TIER] = metric_attrs[A.LLM_REQUEST_TIER] = tier.name
            return span_attrs, metric_attrs, tier
        except Exception as exc:  # noqa: BLE001
            process_errors().report(
                "signals.classify", exc, "request classification failed; the request has no class or tier"
            )
            return {}, {}, None

    def on_start(self, rec: Any, facts: RequestFacts) -> SpanNotes:
        """Lifecycle listener at request start: classify it from ``facts`` (headers, engine
        fields), admit it (labels and tier on the record, KV estimate of the prompt) and return
        what goes on its span (class and tier attributes, KV prompt bytes, a VRAM pressure event)."""
        span_attrs, metric_attrs, tier = self.classify(facts.headers, facts.engine_fields)
        notes = self._admission(rec, metric_attrs, tier, facts.kv)
        return notes._replace(request_attributes=span_attrs) if span_attrs else notes

    def admit(self, rec: Any, metric_attrs: Mapping[str, Any], tier: Tier | None, kv: KVSpec | None) -> None:
        """At admission: keep class labels on the record, KV estimate of the prompt, pressure event
        (for a caller that classified the request itself; adapters let :meth:`on_start` do it)."""
        notes = self._admission(rec, metric_attrs, tier, kv)
        if rec.recording:
            if notes.attributes:
                rec.span.set_attributes(notes.attributes)
            for name, attrs in notes.events:
                rec.span.add_event(name, attrs)

    def _admission(self, rec: Any, metric_attrs: Mapping[str, Any], tier: Tier | None, kv: KVSpec | None) -> SpanNotes:
        rec.metric_attributes = dict(metric_attrs)
        rec.signal_state = (tier, kv)
        attributes: dict[str, Any] | None = None
        if kv is not None:
            size = kv.bytes(rec.input_tokens)
            attrs: dict[str, Any] = {A.GEN_AI_REQUEST_MODEL: rec.model, A.LLM_KV_CACHE_PHASE: "admission"}
            if tier is not None:
                attrs[A.LLM_REQUEST_TIER] = tier.name
            self.kv_size.record(size, attrs)
            attributes = {A.LLM_REQUEST_KV_CACHE_PROMPT_BYTES: size}
        events: tuple[tuple[str, dict[str, Any]], ...] = ()
        level = self.pressure.level
        if level != "ok" and rec.recording:
            event: dict[str, Any] = {A.LLM_VRAM_PRESSURE_LEVEL: level}
            if self.pressure.usage is not None:
                event[A.LLM_VRAM_USAGE] = float(self.pressure.usage)
            if self.pressure.source is not None:
                event[A.LLM_VRAM_SOURCE] = self.pressure.source
            events = ((S.EVENT_LLM_VRAM_PRESSURE, event),)
        return SpanNotes(None, attributes, events)

    def on_tokens(self, count: int, engine_mono: float) -> None:
        """Output tokens an engine step produced at ``engine_mono`` (monotonic seconds); hot path:
        one bucket update, O(1), no allocation. A stamp older than the window is dropped."""
        if count:
            idx = int(engine_mono * self._buckets_per_s)
            slot = idx & _SLOT_MASK
            ids = self._bucket_ids
            held = ids[slot]
            if idx == held:
                self._bucket_tokens[slot] += count
            elif idx > held:
                ids[slot] = idx
                self._bucket_tokens[slot] = count

    @property
    def _steps(self) -> list[tuple[float, int]]:
        """``(bucket start, monotonic s; output tokens)`` of the buckets that hold tokens, oldest first."""
        return sorted(
            (i * self._bucket_s, n) for i, n in zip(self._bucket_ids, self._bucket_tokens, strict=False) if i >= 0 and n
        )

    def on_finish(self, rec: Any, duration_s: float) -> SpanNotes | None:
        """Lifecycle listener at finish: KV estimate of prompt + output, SLO checks of the tier,
        health windows; returns the KV attributes for the request span."""
        tier, kv = getattr(rec, "signal_state", None) or (None, None)
        ttft = rec.time_to_first_token_s()
        # a client that went away is not the server failing (as in the availability SLO rules)
        client_gone = rec.error_type == "aborted"
        error = rec.error_type is not None and not client_gone
        self.health.observe(ttft, error)
        notes = None
        if kv is not None:
            tokens = rec.input_tokens + max(0, rec.num_output_tokens - 1)
            size = kv.bytes(tokens)
            attrs = {A.GEN_AI_REQUEST_MODEL: rec.model, A.LLM_KV_CACHE_PHASE: "finish"}
            if tier is not None:
                attrs[A.LLM_REQUEST_TIER] = tier.name
            self.kv_size.record(size, attrs)
            if rec.recording:
                span_attrs = {
                    A.LLM_REQUEST_KV_CACHE_FINAL_BYTES: size,
                    A.LLM_REQUEST_KV_CACHE_BLOCKS: kv.blocks(tokens),
                }
                if rec.cached_tokens is not None:
                    span_attrs[A.LLM_REQUEST_KV_CACHE_CACHED_BLOCKS] = rec.cached_tokens // kv.block_size
                notes = SpanNotes(None, span_attrs)
        if tier is None:
            return notes
        base = {A.GEN_AI_REQUEST_MODEL: rec.model, A.LLM_REQUEST_TIER: tier.name}

        def check(objective: str, met: bool) -> None:
            self.slo_checks.add(
                1, {**base, A.LLM_SLO_OBJECTIVE: objective, A.LLM_SLO_OUTCOME: "met" if met else "breached"}
            )

        if client_gone:
            return notes  # neither met nor breached: the client left before the server was done
        check("availability", not error)
        if error:
            return notes  # latency objectives count successful requests only
        targets = tier.targets
        if "ttft" in targets and ttft is not None:
            check("ttft", ttft <= targets["ttft"])
        tpot = rec.time_per_output_token_s()
        if "tpot" in targets and tpot is not None:
            check("tpot", tpot <= targets["tpot"])
        if "e2e" in targets:
            check("e2e", duration_s <= targets["e2e"])
        return notes

    # --- engines and the background thread -----------------------------------------------
    def attach_kv_source(self, source: Callable[[], tuple[int, int] | None]) -> None:
        """``source() -> (blocks held by live requests, blocks in the pool)`` or None; starts the
        background thread (and the health endpoint when configured)."""
        with self._lock:
            self._kv_sources.append(source)
        self.start()

    def start(self) -> Signals:
        """Start the NVML poller (if none is shared), the 1 s tick thread and the health endpoint."""
        with self._lock:
            if self._thread is not None:
                return self
            if self.poller is None:
                from llm_otel.gpu.nvml import UtilizationPoller

                self.poller = UtilizationPoller.from_nvml().start()
                self._own_poller = True
            self._thread = threading.Thread(target=self._loop, name="llm-otel-signals", daemon=True)
            self._thread.start()
            from llm_otel.process.forks import restart_in_fork_child  # a leaf: imports nothing of llm_otel

            restart_in_fork_child(self)
        if self.config.health_port is not None and self.health_server is None:
            port = self.health_port_for(self.config.health_port)  # vLLM's API server i: base - i
            try:
                self.health_server = HealthServer(
                    self.report, port, self.config.health_host, self.config.health_min_score
                ).start()
                logger.info(
                    "llm-otel: health endpoint on http://%s:%d/healthz",
                    self.config.health_host,
                    self.health_server.port,
                )
            except (OSError, ValueError) as exc:
                logger.warning(
                    "llm-otel: health endpoint not started on %s:%s (%s)", self.config.health_host, port, exc
                )
        return self

    def _restart_after_fork(self) -> None:
        """In a forked child (an application that forks after ``instrument()``): the tick thread
        runs again; the /healthz endpoint stays with the parent, which holds its port (the child's
        copy of the listening socket is closed)."""
        if self._thread is None or self._stop.is_set():
            return
        self._lock = threading.Lock()
        self._thread = None
        if self.health_server is not None:
            self.health_server.close_inherited()
            self.health_server = None
        self.start()

    def abandon_inherited(self) -> None:
        """In a forked process that replaces this object (a vLLM engine process): stop without
        waiting for threads that only existed in the parent."""
        self.stop(inherited=True)

    def stop(self, inherited: bool = False) -> None:
        """Stop the thread, the health endpoint and a poller this object started (idempotent).
        ``inherited``: in a forked child, where the endpoint's serving thread does not exist -
        only this process's copy of its socket is closed."""
        self._stop.set()
        if self._own_poller and self.poller is not None:
            self.poller.stop()
        if self.health_server is not None:
            if inherited:
                self.health_server.close_inherited()
            else:
                self.health_server.stop()
            self.health_server = None

    def _loop(self) -> None:
        while not self._stop.wait(self.config.tick_s):
            with guard("signals.tick"):
                self.tick()

    def tick(self, now: float | None = None) -> str:
        """Read the usage source once and update the pressure level (the thread calls this)."""
        usage, source = self.usage()
        return self.pressure.update(usage, time.monotonic() if now is None else now, source)

    def usage(self) -> tuple[float | None, str | None]:
        """Usage fraction and its source per ``LLM_OTEL_VRAM_SOURCE``: ``kv_cache`` = blocks held
        by live requests / pool blocks (engines that preallocate their KV pool, e.g. vLLM, keep
        NVML memory near full by design); ``nvml`` = used / total; ``auto`` = kv_cache when an
        engine reported its pool, else nvml."""
        mode = self.config.vram_source
        if mode in ("auto", "kv_cache"):
            held = total = 0
            for src in list(self._kv_sources):
                got = None
                with guard("signals.kv_source", message="a KV usage source failed; this tick reads the others"):
                    got = src()
                if got is not None:
                    held, total = held + got[0], total + got[1]
            if total > 0:
                return min(1.0, held / total), "kv_cache"
            if mode == "kv_cache":
                return None, None
        mem = self._nvml_memory()
        return (None, None) if mem is None else (mem[0] / mem[1], "nvml")

    def _nvml_memory(self) -> tuple[int, int] | None:
        poller = self.poller
        source = getattr(poller, "source", None)
        if source is None or not getattr(poller, "available", False) or poller.utilization is None:
            return None
        used, total = getattr(source, "memory_used_bytes", 0), getattr(source, "memory_total_bytes", 0)
        return (used, total) if total > 0 else None

    def _utilization(self) -> float | None:
        poller = self.poller
        if poller is None or not getattr(poller, "available", False):
            return None
        return poller.utilization

    def token_efficiency(self, now: float | None = None) -> float | None:
        """Output tokens per second over the last ``efficiency_window_s`` per GiB of GPU memory in
        use (NVML); None without NVML (CPU-only: absent, not zero)."""
        mem = self._nvml_memory()
        if mem is None or mem[0] <= 0:
            return None
        now = time.monotonic() if now is None else now
        window = self.config.efficiency_window_s
        lo, hi = (
            int((now - window) * self._buckets_per_s),
            int(now * self._buckets_per_s),
        )  # buckets (lo, hi]: the window, to one bucket
        tokens = sum(n for i, n in zip(list(self._bucket_ids), list(self._bucket_tokens), strict=False) if lo < i <= hi)
        return tokens / window / (mem[0] / GIB)

    # --- observation ---------------------------------------------------------------------------
    def report(self) -> tuple:
        """``(score, dominant, factors, pressure level or None, exporter reachable or None)`` for /healthz."""
        value, dominant, factors = self.health.compute()
        level = self.pressure.level if self.pressure.usage is not None or self.pressure.level != "ok" else None
        return value, dominant, factors, level, self._exporter_ok()

    def _exporter_ok(self) -> bool | None:
        checked_at, result = self._exporter_checked
        now = time.monotonic()
        if now - checked_at < 15.0:
            return result
        result = otlp_endpoint_reachable(self.config.exporter_endpoint)
        self._exporter_checked = (now, result)
        return result

    # Efficiency and health describe a serving frontend: reported once started (an engine attached
    # or the sidecar), never from vLLM's engine-core/worker processes, whose Telemetry sees no requests.
    def _observe_efficiency(self, _options):
        if self._thread is None:
            return []
        value = self.token_efficiency()
        return [] if value is None else [Observation(value)]

    def _observe_pressure(self, _options):
        p = self.pressure
        if p.usage is None and p.level == "ok":
            return []
        return [
            Observation(
                LEVELS.index(p.level), {A.LLM_VRAM_PRESSURE_LEVEL: p.level, A.LLM_VRAM_SOURCE: p.source or "nvml"}
            )
        ]

    def _observe_usage(self, _options):
        p = self.pressure
        return [] if p.usage is None else [Observation(float(p.usage), {A.LLM_VRAM_SOURCE: p.source or "nvml"})]

    def _observe_health(self, _options):
        if self._thread is None:
            return []
        value, dominant, _ = self.health.compute()
        return [Observation(value, {A.LLM_HEALTH_FACTOR: dominant})]


def kv_source_for(records_owner: Any, spec_of: Callable[[Any], KVSpec | None]) -> Callable[[], tuple[int, int] | None]:
    """A KV usage source over an adapter's live records: ``records_owner.records`` maps request id
    -> RequestRecord; blocks held = sum of ceil((prompt + output tokens) / block size)."""
    ref = weakref.ref(records_owner)

    def source() -> tuple[int, int] | None:
        owner = ref()
        if owner is None:
            return None
        spec = spec_of(owner)
        if spec is None or not spec.num_blocks:
            return None
        for _ in range(3):  # the engine thread may add or drop a record while we copy the dict
            try:
                live = list(owner.records.values())
                break
            except RuntimeError:
                continue
        else:
            return None
        held = sum(spec.blocks(rec.input_tokens + rec.num_output_tokens) for rec in live)
        return held, spec.num_blocks

    return source
