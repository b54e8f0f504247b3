"""Reads vLLM's own objects and calls the telemetry core. Wrappers only; no spans are built here.

Engine fields read (vLLM 0.32, V1):

* arrival: ``EngineCoreRequest.arrival_time`` (wall-clock s), ``prompt_token_ids``, ``sampling_params``;
* per step: ``OutputProcessor.process_outputs(engine_core_outputs, engine_core_timestamp)`` where the
  timestamp is ``EngineCoreOutputs.timestamp`` (EngineCore ``time.monotonic()`` s), and per output
  ``new_token_ids``, ``events`` (``EngineCoreEvent`` QUEUED/SCHEDULED/PREEMPTED, monotonic s),
  ``prefill_stats.num_cached_tokens``, ``new_logprobs`` (``LogprobsLists``), ``finish_reason``;
* finish: the request leaves ``OutputProcessor.request_states``; a finish without an engine
  finish reason is a stop string matched by the detokenizer.

Every wrapper calls vLLM exactly as it was called and returns its result untouched; failures of
our own code are counted in ``llm_otel.instrumentation.errors`` and never reach vLLM or the user.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

from opentelemetry.trace import SpanKind

from llm_otel.errors import guard
from llm_otel.instrumentation.vllm.beam_search import BEAM, BeamSearch
from llm_otel.instrumentation.vllm.edge import Exchange, bounded_model, install_edge, served_models
from llm_otel.instrumentation.vllm.engine_core import EngineCoreAdapter
from llm_otel.instrumentation.vllm.fields import class_fields, kv_spec
from llm_otel.instrumentation.vllm.in_flight import _REPORTED, InFlight
from llm_otel.instrumentation.vllm.inbound import ENGINE_CARRIER, INBOUND, OPERATION, Inbound, traced_handler
from llm_otel.instrumentation.vllm.kv_transfer import (
    add_trace_context,
    annotate_process,
    instance_role,
    request_params,
    request_role,
)
from llm_otel.instrumentation.vllm.pooling import PoolingRequests, handler_operation
from llm_otel.instrumentation.vllm.requests import (
    ERROR_TYPES,
    EVENT_KINDS,
    FINISH,
    DropSampleLogprobs,
    EngineState,
    bind_add_request,
    engine_params,
    engine_version,
    occupancy_source,
    sampling_attributes,
)
from llm_otel.instrumentation.vllm.shutdown import ProcessHooks
from llm_otel.instrumentation.vllm.spec_decode import SpecDecodeAdapter, engine_spec_config, take_figures
from llm_otel.listeners import RequestFacts
from llm_otel.process.ports import serving_started
from llm_otel.propagation import carrier_from_span, context_from_carrier, extract_carrier
from llm_otel.semconv import attributes as A
from llm_otel.signals import kv_source_for
from llm_otel.telemetry import RequestRecord, Telemetry
from llm_otel.telemetry.logit_capture import logit_top_k
from llm_otel.telemetry.metrics import BoundedValues
from llm_otel.telemetry.record import ChoiceGroup

logger = logging.getLogger("llm_otel")

PROVIDER = "vllm"
MAX_LIVE_REQUESTS = 1_000_000  # records beyond this are not tracked (one warning)
MAX_LORA_NAMES = 32  # distinct LoRA adapter names per process that get their own metric series


def _named_error(error_type: str, message: str) -> Exception:
    """An exception whose class name is ``error_type`` (what ``Telemetry.reject`` records as
    ``error.type``) for a refusal that vLLM answered without one reaching us."""
    return _error_class(error_type)(message)


@functools.lru_cache(maxsize=64)
def _error_class(error_type: str) -> type[Exception]:
    """One class per ``error.type`` (exception class names and HTTP statuses: a handful), not one
    per refused request."""
    named = type(error_type, (Exception,), {})
    named.__qualname__ = error_type
    return named


class VLLMAdapter(InFlight, PoolingRequests, BeamSearch, ProcessHooks):
    """Wrapper factories for the hooks in :mod:`.hooks` (each takes the hook's qualified name)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.settings = telemetry.settings
        self.version = engine_version()
        self._states: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()
        self._warned_capacity = False
        # called once, when this process starts building an engine client (LLMEngine/AsyncLLM):
        # where requests will arrive, the instrumentor starts the exporter process then, overlapping
        # vLLM's start-up, and not in every Python process that merely has vLLM installed
        self.before_first_engine: Callable[[], object] | None = None  # its result is not used
        self._lora_names = BoundedValues(MAX_LORA_NAMES, "LoRA adapters served")  # metric dimension values
        # n > 1: vLLM's ParentRequest -> the ChoiceGroup its child requests' records share
        self._choice_groups: weakref.WeakKeyDictionary[Any, ChoiceGroup] = weakref.WeakKeyDictionary()
        self.core = EngineCoreAdapter(telemetry)
        self.spec = SpecDecodeAdapter(telemetry)  # engine core: per-request speculative-decoding counts
        from llm_otel.instrumentation.vllm.worker import WorkerAdapter

        self.worker = WorkerAdapter(telemetry)
        self.retired = False  # uninstrumented: the HTTP edge left on an app built before records nothing

    # --- engine facts -----------------------------------------------------------------------
    def _state_for(self, output_processor: Any) -> EngineState:
        state = self._states.get(output_processor)
        if state is None:
            state = self._states[output_processor] = EngineState()
        return state

    def _register_engine(self, engine: Any) -> None:
        state = self._state_for(engine.output_processor)
        model_config = getattr(engine, "model_config", None)
        if model_config is not None:
            state.read_model_config(model_config)
        first = state.kv is None
        if not state.load_attached:
            state.load_attached = True
            capacity = getattr(
                getattr(getattr(engine, "vllm_config", None), "scheduler_config", None), "max_num_seqs", None
            )
            if isinstance(capacity, int) and capacity > 0:
                self.telemetry.attach_engine_load(occupancy_source(state, capacity))
        # cache_config.num_gpu_blocks is known once the engine core reported its KV pool
        state.kv = kv_spec(getattr(engine, "vllm_config", None))
        state.spec_tokens, state.spec_public = engine_spec_config(getattr(engine, "vllm_config", None))
        state.disagg = instance_role(getattr(engine, "vllm_config", None))
        if first:
            annotate_process(state.disagg)
        if first and state.kv is not None:
            self.telemetry.attach_kv_source(kv_source_for(state, lambda s: s.kv))

    def live_requests(self) -> int:
        """Requests currently tracked (for tests and ``doctor``)."""
        return sum(len(s.records) for s in list(self._states.values()))

    # --- wrappers ---------------------------------------------------------------------------
    def traced_operation(self, hook: str):
        """LLM.generate / LLM.chat: the operation name for the requests they add, and requests
        vLLM rejects while rendering them (before the engine sees them: prompt too long, ...)."""
        operation = "chat" if hook.endswith(".chat") else "score" if hook.endswith(".score") else "text_completion"

        def wrapper(wrapped, instance, args, kwargs):
            if OPERATION.get() is not None:  # LLM.chat calling generate keeps "chat"
                return wrapped(*args, **kwargs)
            token = OPERATION.set(operation)
            arrival = time.time()
            try:
                return wrapped(*args, **kwargs)
            except Exception as error:
                engine = getattr(instance, "llm_engine", None)
                if engine is not None and not getattr(error, _REPORTED, False):
                    # requests already in the engine (it died mid-run: EngineDeadError, ...) end with
                    # the error; with none in flight vLLM refused the call before the engine saw it
                    if not self._fail_in_flight(hook, engine, error):
                        self._rejected(hook, engine, (), {}, arrival, error)
                raise
            finally:
                OPERATION.reset(token)

        return wrapper

    def engine_core_client(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            serving_started()  # this process serves requests: its deferred Prometheus endpoint starts
            if self.settings.vllm_engine_events:
                with guard(hook, self.telemetry.errors):
                    bound = inspect.signature(wrapped).bind(*args, **kwargs)
                    if "log_stats" in bound.arguments:
                        bound.arguments["log_stats"] = True
                        args, kwargs = bound.args, bound.kwargs
            return wrapped(*args, **kwargs)

        return wrapper

    def async_add_request(self, hook: str):
        """AsyncLLM.add_request: keep the trace headers vLLM drops when its own tracing is off."""

        async def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                if instance.output_processor not in self._states:
                    self._register_engine(instance)
                headers = kwargs.get("trace_headers", args[6] if len(args) > 6 else None)
                ENGINE_CARRIER.set(extract_carrier(headers) if headers else None)
            return await wrapped(*args, **kwargs)

        return wrapper

    def http_handler(self, hook: str):
        """OpenAI completions/chat handlers (:func:`.inbound.traced_handler`)."""
        return traced_handler(self.telemetry.errors, hook, self._rejected_http)

    def pooling_handler(self, hook: str):
        """OpenAI pooling handlers (``PoolingBaseServing.__call__``): :func:`.inbound.traced_handler`
        with the handler's operation (:func:`.pooling.handler_operation`)."""
        return traced_handler(self.telemetry.errors, hook, self._rejected_http, handler_operation)

    def _rejected_http(
        self, hook: str, args, kwargs, inbound: Inbound, arrival: float, error_type: str, message: str
    ) -> None:
        with guard(hook, self.telemetry.errors):
            request = kwargs.get("request", args[0] if args else None)
            self.telemetry.reject(
                operation=inbound.operation,
                provider=PROVIDER,
                # the client's string only when it names a model served here (edge.bounded_model)
                model=bounded_model(inbound.models, getattr(request, "model", None), self._lora_metric_name),
                arrival_s=arrival,
                error=_named_error(error_type, message),
                kind=SpanKind.SERVER,
                parent=context_from_carrier(inbound.carrier),
                engine_version=self.version,
            )

    def http_app(self, hook: str):
        """vLLM's ``build_app`` (the OpenAI server's FastAPI app): :func:`.edge.install_edge` puts
        the HTTP edge on the app it returns, so requests refused before a handler hook runs are
        traced there (:meth:`_refused_at_edge`)."""

        def wrapper(wrapped, instance, args, kwargs):
            app = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                install_edge(app, self._refused_at_edge)
            return app

        return wrapper

    def _refused_at_edge(self, exchange: Exchange, scope: dict) -> None:
        """A request the OpenAI server refused before any handler hook traced it (body validation,
        authentication, ...): one SERVER span under the caller's ``traceparent`` and the count,
        ``error.type`` the exception vLLM's handler got (``RequestValidationError``) or else the
        HTTP status code (``"401"``), the model bounded (:func:`.edge.bounded_model`)."""
        if self.retired:
            return
        with guard("vllm.http_edge", self.telemetry.errors):
            from starlette.datastructures import Headers

            error_type = exchange.error_type or str(exchange.status)
            self.telemetry.reject(
                operation=exchange.operation,
                provider=PROVIDER,
                model=bounded_model(served_models(scope), exchange.requested, self._lora_metric_name),
                arrival_s=exchange.arrival_s,
                error=_named_error(error_type, f"HTTP {exchange.status}"),
                kind=SpanKind.SERVER,
                parent=context_from_carrier(extract_carrier(Headers(scope=scope))),
                engine_version=self.version,
            )

    def engine_init(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            before, self.before_first_engine = self.before_first_engine, None
            if before is not None:
                with guard(hook, self.telemetry.errors):
                    before()
            result = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                self._register_engine(instance)
            return result

        return wrapper

    def engine_add_request(self, hook: str):
        """LLMEngine.add_request: rejected requests, and the ``trace_headers`` the caller passed
        (vLLM drops them when its own tracing is off; they parent the request span)."""

        def wrapper(wrapped, instance, args, kwargs):
            arrival = time.time()
            token = None
            with guard(hook, self.telemetry.errors):
                if instance.output_processor not in self._states:  # instrumented after the engine was built
                    self._register_engine(instance)
                headers = kwargs.get("trace_headers", args[6] if len(args) > 6 else None)
                if headers:
                    token = ENGINE_CARRIER.set(extract_carrier(headers))
            try:
                return wrapped(*args, **kwargs)
            except Exception as error:
                self._rejected(hook, instance, args, kwargs, arrival, error)
                raise
            finally:
                if token is not None:
                    ENGINE_CARRIER.reset(token)

        return wrapper

    def _rejected(self, hook: str, engine: Any, args, kwargs, arrival: float, error: BaseException) -> None:
        try:
            setattr(error, _REPORTED, True)  # one span per failure, however many hooks it crosses
        except Exception:  # noqa: BLE001 - silent: exceptions with __slots__
            pass
        with guard(hook, self.telemetry.errors):
            if engine.output_processor not in self._states:
                self._register_engine(engine)
            state = self._state_for(engine.output_processor)
            params = kwargs.get("params", args[2] if len(args) > 2 else None)
            self.telemetry.reject(
                operation=OPERATION.get() or "text_completion",
                provider=PROVIDER,
                model=state.model,
                arrival_s=arrival,
                error=error,
                engine_version=self.version,
                request_attributes=sampling_attributes(params),
            )

    def output_add_request(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                self._start(instance, *bind_add_request(*args, **kwargs))
            return result

        return wrapper

    def _start(
        self, output_processor: Any, request: Any, prompt: str | None, parent_req: Any, request_index: int
    ) -> None:
        beam = BEAM.get()
        if beam is not None:  # an internal one-token request of LLM.beam_search: no request of its own
            return self._beam_internal(beam, request)
        state = self._state_for(output_processor)
        rid = request.request_id
        sp = request.sampling_params
        if rid in state.records:  # a streaming-input update
            return
        if sp is None:  # a pooling request (PoolingParams)
            if getattr(request, "pooling_params", None) is not None and len(state.records) < MAX_LIVE_REQUESTS:
                self._start_pooling(state, request, prompt)
            return
        if len(state.records) >= MAX_LIVE_REQUESTS:
            if not self._warned_capacity:
                self._warned_capacity = True
                logger.warning("llm-otel: %d live vLLM requests tracked; newer ones are not traced", MAX_LIVE_REQUESTS)
            return
        prompt_ids = request.prompt_token_ids
        user_logprobs = sp.logprobs
        attrs = sampling_attributes(sp)
        n = getattr(parent_req, "n", None)
        group = None
        if isinstance(n, int) and n != 1:
            attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = n
            group = self._choice_groups.get(parent_req)
            if group is None:
                group = self._choice_groups[parent_req] = ChoiceGroup(n)
        model = state.model
        lora_name = getattr(getattr(request, "lora_request", None), "lora_name", None)
        if lora_name:  # C22: the adapter is the model the client asked for; the base keeps its own attribute
            model = str(lora_name)
            attrs[A.LLM_LORA_NAME] = model
            attrs[A.LLM_LORA_BASE_MODEL] = state.model
        kv_params = role = None
        if state.disagg is not None:
            kv_params = request_params(sp)
            role = request_role(state.disagg, kv_params)
            if role is not None:
                attrs[A.LLM_DISAGGREGATION_ROLE] = role
        inbound = INBOUND.get()
        carrier = ENGINE_CARRIER.get() or (inbound.carrier if inbound is not None else None)
        # the id the client got back: the OpenAI response body's, or the offline RequestOutput.request_id
        # (EngineCoreRequest.external_req_id; the parent's for the choices of n > 1)
        response_id = inbound.response_id() if inbound is not None else None
        attrs[A.GEN_AI_RESPONSE_ID] = response_id or str(
            getattr(parent_req, "external_req_id", None) or getattr(request, "external_req_id", None) or rid
        )
        if inbound is not None:
            inbound.started += 1
        rec = self.telemetry.start_request(
            rid,
            operation=OPERATION.get() or "text_completion",
            provider=PROVIDER,
            model=model,
            kind=SpanKind.SERVER if inbound is not None else SpanKind.INTERNAL,
            parent=context_from_carrier(carrier) if carrier else None,
            arrival_s=float(request.arrival_time),
            input_tokens=len(prompt_ids) if prompt_ids is not None else 0,
            engine_version=self.version,
            choice_index=int(request_index or 0),
            request_attributes=attrs,
            user_logprobs=user_logprobs,
            prompt_text=prompt,
            facts=RequestFacts(inbound.headers if inbound is not None else None, class_fields(request), state.kv),
        )
        rec.vocab_size = state.vocab_size
        if state.disagg is not None:
            self._disaggregated(state, rid, rec, kv_params, role)
        if lora_name:  # metric dimensions: the adapter name bounded per process, and the base model
            bounded = self._lora_metric_name(model)
            rec.metric_attributes.update(
                {A.GEN_AI_REQUEST_MODEL: bounded, A.GEN_AI_RESPONSE_MODEL: bounded, A.LLM_LORA_BASE_MODEL: state.model}
            )
        user_asked = user_logprobs is not None or bool(getattr(sp, "logprob_token_ids", None))
        k = logit_top_k(
            self.settings, rec.span, recording=rec.recording, limit=state.max_logprobs, user_asked=user_asked
        )
        in_worker = k > 0 and self.settings.vllm_worker_logits
        if not k or in_worker:
            rec.logprob_cap = 0  # llm.logit_dist comes from the worker's logits, or not at all
        rec.injected_logprobs = k > 0 and not in_worker and not user_asked
        if rec.recording:
            # the engine-bound copy carries the trace context, or asks for k log-probs that the
            # request's own state drops again
            ours = engine_params(sp, rec, k if in_worker else 0)
            if rec.injected_logprobs:
                req_state = output_processor.request_states.get(rid)
                if req_state is None or getattr(req_state, "logprobs_processor", None) is None:
                    rec.injected_logprobs = False  # cannot keep them from the user: do not ask
                    rec.logprob_cap = 0
                else:
                    # the user's request state drops the log-probs we asked for by itself, so this
                    # holds even if our hooks fail or are removed while the request runs
                    req_state.logprobs_processor = DropSampleLogprobs(req_state.logprobs_processor)
                    ours.logprobs = k
            request.sampling_params = ours
        if rec.recording and self.settings.capture_content:
            rec.output_state = output_processor.request_states.get(rid)
        rec.engine_clock = state.clock
        rec.choice_group = group
        state.records[rid] = rec
        if rec.recording and state.spec_tokens:  # its final output brings vLLM's per-request spec-decode counts
            state.spec_records[rid] = rec
        if rec.logprob_cap:
            state.logprob_records[rid] = rec
        rec.on_handed()  # vLLM sends the request to the engine core right after add_request

    @staticmethod
    def _disaggregated(state: EngineState, rid: str, rec: RequestRecord, params: dict | None, role: str | None) -> None:
        """A request on an instance with a KV connector: a decode hop with NIXL-style params
        reports the prefill side's cached tokens as vLLM's usage does (``remote_prefill_cached_tokens``
        with ``do_remote_prefill``, vllm/v1/engine/output_processor.py); a prefill hop's finished
        output will carry its trace context (sampled or not: the decode side follows the decision)."""
        if params and params.get("do_remote_prefill") and role == "decode":
            cached = params.get("remote_prefill_cached_tokens")
            if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
                rec.cached_tokens = cached
        if role == "prefill" and rec.span is not None:
            carrier = carrier_from_span(rec.span)
            if carrier:
                state.handoff[rid] = carrier

    def _lora_metric_name(self, name: str) -> str:
        """``name`` while at most :data:`MAX_LORA_NAMES` adapters were seen here, else ``_OTHER``
        (one warning): adapters can be loaded at run time, metric series must stay bounded."""
        return self._lora_names(name)

    def process_outputs(self, hook: str):
        """OutputProcessor.process_outputs: one pass over the step's outputs after vLLM's own (the
        tokens it kept after stop strings, the requests it finished); a pass before vLLM's only
        for the log-probs of requests whose ``llm.logit_dist`` the frontend builds (vLLM consumes
        or drops them)."""

        def wrapper(wrapped, instance, args, kwargs):
            state = self._states.get(instance)
            if state is None or not state.records:
                return wrapped(*args, **kwargs)
            outputs = ts = None
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                outputs = args[0] if args else kwargs["engine_core_outputs"]
                ts = self._before_step(
                    state, outputs, args[1] if len(args) > 1 else kwargs.get("engine_core_timestamp")
                )
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            try:
                if ts is not None:
                    self._after_step(state, instance, outputs, ts)
                else:  # our pre-pass failed: still end what vLLM has finished
                    self._reap(state, instance)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
                try:  # a failure part-way through the after-step pass: the requests vLLM finished still end
                    self._reap(state, instance)
                except Exception as exc2:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc2)
            return result

        return wrapper

    def _before_step(self, state: EngineState, outputs: list, ts: float | None) -> float:
        """Before vLLM processes the step: its timestamp (engine monotonic s; now when vLLM gives
        none), the engine clock's observation, and the log-probs of the requests that keep them.
        Returns the step's timestamp."""
        if ts is None:
            ts = time.monotonic()
        else:
            state.clock.observe_output(ts, time.monotonic())
        if state.handoff:  # before vLLM copies a finished prefill's kv_transfer_params into the response
            for out in outputs:
                if out.finish_reason is not None:
                    carrier = state.handoff.pop(out.request_id, None)
                    if carrier is not None:
                        add_trace_context(out, carrier)
        if state.spec_records:  # before vLLM copies a final output's spec_decode_metrics into the response
            take_figures(outputs, state.spec_records, state.spec_public)
        keep = state.logprob_records
        if keep:
            for out in outputs:
                rec = keep.get(out.request_id)
                if rec is not None:
                    lp = out.new_logprobs
                    if lp is not None:
                        rec.on_logprobs(lp.logprob_token_ids, lp.logprobs)
        return ts

    def _after_step(self, state: EngineState, output_processor: Any, outputs: list, ts: float) -> None:
        """After vLLM processed the step: per output of a tracked request, its scheduler events,
        cached prompt tokens and new tokens; the requests vLLM finished end. One pass, one lookup
        per output."""
        records = state.records
        live = output_processor.request_states
        produced = 0
        for out in outputs:
            rid = out.request_id
            rec = records.get(rid)
            if rec is None:
                continue
            events = out.events
            if events:
                for ev in events:
                    kind = EVENT_KINDS.get(int(ev.type))
                    if kind is not None:
                        if kind == "queued" and rec.queued_mono is None and rec.handed_mono is not None:
                            state.clock.observe_queued(rec.handed_mono, ev.timestamp)
                        rec.on_event(kind, ev.timestamp)
            stats = out.prefill_stats  # the prefill's step only
            if stats is not None:
                # local prefix-cache hits; KV that came over a connector is counted apart
                external = getattr(stats, "num_external_cached_tokens", 0)
                if rec.cached_tokens is None:
                    rec.cached_tokens = getattr(stats, "num_local_cached_tokens", stats.num_cached_tokens)
                if external:
                    rec.kv_transfer_tokens = int(external)
            ids = out.new_token_ids
            if ids:
                produced += rec.on_tokens(ids, ts)  # after vLLM trimmed tokens past a stop string
            elif rec.pooling and out.pooling_output is not None:
                rec.pooled_mono = ts  # the pooled result: the prefill's end
            if rid in live:
                continue
            reason = out.finish_reason
            rec.finish_reason = FINISH[int(reason)] if reason is not None and 0 <= int(reason) < len(FINISH) else "stop"
            rec.error_type = ERROR_TYPES.get(rec.finish_reason)
            state.pop(rid)
            if rec.output_state is not None:  # content capture is on: the detokenized completion
                text = getattr(getattr(rec.output_state, "detokenizer", None), "output_text", None)
                rec.output_state = None
                if text is not None:
                    self.telemetry.set_completion(rec, text, rec.finish_reason)
            if rec.logprob_rows and len(rec.logprob_rows) > rec.num_output_tokens:
                del rec.logprob_rows[rec.num_output_tokens :]
            self.telemetry.finish(rec)
        if produced:
            self.telemetry.on_tokens(produced, ts)

    def _reap(self, state: EngineState, output_processor: Any) -> None:
        """End the records of requests vLLM no longer tracks (after a failure of our own code)."""
        live = output_processor.request_states
        for rid in [rid for rid in state.records if rid not in live]:
            # tracked: not None; timing may be incomplete; counted as a hook error
            self.telemetry.finish(cast(RequestRecord, state.pop(rid)))

    def abort_requests(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            aborted = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                state = self._states.get(instance)
                if state is not None and aborted:
                    for rid in aborted:
                        rec = state.pop(rid)
                        if rec is not None:
                            rec.finish_reason = "abort"
                            rec.error_type = "aborted"
                            rec.error_message = "request aborted before it finished"
                            self.telemetry.finish(rec)
            return aborted

        return wrapper
