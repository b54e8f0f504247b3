"""Engine-agnostic telemetry core: adapters call :class:`Telemetry`, never the OpenTelemetry API.

Lifecycle of a request as an adapter sees it::

    rec = telemetry.start_request(request_id, operation="text_completion", model=..., arrival_s=...,
                                  input_tokens=len(prompt_token_ids), kind=SpanKind.INTERNAL,
                                  facts=RequestFacts(headers, engine_fields, kv))
    rec.on_event("queued", t); rec.on_tokens(ids, t); rec.on_logprobs(ids, lps)   # hot path
    telemetry.on_tokens(tokens_this_step, t)                                      # once per step
    rec.finish_reason = "stop"
    telemetry.finish(rec)                                                         # exactly once

Metrics, the sampler's drift detector and the serving signals listen to that lifecycle
(:mod:`llm_otel.listeners`); adapters never call them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider, get_meter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

from llm_otel.config import Settings
from llm_otel.listeners import RequestFacts, RequestListener, SpanNotes, token_hooks
from llm_otel.sampling import Sampling, sampling_of
from llm_otel.semconv import SCHEMA_URL
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.signals import Signals, SignalsConfig
from llm_otel.telemetry.bounds import bounded_id
from llm_otel.telemetry.client import ClientCalls
from llm_otel.telemetry.errors import HookErrors, guard
from llm_otel.telemetry.kv_transfer import KVTransfer, KVTransfers
from llm_otel.telemetry.metrics import Instruments
from llm_otel.telemetry.outlets import RequestOutlets
from llm_otel.telemetry.record import RequestRecord
from llm_otel.telemetry.spans import SpanBuilder
from llm_otel.telemetry.stages import StageRecord, emit_stage
from llm_otel.telemetry.steps import StepContext, StepTracker

logger = logging.getLogger("llm_otel")

__all__ = ["Telemetry", "RequestRecord", "RequestFacts", "StepContext", "StepTracker", "KVTransfer", "KVTransfers"]


class _MetricsListener:
    """The GenAI server metrics as a lifecycle listener: every finished request is recorded."""

    error_key = "telemetry.metrics"
    on_start = None
    on_tokens = None

    def __init__(self, instruments: Instruments) -> None:
        self.instruments = instruments

    def on_finish(self, rec: RequestRecord, duration_s: float) -> None:
        self.instruments.record(rec, duration_s)


class Telemetry:
    """Tracer, instruments and settings shared by every adapter of one ``instrument()`` call.

    Args:
        tracer_provider / meter_provider: where spans and metrics go (global providers when None).
        settings: validated configuration (:meth:`Settings.from_env` when None).
        scope: instrumentation scope name of the tracer and meter.
        signals_config: serving-signal settings (``settings.signals`` when None).
        sampling: the parts of llm-otel's adaptive sampler the tracer provider was built with
            (:class:`llm_otel.sampling.Sampling`, as ``build_providers_and_sampling`` returns them);
            None: those of the provider's own sampler when it is llm-otel's, else none.
        outlets: where finished requests' child spans and per-request metric observations go
            when they are not built and recorded here (:class:`~llm_otel.telemetry.outlets.RequestOutlets`:
            the exporter process's, ``llm_otel.export.offload.request_outlets(tracer_provider,
            meter_provider)``); None: everything in process.

    Request lifecycle listeners (:mod:`llm_otel.listeners`): the GenAI metrics, the sampler's
    drift detector and :attr:`signals` see every request's start, steps and finish; adapters call
    :meth:`start_request`, :attr:`on_tokens` and :meth:`finish` only.

    Raises:
        llm_otel.config.ConfigError: (``settings`` None) an ``LLM_OTEL_*`` variable or the tier
            table is invalid.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        settings: Settings | None = None,
        scope: str = "llm_otel",
        signals_config: SignalsConfig | None = None,
        sampling: Sampling | None = None,
        outlets: RequestOutlets | None = None,
    ) -> None:
        from llm_otel.version import __version__

        self.settings = settings or Settings.from_env()
        self.tracer = trace.get_tracer(scope, __version__, tracer_provider, schema_url=SCHEMA_URL)
        meter = get_meter(scope, __version__, meter_provider, schema_url=SCHEMA_URL)
        self.meter = meter
        # per-request metrics recorded elsewhere (the exporter process) when the outlets say so; the
        # signals' per-request observations (KV size, SLO checks) go the same way
        metrics_outlet = (
            outlets.request_metrics((scope, __version__, SCHEMA_URL), self.settings.itl_sample_every)
            if outlets is not None
            else None
        )
        self.instruments = Instruments(meter, self.settings.itl_sample_every, metrics_outlet)
        self.errors = HookErrors(meter)
        self.spans = SpanBuilder(
            self.tracer, self.settings, outlets.span_tree(self.tracer) if outlets is not None else None
        )
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        # llm-otel's adaptive sampler as whoever built the providers handed it over (instrument()
        # passes what build_providers_and_sampling returned), or as the application built its
        # provider with it; None with any other sampler: no drift detector, no engine load
        self.sampling = sampling if sampling is not None else sampling_of(provider)
        self.sampling_root = self.sampling.root if self.sampling is not None else None
        # engines attach their load here when the sampler follows engine occupancy (no GPU)
        self._occupancy = self.sampling.occupancy if self.sampling is not None else None
        # request classes, tiers, KV footprint, VRAM pressure, health; the signals (health score,
        # token efficiency) share the sampler's poller only when it reads GPU utilisation
        signals = Signals(
            meter,
            signals_config or self.settings.signals,
            poller=self.sampling.gpu_poller if self.sampling is not None else None,
            instruments=None
            if metrics_outlet is None
            else (metrics_outlet.instrument("kv_size"), metrics_outlet.instrument("slo_checks")),
        )
        # lifecycle listeners (llm_otel.listeners), in the order they observe a finished request:
        # metrics, the sampler's drift detector, the serving signals
        self._fixed_listeners: tuple[Any, ...] = (_MetricsListener(self.instruments),) + (
            (self.sampling.listener,) if self.sampling is not None else ()
        )
        self.signals = signals  # registers it (see the setter)
        self._steps: StepTracker | None = None
        self._kv_transfers: KVTransfers | None = None
        self._steps_lock = threading.Lock()

    # --- request-lifecycle listeners -----------------------------------------------------------
    @property
    def signals(self) -> Signals:
        """The serving signals (:class:`llm_otel.signals.Signals`), a lifecycle listener."""
        return self._signals

    @signals.setter
    def signals(self, signals: Signals) -> None:
        """Swap the serving signals (tests, a reconfigured process): the listener tuples are rebuilt."""
        self._signals = signals
        self._set_listeners(self._fixed_listeners + (signals,))

    def add_listener(self, listener: RequestListener) -> None:
        """Register one more request-lifecycle listener (:class:`llm_otel.listeners.RequestListener`),
        called after the built-in ones. Not thread-safe against requests starting: register before
        traffic."""
        self._fixed_listeners += (listener,)
        self._set_listeners(self._fixed_listeners + (self._signals,))

    def _set_listeners(self, listeners: tuple[Any, ...]) -> None:
        # duck-typed (llm_otel.listeners.RequestListener): a listener's on_start / on_tokens /
        # on_finish may be None or absent, hence the filtered tuples
        self.listeners = listeners
        self._start_listeners = tuple(li for li in listeners if getattr(li, "on_start", None) is not None)
        self._finish_listeners = tuple(li for li in listeners if getattr(li, "on_finish", None) is not None)
        hooks = self._token_hooks = token_hooks(listeners)
        # per step, no lookup and no allocation: with one listener counting tokens (the signals,
        # normally) the adapter's call goes straight to its bound method, else to the loop below
        self.on_tokens = hooks[0] if len(hooks) == 1 else self._dispatch_tokens

    #: ``on_tokens(count, engine_mono)``: output tokens an engine step produced (``count``;
    #: ``engine_mono``: the step's engine monotonic seconds), for every listener that counts them
    #: (hot path: O(1), no allocation; adapters call it once per step - or per streamed token - and
    #: from inside their hook's failure guard, which reports a listener that raises). The tokens of
    #: each request go on its record (``rec.on_tokens``) as before. An instance attribute set with
    #: the listeners (:meth:`_set_listeners`): the one counting listener's own bound method, else
    #: :meth:`_dispatch_tokens`.
    on_tokens: Callable[[int, float], None]

    def _dispatch_tokens(self, count: int, engine_mono: float) -> None:
        for hook in self._token_hooks:
            try:
                hook(count, engine_mono)
            except Exception as exc:  # noqa: BLE001 - counted under that listener's key; the others still count
                self.errors.report(getattr(getattr(hook, "__self__", None), "error_key", "telemetry.listener"), exc)

    def attach_kv_source(self, source: Callable[[], tuple[int, int] | None]) -> None:
        """One engine's KV usage for the VRAM pressure level: ``source() -> (blocks held by live
        requests, blocks in the pool)`` or None (see :func:`llm_otel.signals.kv_source_for`);
        starts the signals' 1 s thread (and ``/healthz`` when configured)."""
        self._signals.attach_kv_source(source)

    def abandon_inherited(self) -> None:
        """In a process forked from the one that built this object, which builds its own: stop
        its signals and sampler poller without waiting on the parent's threads."""
        self._signals.abandon_inherited()
        if self.sampling is not None:
            self.sampling.stop()

    def attach_engine_load(self, source: Callable[[], tuple[int, int] | None]) -> bool:
        """Let the adaptive sampler follow one engine's occupancy where it has no GPU utilisation:
        ``source() -> (requests held, max concurrent requests)``, or None once the engine is gone
        (see :class:`llm_otel.sampling.EngineOccupancy`). Returns False (and keeps nothing) when
        this process's sampler does not use engine occupancy."""
        if self._occupancy is None:
            return False
        self._occupancy.attach(source)
        return True

    @property
    def steps(self) -> StepTracker:
        """The :class:`~llm_otel.telemetry.steps.StepTracker` adapters call around each model
        execution (created on first use: ring buffer per ``LLM_OTEL_GPU_STEPS``, NVTX per
        ``LLM_OTEL_NVTX``)."""
        if self._steps is None:
            with self._steps_lock:
                if self._steps is None:
                    st = self.settings
                    self._steps = StepTracker(self, backend=st.gpu_steps, capacity=st.gpu_ring_capacity, nvtx=st.nvtx)
        return self._steps

    @property
    def kv_transfers(self) -> KVTransfers:
        """The :class:`~llm_otel.telemetry.kv_transfer.KVTransfers` adapters hand each request's
        KV transfer to (prefill/decode disaggregation; created on first use)."""
        if self._kv_transfers is None:
            with self._steps_lock:
                if self._kv_transfers is None:
                    self._kv_transfers = KVTransfers(self.tracer, self.meter)
        return self._kv_transfers

    @property
    def steps_if_started(self) -> StepTracker | None:
        """The step tracker if some adapter in this process already uses it (never creates one:
        a layer that does not run the model must not start a CUDA context)."""
        return self._steps

    def start_request(
        self,
        request_id: str,
        *,
        operation: str,
        provider: str,
        model: str,
        arrival_s: float,
        input_tokens: int,
        kind: SpanKind = SpanKind.INTERNAL,
        parent: otel_context.Context | None = None,
        engine_version: str = "",
        choice_index: int = 0,
        request_attributes: Mapping[str, Any] | None = None,
        user_logprobs: int | None = None,
        prompt_text: str | None = None,
        facts: RequestFacts | None = None,
    ) -> RequestRecord:
        """Start the live request span at ``arrival_s`` (wall-clock seconds) and return its record.

        The span is named ``{operation} {model}``; ``parent`` defaults to the current context.
        ``llm.request.id`` and ``gen_ai.response.id``, which a client may choose, are cut to
        :data:`~llm_otel.telemetry.bounds.MAX_ID_CHARS` characters.
        ``prompt_text`` is attached only when content capture is on (truncated). ``facts``
        (headers, engine class fields, KV geometry; :class:`llm_otel.listeners.RequestFacts`) go to the
        lifecycle listeners' ``on_start`` - request classes, tier, KV estimate - whose notes land on
        the span; adapters always pass it (an empty ``RequestFacts()`` when they know nothing).
        None: no listener sees the start (a caller that classifies and admits the request itself).
        """
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_PROVIDER_NAME: provider,
            A.GEN_AI_REQUEST_MODEL: model,
            A.LLM_REQUEST_ID: bounded_id(request_id),  # a client may choose it (X-Request-Id)
            A.LLM_REQUEST_CHOICE_INDEX: choice_index,
        }
        if engine_version:
            attrs[A.LLM_ENGINE_VERSION] = engine_version
        if request_attributes:
            attrs.update(request_attributes)
            response_id = attrs.get(A.GEN_AI_RESPONSE_ID)
            if isinstance(response_id, str):
                attrs[A.GEN_AI_RESPONSE_ID] = bounded_id(response_id)
        if user_logprobs is not None:
            attrs[A.LLM_REQUEST_LOGPROBS] = user_logprobs
        span = self.tracer.start_span(
            f"{operation} {model}", context=parent, kind=kind, attributes=attrs, start_time=round(arrival_s * 1e9)
        )
        st = self.settings
        rec = RequestRecord(
            request_id,
            operation=operation,
            provider=provider,
            model=model,
            arrival_s=arrival_s,
            input_tokens=input_tokens,
            span=span,
            request_attributes=attrs,
            # the head's token ids go on token events only with content capture
            head_cap=st.token_events if st.capture_content else 0,
            logprob_cap=(1 << 20) if st.logprobs_top_k else 0,
        )
        if rec.recording and st.capture_content and prompt_text is not None:
            # GenAI message format; an offline prompt (or a rendered chat template) is one user part
            span.set_attribute(
                A.GEN_AI_INPUT_MESSAGES,
                json.dumps([{"role": "user", "parts": [{"type": "text", "content": self.truncate(prompt_text)}]}]),
            )
        if facts is not None:
            for listener in self._start_listeners:
                with guard(listener.error_key, self.errors):  # the record must still be tracked and ended
                    notes = listener.on_start(rec, facts)
                    if notes is not None:
                        self._note(rec, notes)
        return rec

    @staticmethod
    def _note(rec: RequestRecord, notes: SpanNotes) -> None:
        """Put a listener's :class:`~llm_otel.listeners.SpanNotes` on the request span."""
        span = rec.span  # not None when recording
        if notes.request_attributes:
            rec.request_attributes.update(notes.request_attributes)
            if rec.recording and span is not None:
                span.set_attributes(notes.request_attributes)
        if rec.recording and span is not None:
            if notes.attributes:
                span.set_attributes(notes.attributes)
            for name, attributes in notes.events:
                span.add_event(name, attributes)

    def set_completion(self, rec: RequestRecord, text: str, finish_reason: str | None) -> None:
        """Completion text on the request span as ``gen_ai.output.messages`` - only with content
        capture on, truncated to ``content_max_chars``."""
        span = rec.span  # not None when recording
        if not (self.settings.capture_content and rec.recording and span is not None):
            return
        message = {"role": "assistant", "parts": [{"type": "text", "content": self.truncate(text)}]}
        if finish_reason:
            message["finish_reason"] = finish_reason
        span.set_attribute(A.GEN_AI_OUTPUT_MESSAGES, json.dumps([message]))

    def truncate(self, text: str) -> str:
        """Captured content cut to ``content_max_chars``."""
        limit = self.settings.content_max_chars
        return text if len(text) <= limit else text[:limit]

    def finish(self, rec: RequestRecord, end_ns: int | None = None) -> None:
        """End the request exactly once: span tree (if sampled) and metrics (always).

        ``end_ns`` (epoch ns) defaults to now. A second call is ignored.
        """
        if rec.finished:
            return
        rec.finished = True
        rec.settle_clock()  # engine stamps from another host's clock: shifted onto ours, marked
        end_ns = time.time_ns() if end_ns is None else end_ns
        duration_s = max(0.0, (end_ns - rec.arrival_ns) / 1e9)
        for listener in self._finish_listeners:  # metrics, drift, signals: every request, sampled or not
            with guard(listener.error_key, self.errors):
                notes = listener.on_finish(rec, duration_s)
                if notes is not None and rec.span is not None:
                    self._note(rec, notes)
        if rec.span is None:
            return
        if not rec.recording and self.sampling_root is not None:
            with guard("telemetry.outlier", self.errors):
                self._capture_outlier(rec, rec.span, duration_s)
        steps = self._steps
        if rec.recording and steps is not None:
            self._device_time(rec, rec.span, steps)
        try:
            if rec.recording:
                self.spans.emit(rec, end_ns)
            else:
                rec.span.end(end_time=end_ns)
        except Exception as exc:  # noqa: BLE001
            self.errors.report("telemetry.spans", exc)
            try:
                rec.span.end(end_time=end_ns)
            except Exception:  # noqa: BLE001 - silent: cleanup after the failure reported above
                pass
        finally:
            rec.logprob_rows = []  # free the per-step arrays now, whatever holds the record

    def _device_time(self, rec: RequestRecord, span: Span, steps: StepTracker) -> None:
        """Device time of the steps that served the request (``span``: its request span), when they
        ran in this process (``steps``: this process's step tracker)."""
        with guard("telemetry.device_time", self.errors):
            acc = steps.request_device_time(rec.request_id)
            if acc is not None:
                span.set_attributes({A.LLM_REQUEST_DEVICE_TIME: acc[0], A.LLM_REQUEST_DEVICE_STEPS: acc[1]})

    def _capture_outlier(self, rec: RequestRecord, original_span: Span, duration_s: float) -> None:
        """A request the head sampler dropped that failed or breached an SLO: record its tree as its
        own root, linked to its real trace, marked outlier (no threshold, so no count bias)."""
        st = self.settings
        ttft = rec.time_to_first_token_s()
        if not (
            rec.error_type is not None
            or (st.outlier_ttft_s is not None and ttft is not None and ttft > st.outlier_ttft_s)
            or (st.outlier_e2e_s is not None and duration_s > st.outlier_e2e_s)
        ):
            return
        original = original_span.get_span_context()  # rec.span
        original_span.end()
        attrs = {**rec.request_attributes, A.LLM_SAMPLING_REASON: "outlier"}
        span = self.tracer.start_span(
            f"{rec.operation} {rec.model}",
            context=otel_context.Context(),
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            links=[trace.Link(original)],
            start_time=rec.arrival_ns,
        )
        if span.is_recording():
            rec.span, rec.recording = span, True

    def reject(
        self,
        *,
        operation: str,
        provider: str,
        model: str,
        arrival_s: float,
        error: BaseException,
        kind: SpanKind = SpanKind.INTERNAL,
        parent: otel_context.Context | None = None,
        engine_version: str = "",
        request_attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A request the engine refused before scheduling it: one error span and the duration metric."""
        error_type = type(error).__qualname__
        span = self._start_edge_span(
            operation, provider, model, arrival_s, kind, parent, engine_version, request_attributes, error_type
        )
        span.add_event(S.EVENT_LLM_REQUEST_REJECTED, {A.ERROR_TYPE: error_type})
        # engine error messages can quote the user's input (template errors, URLs): only with
        # content capture on
        detail = self.truncate(str(error)) if self.settings.capture_content else error_type
        span.set_status(Status(StatusCode.ERROR, detail))
        span.end()
        self.instruments.record_rejected(
            {
                A.GEN_AI_OPERATION_NAME: operation,
                A.GEN_AI_PROVIDER_NAME: provider,
                A.GEN_AI_REQUEST_MODEL: model,
                A.ERROR_TYPE: error_type,
            },
            max(0.0, time.time() - arrival_s),
            trace.set_span_in_context(span) if span.is_recording() else None,
        )

    def start_forwarded(
        self,
        *,
        operation: str,
        provider: str,
        model: str,
        arrival_s: float,
        kind: SpanKind = SpanKind.SERVER,
        parent: otel_context.Context | None = None,
        engine_version: str = "",
        request_attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """Start the request span of a layer that forwards the request to engine instances it does
        not run (LightLLM's P/D master), at ``arrival_s`` (wall-clock seconds): named
        ``{operation} {model}`` with the request-span attributes of :meth:`start_request`. A root
        (``parent`` without a span) is decided by the provider's sampler like any request root;
        sampled or not, the span has a valid context for the instances to continue under.

        No record, no metrics, no listeners: the instances that serve the request count it (a
        request forwarded to two instances is still one request of each). End it with
        :meth:`end_forwarded`."""
        return self._start_edge_span(
            operation, provider, model, arrival_s, kind, parent, engine_version, request_attributes
        )

    def _start_edge_span(
        self,
        operation: str,
        provider: str,
        model: str,
        arrival_s: float,
        kind: SpanKind,
        parent: otel_context.Context | None,
        engine_version: str,
        request_attributes: Mapping[str, Any] | None,
        error_type: str | None = None,
    ) -> Span:
        """A request span without a record (:meth:`reject`, :meth:`start_forwarded`): named
        ``{operation} {model}``, started at ``arrival_s`` (wall-clock seconds)."""
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_PROVIDER_NAME: provider,
            A.GEN_AI_REQUEST_MODEL: model,
        }
        if error_type is not None:
            attrs[A.ERROR_TYPE] = error_type
        if engine_version:
            attrs[A.LLM_ENGINE_VERSION] = engine_version
        if request_attributes:
            attrs.update(request_attributes)
        return self.tracer.start_span(
            f"{operation} {model}", context=parent, kind=kind, attributes=attrs, start_time=round(arrival_s * 1e9)
        )

    @staticmethod
    def context_of(span: Span, parent: otel_context.Context | None = None) -> otel_context.Context:
        """``parent`` (default: the current context) with ``span`` as its current span: the
        context an adapter carries a span of :meth:`start_forwarded` in."""
        return trace.set_span_in_context(span, parent)

    def end_forwarded(
        self,
        span: Span,
        *,
        request_id: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        finish_reasons: list[str] | None = None,
        time_to_first_token_s: float | None = None,
        error_type: str | None = None,
        end_ns: int | None = None,
    ) -> None:
        """End a span of :meth:`start_forwarded` at ``end_ns`` (epoch ns, default now) with the
        request's outcome as the forwarding layer saw it: ``llm.request.id`` (cut to
        :data:`~llm_otel.telemetry.bounds.MAX_ID_CHARS`), ``gen_ai.usage.input_tokens`` /
        ``output_tokens`` (tokens), ``gen_ai.response.finish_reasons``, ``llm.time_to_first_token``
        (seconds since arrival) and, on failure, ``error.type`` with error status."""
        if span.is_recording():
            attrs: dict[str, Any] = {}
            if request_id is not None:
                attrs[A.LLM_REQUEST_ID] = bounded_id(request_id)
            if input_tokens is not None:
                attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
            if output_tokens is not None:
                attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
            if finish_reasons:
                attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = finish_reasons
            if time_to_first_token_s is not None:
                attrs[A.LLM_TIME_TO_FIRST_TOKEN] = max(0.0, time_to_first_token_s)
            if error_type is not None:
                attrs[A.ERROR_TYPE] = error_type
                span.set_status(Status(StatusCode.ERROR, error_type))
            span.set_attributes(attrs)
        span.end(end_time=time.time_ns() if end_ns is None else end_ns)

    def client_calls(self, provider: str) -> ClientCalls:
        """Spans and GenAI client metrics of a client library's calls (``provider``: its
        ``gen_ai.provider.name``); see :mod:`llm_otel.telemetry.client`. Each call builds the
        client histograms on this telemetry's meter: an adapter asks once, at ``instrument()``."""
        return ClientCalls(
            provider=provider,
            tracer=self.tracer,
            meter=self.meter,
            settings=self.settings,
            errors=self.errors,
            truncate=self.truncate,
        )

    # --- stage spans of engine processes past the frontend (telemetry/stages.py) ----------------
    def start_stage(
        self,
        stage: str,
        request_id: int,
        parent: otel_context.Context,
        *,
        group_id: int,
        choice_index: int,
        start_ns: int,
        queued_ns: int | None = None,
        frontend_arrival_s: Any = None,
        output_tokens: int | None = None,
        logit_top_k: int = 0,
    ) -> StageRecord:
        """A :class:`~llm_otel.telemetry.stages.StageRecord` for one sampled sub-request entering an
        engine process stage at ``start_ns`` (epoch ns): ``stage`` is ``stages.ROUTER`` or
        ``stages.INFER``, ``parent`` the Context of its request span (from the engine's carrier).
        No span exists until :meth:`end_stage`. Raises ValueError for an unknown stage."""
        return StageRecord(
            stage,
            request_id,
            parent,
            group_id=group_id,
            choice_index=choice_index,
            start_ns=start_ns,
            token_id_cap=self.settings.token_events,
            queued_ns=queued_ns,
            frontend_arrival_s=frontend_arrival_s,
            output_tokens=output_tokens,
            logit_top_k=logit_top_k,
        )

    def end_stage(self, rec: StageRecord, end_ns: int | None = None) -> None:
        """The sub-request left the stage at ``end_ns`` (epoch ns, default now): its stage span (and
        ``llm.logit_dist`` when the record kept logit rows), built once from the record."""
        emit_stage(self.tracer, self.settings, rec, time.time_ns() if end_ns is None else end_ns)

    @staticmethod
    def request_context(rec: RequestRecord, parent: otel_context.Context | None = None) -> otel_context.Context:
        """``parent`` (default: the current context) with ``rec``'s request span as the current
        span: for engine work run under the request, so that what it creates is the span's child."""
        return trace.set_span_in_context(cast(Span, rec.span), parent)  # start_request's records hold a span
