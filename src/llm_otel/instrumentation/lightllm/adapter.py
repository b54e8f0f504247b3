"""Reads LightLLM's own objects in each of its processes and calls the telemetry core.

HTTP worker (``HttpServerManager``): one request span per choice, built by the core from a
:class:`RequestRecord` (``llm.prompt`` arrival -> first token, ``llm.token_stream`` first -> last
token). Router (``RouterManager``, request queues, ``Batch``): ``llm.router.request`` per
sub-request (queued -> released, with queued/scheduled events) and ``llm.engine.step`` per
router-driven step (links to the requests it served). Model-infer worker (``InferenceContext``,
``InferReq``; master rank of its DP group only): ``llm.infer.request`` per sub-request (admitted ->
released, per-token timing, sampled-token log-probs). Router and worker spans are children of the
request span of their choice, found through the carrier (carrier.py); both are built by the core
(:mod:`llm_otel.telemetry.stages`) from one :class:`StageRecord` per sub-request that the adapter
fills and hands to ``Telemetry.end_stage``; the router's ``llm.engine.step`` through the core's
step API (``telemetry/steps.py``). The adapter calls no tracer or meter.

Engine fields read (ModelTC/lightllm main @ fc72ffab unless noted):

* HTTP: ``generate(prompt, sampling_params, multimodal_params, request, is_health_req=False)``
  (2024: ``(prompt, sampling_params, group_request_id, multimodal_params, request=None)``) yields
  ``(sub_req_id, text, metadata, finish_status)``; ``metadata["id"]`` (token id),
  ``["count_output_tokens"]`` (engine output count), ``["prompt_tokens"]``;
  ``FinishStatus.is_finished() / is_aborted() / get_finish_reason()``;
  ``transfer_to_next_module(group_req_objs)``: ``GroupReqObjs.group_req_id``, ``shm_req_objs[i]
  .input_len / .prompt_cache_len`` (shared memory, read at finish); ``SamplingParams.n,
  max_new_tokens, temperature, top_p, top_k``; ``request.headers``, ``request.url.path``.
* router: ``add_req(group_req_indexes)`` / ``_add_req`` (#965) ``GroupReqIndexes.{group_req_id,
  multimodal_params, shm_req_indexes, time_mark}`` (2024: ``add_req(prompt_ids, sampling_params,
  multimodal_params, group_req_id)``); ``<Queue>.generate_new_batch`` -> ``Batch.reqs``;
  ``Req.{request_id, input_len, shm_cur_output_len, prompt_cache_len, is_aborted,
  finish_status}``; ``_decode_batch()`` / ``_decode_batch(batch)`` (v1.0) and ``running_batch``.
* worker: ``InferenceContext.add_reqs(requests, ...)`` tuples ``(request_id, shm_index,
  multimodal_params, dp_index)``; ``InferReq.set_next_gen_token_id(next_token_id, logprob[,
  output_len])``, ``InferReq.{req_id, shm_req, finish_status}``; ``InferenceContext.filter(
  finished_request_ids)`` and ``requests_mapping``.

Every wrapper calls LightLLM exactly as it was called and returns its result untouched; our own
failures are counted in ``llm_otel.instrumentation.errors`` and never reach LightLLM.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import math
import operator
import os
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from llm_otel.errors import guard
from llm_otel.instrumentation.lightllm import carrier as C
from llm_otel.listeners import RequestFacts
from llm_otel.propagation import TRACEPARENT, TRACESTATE, carrier_from_span, context_from_carrier, extract_carrier
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import RequestRecord, Telemetry
from llm_otel.telemetry.stages import INFER, ROUTER, StageRecord
from llm_otel.telemetry.steps import EngineSteps

PROVIDER = "lightllm"
_STATE_KEY = otel_context.create_key("llm_otel.lightllm.http_request")
MAX_LIVE = 100_000  # per-process cap on tracked requests (aborted/lost ones cannot leak past it)


# set while LightLLM's own health check (lightllm/utils/health_check.py health_check) runs: the
# generate() it calls is a probe, not a request. v1.0.x probes have no is_health_req flag and a
# positive id from the ordinary id generator, so the call site is the only thing that tells them apart.
_HEALTH_PROBE: contextvars.ContextVar[bool] = contextvars.ContextVar("llm_otel_lightllm_health_probe", default=False)


def request_id(value: Any) -> int | None:
    """A LightLLM request id as a Python int, or None when ``value`` is not an integer.

    LightLLM's ids are ``numpy.int64``: ``ReqIDGenerator.generate_id()`` reads them from a numpy
    array in shared memory (``lightllm/server/req_id_generator.py``), and ``group_request_id + i``
    stays one; ids read back from a ctypes ``Req`` struct are Python ints. Any integer type is
    accepted (``operator.index``); ``bool`` is not an id.
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _bind(wrapped, args, kwargs) -> dict:
    try:
        return inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}


def _finish_info(finish_status: Any) -> tuple[bool, bool, str | None]:
    """(finished, aborted, reason) of a LightLLM ``FinishStatus``."""
    try:
        finished = bool(finish_status.is_finished())
    except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
        return False, False, None
    aborted = False
    try:
        aborted = bool(finish_status.is_aborted())
    except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
        pass
    reason = None
    if finished and not aborted:
        try:
            reason = finish_status.get_finish_reason()
        except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
            reason = None
    return finished, aborted, reason if isinstance(reason, str) else None


def model_name(env: dict | None = None, args: Any = None) -> str:
    """Served model name: ``args.model_name`` unless it is LightLLM's default
    (``"default_model_name"``), else the last part of ``args.model_dir``; "unknown" without either.

    ``args`` is the start-args object ``HttpServerManager`` is built with (an attribute object or a
    mapping); without it (or when it names no model) the JSON in ``LIGHTLLM_START_ARGS`` that every
    LightLLM process inherits is read, from ``env`` (default ``os.environ``) at call time.
    """
    for source in (args, None):
        if source is None:
            env = os.environ if env is None else env
            try:
                source = json.loads(env.get("LIGHTLLM_START_ARGS") or "{}")
            except ValueError:
                return "unknown"
        get = source.get if isinstance(source, dict) else (lambda key, s=source: getattr(s, key, None))
        name = get("model_name")
        if isinstance(name, str) and name and name != "default_model_name":
            return name
        model_dir = get("model_dir")
        if isinstance(model_dir, str) and model_dir.rstrip("/"):
            return os.path.basename(model_dir.rstrip("/"))
    return "unknown"


def engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("lightllm")
    except Exception:  # noqa: BLE001 - silent: feature probe: version unknown
        return ""


# --- HTTP worker ------------------------------------------------------------------------------
class _HttpRequest:
    """One ``generate`` call (a group of ``n`` choices) in an HTTP worker."""

    __slots__ = ("arrival_s", "parent", "kind", "operation", "attrs", "headers", "group_id", "records", "shm_reqs",
                 "health", "aborted", "done", "context")

    def __init__(self, arrival_s: float, parent, kind, operation: str, attrs: dict, headers=None) -> None:
        self.arrival_s = arrival_s
        self.parent = parent
        self.kind = kind
        self.operation = operation
        self.attrs = attrs
        self.headers = headers  # the HTTP request's headers, for request classes (llm_otel.signals)
        self.group_id: int | None = None
        self.records: dict[int, RequestRecord] = {}
        self.shm_reqs: list = []
        self.health = False
        self.aborted = False
        self.done: set[int] = set()
        self.context = None


class HttpAdapter:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._model: str | None = None  # set when HttpServerManager is built (init hook)
        self.version = engine_version()
        self.live: dict[int, _HttpRequest] = {}

    @property
    def model(self) -> str:
        """The served model: from the args ``HttpServerManager`` was built with, else (an application
        that calls generate on a manager built before instrumenting) from the environment now."""
        return self._model if self._model is not None else model_name()

    def init(self, hook: str):
        """``HttpServerManager.__init__(self, args, ...)``: the model name of this HTTP worker."""

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                name = model_name(args=_bind(wrapped, args, kwargs).get("args"))
                if name != "unknown" or self._model is None:
                    self._model = name
            return result

        return wrapper

    def health_check(self, hook: str):
        """``lightllm.utils.health_check.health_check(args, httpserver_manager, request)``: the
        ``generate`` calls made while it runs are health probes (no spans, no request metrics)."""

        def wrapper(wrapped, instance, args, kwargs):
            async def probe():
                token = _HEALTH_PROBE.set(True)
                try:
                    return await wrapped(*args, **kwargs)
                finally:
                    _HEALTH_PROBE.reset(token)

            return probe()

        return wrapper

    # wrapper factories
    def generate(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            state = None
            with guard(hook, self.telemetry.errors):
                state = self._begin(wrapped, args, kwargs)
            if state is None:
                return wrapped(*args, **kwargs)
            return self._traced(hook, state, wrapped(*args, **kwargs))

        return wrapper

    def transfer(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                state = otel_context.get_value(_STATE_KEY)
                if isinstance(state, _HttpRequest) and state.group_id is None:
                    bound = _bind(wrapped, args, kwargs)
                    objs = bound.get("group_req_objs")
                    if objs is not None:
                        reqs = list(getattr(objs, "shm_req_objs", None) or ())
                        gid = request_id(objs.group_req_id)
                        if gid is not None:
                            self._start(state, gid, getattr(objs, "multimodal_params", None), max(1, len(reqs)), reqs)
            return wrapped(*args, **kwargs)

        return wrapper

    def abort(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                gid = request_id(_bind(wrapped, args, kwargs).get("group_req_id", args[0] if args else None))
                state = self.live.get(gid) if gid is not None else None
                if state is not None:
                    state.aborted = True
            return wrapped(*args, **kwargs)

        return wrapper

    # request life
    def _begin(self, wrapped, args, kwargs) -> _HttpRequest | None:
        if _HEALTH_PROBE.get():
            return None
        bound = _bind(wrapped, args, kwargs)
        if bound.get("is_health_req"):
            return None
        gid = request_id(bound.get("group_request_id"))  # 2024 layout: the id is an argument
        if gid is not None and gid < 0:
            return None
        if len(self.live) >= MAX_LIVE:
            return None
        request = bound.get("request")
        inbound = None
        headers = None
        kind = SpanKind.INTERNAL
        operation = "text_completion"
        if request is not None:
            kind = SpanKind.SERVER
            headers = getattr(request, "headers", None)
            inbound = context_from_carrier(extract_carrier(headers or {}))
            path = str(getattr(getattr(request, "url", None), "path", "") or "")
            if "chat" in path:
                operation = "chat"
        if inbound is None:
            # P/D nodes and multinode slaves call generate(request=None) with the MultimodalParams
            # the P/D master / master node pickled to them: continue under the carrier it holds
            carrier = getattr(bound.get("multimodal_params"), C.CARRIER_ATTR, None)
            if C.valid(carrier):
                inbound = context_from_carrier({k: carrier[k] for k in (TRACEPARENT, TRACESTATE) if k in carrier})
        parent = inbound if inbound is not None else otel_context.get_current()
        sp = bound.get("sampling_params")
        attrs: dict[str, Any] = {}
        value = getattr(sp, "max_new_tokens", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = value
        value = getattr(sp, "top_k", None)  # LightLLM: -1 = disabled
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            attrs[A.GEN_AI_REQUEST_TOP_K] = float(value)
        for attr, field in ((A.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (A.GEN_AI_REQUEST_TOP_P, "top_p")):
            value = getattr(sp, field, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                attrs[attr] = float(value)
        n = getattr(sp, "n", None) or getattr(sp, "best_of", None)
        if isinstance(n, int) and n > 1:
            attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = n
        state = _HttpRequest(time.time(), parent, kind, operation, attrs, headers)
        state.context = otel_context.set_value(_STATE_KEY, state, parent)
        if gid is not None:  # 2024 layout: start now, the carrier must be on the object before it is sent
            choices = n if isinstance(n, int) and n > 0 else 1
            self._start(state, gid, bound.get("multimodal_params"), choices, [])
        return state

    def _start(self, state: _HttpRequest, gid: int, multimodal_params, n: int, shm_reqs: list) -> None:
        state.group_id = gid
        if gid < 0:  # health probe (negative ids)
            state.health = True
            return
        state.shm_reqs = shm_reqs
        for i in range(n):
            input_tokens = getattr(shm_reqs[i], "input_len", 0) if i < len(shm_reqs) else 0
            rec = self.telemetry.start_request(
                str(gid + i), operation=state.operation, provider=PROVIDER, model=self.model,
                arrival_s=state.arrival_s, input_tokens=int(input_tokens), kind=state.kind, parent=state.parent,
                engine_version=self.version, choice_index=i, request_attributes=state.attrs,
                facts=RequestFacts(state.headers))
            state.records[i] = rec
        self.live[gid] = state
        first = state.records[0].span
        state.context = otel_context.set_value(_STATE_KEY, state,
                                               self.telemetry.request_context(state.records[0], state.parent))
        if multimodal_params is not None:
            carrier = carrier_from_span(first)
            if TRACEPARENT in carrier:
                value = {TRACEPARENT: carrier[TRACEPARENT], C.GROUP_KEY: gid,
                         C.CHOICES_KEY: [carrier_from_span(r.span).get(TRACEPARENT, "") for r in state.records.values()]}
                if carrier.get(TRACESTATE):
                    value[TRACESTATE] = carrier[TRACESTATE]
                k = self.telemetry.settings.logprobs_top_k
                if k > 0 and first.is_recording() and self._wants_logit_dist(first):
                    value[C.TOPK_KEY] = k
                setattr(multimodal_params, C.CARRIER_ATTR, value)

    def _wants_logit_dist(self, span) -> bool:
        """``LLM_OTEL_LOGIT_DIST_RATIO`` of sampled requests, chosen by the random low 56 bits of the
        trace id (the same choice as the vLLM adapter makes)."""
        ratio = self.telemetry.settings.logit_dist_ratio
        if ratio >= 1.0:
            return True
        return (span.get_span_context().trace_id & ((1 << 56) - 1)) < ratio * (1 << 56)

    async def _traced(self, hook: str, state: _HttpRequest, agen):
        error: str | None = None
        failure: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(state.context)
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                try:
                    self._on_item(state, item)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
                yield item
        except GeneratorExit:  # the consumer closed the stream: client disconnected
            error = "aborted"
            await agen.aclose()
            raise
        except BaseException as exc:
            failure = exc
            # LightLLM ends a disconnected client's request with abort() and a plain Exception
            # (and its own except-handler aborts on any error, so abort() alone says nothing)
            aborted = isinstance(exc, asyncio.CancelledError) or (state.aborted and type(exc) is Exception)
            error = "aborted" if aborted else type(exc).__qualname__
            raise
        finally:
            with guard(hook, self.telemetry.errors):
                self._end(state, error, failure)

    def _on_item(self, state: _HttpRequest, item) -> None:
        sub_id, _text, metadata, finish_status = item
        sub_id = request_id(sub_id)
        if sub_id is None:
            return
        now = time.monotonic()
        if state.group_id is None:  # no transfer hook in this layout: start at the first output
            self._start(state, C.group_of(sub_id), None, 1, [])
        if state.health:
            return
        index = sub_id - state.group_id
        rec = state.records.get(index)
        if rec is None or index in state.done:
            return
        token_id = metadata.get("id") if isinstance(metadata, dict) else None
        rec.on_tokens([int(token_id) if isinstance(token_id, int) else -1], now)
        self.telemetry.on_tokens(1, now)  # LightLLM yields each token of each choice on its own
        if isinstance(metadata, dict):
            if not rec.input_tokens and isinstance(metadata.get("prompt_tokens"), int):
                rec.input_tokens = metadata["prompt_tokens"]
            cache = metadata.get("prompt_cache_len")
            if isinstance(cache, int):
                rec.cached_tokens = cache
        finished, aborted, reason = _finish_info(finish_status)
        if finished:
            if isinstance(metadata, dict) and isinstance(metadata.get("count_output_tokens"), int):
                rec.num_output_tokens = metadata["count_output_tokens"]
            if aborted:
                rec.error_type = "aborted"
            rec.finish_reason = reason
            self._finish(state, index)

    def _finish(self, state: _HttpRequest, index: int) -> None:
        rec = state.records[index]
        if index < len(state.shm_reqs):
            cache = getattr(state.shm_reqs[index], "prompt_cache_len", None)
            if isinstance(cache, int) and rec.cached_tokens is None:
                rec.cached_tokens = cache
        state.done.add(index)
        self.telemetry.finish(rec)

    def _end(self, state: _HttpRequest, error: str | None, failure: BaseException | None = None) -> None:
        if state.group_id is not None:
            self.live.pop(state.group_id, None)
        if error is None and state.aborted:
            error = "aborted"
        if not state.records and not state.health and failure is not None and error != "aborted":
            # refused before it was handed to the router (prompt too long, bad parameters, ...)
            self.telemetry.reject(operation=state.operation, provider=PROVIDER, model=self.model,
                                  arrival_s=state.arrival_s, error=failure, kind=state.kind, parent=state.parent,
                                  engine_version=self.version, request_attributes=state.attrs)
            return
        for index, rec in state.records.items():
            if index in state.done:
                continue
            rec.error_type = error or "incomplete"
            self._finish(state, index)


# --- router -----------------------------------------------------------------------------------
class RouterAdapter:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.reqs: dict[int, StageRecord] = {}  # llm.router.request records by sub-request id
        # llm.engine.step through the core's step API: LLM_OTEL_STEP_SPANS_PER_S, the same budget
        # as vLLM's engine core (one router = one engine loop); a step serving no sampled request
        # takes nothing from it
        self.step_spans = EngineSteps(telemetry)

    def add_req(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                self._queued(wrapped, args, kwargs)
            return wrapped(*args, **kwargs)

        return wrapper

    def _queued(self, wrapped, args, kwargs) -> None:
        now = time.time_ns()
        bound = _bind(wrapped, args, kwargs)
        indexes = bound.get("group_req_indexes")
        if indexes is not None:
            gid, mm = indexes.group_req_id, indexes.multimodal_params
            n, time_mark = len(indexes.shm_req_indexes), getattr(indexes, "time_mark", None)
        else:  # 2024: add_req(prompt_ids, sampling_params, multimodal_params, group_req_id[, start_time])
            gid, mm = bound.get("group_req_id"), bound.get("multimodal_params")
            sp = bound.get("sampling_params")
            n = getattr(sp, "n", None) or getattr(sp, "best_of", None) or 1
            time_mark = bound.get("start_time")
        gid = request_id(gid)
        if gid is None or gid < 0 or len(self.reqs) >= MAX_LIVE:
            return
        carrier = C.carrier_for(mm, gid)
        if carrier is None:
            return
        for i in range(int(n)):
            parent, sampled = C.parent_for(carrier, gid + i)
            if not sampled:
                continue
            self.reqs[gid + i] = self.telemetry.start_stage(
                ROUTER, gid + i, parent, group_id=gid, choice_index=i, start_ns=now, queued_ns=now,
                frontend_arrival_s=time_mark)

    def admit(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            batch = wrapped(*args, **kwargs)
            try:
                if batch is not None and self.reqs:
                    now = time.time_ns()
                    for req in getattr(batch, "reqs", None) or ():
                        st = self.reqs.get(request_id(getattr(req, "request_id", None)))
                        if st is not None and st.scheduled_ns is None:
                            st.scheduled_ns = now
                            st.input_tokens = getattr(req, "input_len", None)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return batch

        return wrapper

    def decode_batch(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if not self.reqs or not self.step_spans.ready():
                return wrapped(*args, **kwargs)
            try:
                batch = _bind(wrapped, args, kwargs).get("batch") or getattr(instance, "running_batch", None)
                reqs = list(getattr(batch, "reqs", None) or ())
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
                return wrapped(*args, **kwargs)
            return self._step(hook, wrapped(*args, **kwargs), reqs)

        return wrapper

    async def _step(self, hook: str, coro, reqs: list):
        start_ns = time.time_ns()
        try:
            return await coro
        finally:
            try:
                linked = [st.span_context for st in (self.reqs.get(request_id(getattr(r, "request_id", None)))
                                                     for r in reqs) if st]
                span = self.step_spans.start(linked, start_ns=start_ns, batch_size=len(reqs))
                if span is not None:
                    self.step_spans.finish(span)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)

    def filter_finished(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if not self.reqs:
                return wrapped(*args, **kwargs)
            snapshot = {}
            try:
                for req in list(getattr(instance, "reqs", None) or ()):
                    rid = request_id(getattr(req, "request_id", None))
                    if rid in self.reqs:
                        snapshot[rid] = self._read(req)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            try:
                if snapshot:
                    left = {request_id(getattr(r, "request_id", None)) for r in getattr(instance, "reqs", None) or ()}
                    for rid, facts in snapshot.items():
                        if rid not in left:
                            _end_stage(self.telemetry, self.reqs, rid, facts)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    @staticmethod
    def _read(req) -> dict:
        finished, aborted, reason = _finish_info(getattr(req, "finish_status", None))
        output = getattr(req, "shm_cur_output_len", None)
        if output is None:  # 2024 layout: io_struct.Req
            output = getattr(req, "cur_output_len", None)
        return {"output": output, "cache": getattr(req, "prompt_cache_len", None),
                "input": getattr(req, "input_len", None), "reason": reason,
                "aborted": bool(getattr(req, "is_aborted", False)) or aborted}


def _end_stage(telemetry: Telemetry, reqs: dict[int, StageRecord], rid: int, facts: dict) -> None:
    """Sub-request ``rid`` left this process (router or worker): its record, popped from ``reqs``,
    gets the facts read off LightLLM's request as it left (``_read``: input/output/cached tokens,
    finish reason, aborted), the core builds its span; the carrier is dropped once no choice of its
    group is left here."""
    st = reqs.pop(rid)
    if isinstance(facts["input"], int):  # else the length read at admission / first token
        st.input_tokens = facts["input"]
    if isinstance(facts.get("output"), int):  # router: the engine's count; the worker counts its own
        st.output_tokens = facts["output"]
    st.cached_tokens = facts["cache"]
    st.finish_reason = facts["reason"]
    st.aborted = facts["aborted"]
    telemetry.end_stage(st)
    if not any(r.group_id == st.group_id for r in reqs.values()):
        C.TABLE.pop(st.group_id)


# --- model-infer worker -----------------------------------------------------------------------
MAX_LOGIT_STEPS = 4096


def _master_rank() -> bool | None:
    """Whether this worker is the master rank of its DP group - the one whose results LightLLM
    writes to shared memory; None if unknown yet (then it reports). main / v1.0.1:
    ``lightllm.utils.dist_utils.get_current_rank_in_dp() == 0``; v1.0.0 has no such function (its
    ``dist_utils`` only wraps ``torch.distributed``) and every rank samples and sets tokens: the
    rank from the process's ``_init_env`` arguments (``process.is_master_worker``: ``tp_rank <
    dp_size``, as v1.0.0's ``post_handel`` writes shared memory)."""
    try:
        from lightllm.utils.dist_utils import get_current_rank_in_dp
    except ImportError:
        from llm_otel.instrumentation.lightllm.process import is_master_worker

        return is_master_worker()
    try:
        return get_current_rank_in_dp() == 0
    except Exception:  # noqa: BLE001 - silent: not initialised: treat as master
        return None


class WorkerAdapter:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.reqs: dict[int, StageRecord] = {}  # llm.infer.request records by sub-request id
        self._master: bool | None = None

    def add_reqs(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                self._admitted(wrapped, args, kwargs)
            return wrapped(*args, **kwargs)

        return wrapper

    def _admitted(self, wrapped, args, kwargs) -> None:
        if self._master is None:
            self._master = _master_rank()
        if self._master is False:
            return
        now = time.time_ns()
        for item in _bind(wrapped, args, kwargs).get("requests") or ():
            rid, mm = request_id(item[0]), item[2]
            if rid is None or rid < 0:
                continue
            st = self.reqs.get(rid)
            if st is not None:  # paused and resumed
                st.resumed += 1
                continue
            gid = C.group_of(rid)
            carrier = C.carrier_for(mm, gid)
            if carrier is None or len(self.reqs) >= MAX_LIVE:
                continue
            parent, sampled = C.parent_for(carrier, rid)
            if sampled:
                top_k = carrier.get(C.TOPK_KEY)
                top_k = top_k if isinstance(top_k, int) and 0 < top_k <= 64 else 0
                # the worker counts the tokens it produces (one set_next_gen_token_id call each)
                self.reqs[rid] = self.telemetry.start_stage(
                    INFER, rid, parent, group_id=gid, choice_index=rid - gid, start_ns=now, output_tokens=0,
                    logit_top_k=top_k)

    def token(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if self.reqs:
                try:
                    st = self.reqs.get(request_id(instance.req_id))
                    if st is not None:
                        now = time.time_ns()
                        token_id = args[0] if args else kwargs.get("next_token_id")
                        logprob = args[1] if len(args) > 1 else kwargs.get("logprob", 0.0)
                        if not st.token_times:
                            shm = getattr(instance, "shm_req", None)
                            st.input_tokens = getattr(shm, "input_len", None)
                        st.on_token(token_id, logprob, now)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper

    def sample(self, hook: str):
        """``sample(logits, reqs, eos_id)``: statistics of the chosen rows are taken on the logits'
        device before LightLLM's sampler runs (it modifies the logits in place); one transfer after it."""

        def wrapper(wrapped, instance, args, kwargs):
            plan = None
            if self.reqs:
                try:
                    plan = self._prepare(args, kwargs)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            output = wrapped(*args, **kwargs)
            if plan is not None:
                try:
                    self._collect(plan, output)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return output

        return wrapper

    def _prepare(self, args, kwargs):
        logits = args[0] if args else kwargs.get("logits")
        reqs = args[1] if len(args) > 1 else kwargs.get("reqs")
        rows, members, k = [], [], 0
        for i, req in enumerate(reqs or ()):
            st = self.reqs.get(request_id(getattr(req, "req_id", None)))
            if st is not None and st.logit_top_k and len(st.logit_rows) < MAX_LOGIT_STEPS:
                rows.append(i)
                members.append(st)
                k = max(k, st.logit_top_k)
        if not rows or logits is None:
            return None
        import torch

        from llm_otel.telemetry.logits import TorchLogitStats

        index = torch.tensor(rows, device=logits.device)
        return index, members, TorchLogitStats(logits.index_select(0, index), k)

    def _collect(self, plan, output) -> None:
        import torch

        index, members, device_stats = plan
        ids = output[0] if isinstance(output, tuple) else None
        sampled = None
        if ids is not None:
            ids = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
            sampled = ids.reshape(-1).index_select(0, index.to(ids.device))
        stats, sampled_lp = device_stats.to_host(sampled)
        now = time.time_ns()
        for j, st in enumerate(members):
            k = st.logit_top_k
            st.logit_rows.append((now, stats.top_ids[j, :k], stats.top_logprobs[j, :k], float(stats.entropy[j]),
                                  float(stats.margin[j]), bool(stats.nonfinite[j]),
                                  float(sampled_lp[j]) if sampled_lp is not None else math.nan))

    def filter(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            ended = []
            if self.reqs:
                try:
                    ids = _bind(wrapped, args, kwargs).get("finished_request_ids") or ()
                    mapping = getattr(instance, "requests_mapping", None) or {}
                    for rid in map(request_id, ids):
                        if rid in self.reqs:
                            ended.append((rid, self._read(mapping.get(rid))))
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            for rid, facts in ended:
                try:
                    _end_stage(self.telemetry, self.reqs, rid, facts)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    @staticmethod
    def _read(req) -> dict:
        shm = getattr(req, "shm_req", None)
        _finished, aborted, reason = _finish_info(getattr(req, "finish_status", None))
        return {"reason": reason, "input": getattr(shm, "input_len", None), "cache": getattr(shm, "prompt_cache_len", None),
                "aborted": aborted or bool(getattr(shm, "router_aborted", False) or getattr(shm, "is_aborted", False))}


class LightLLMAdapter:
    """Wrapper factories for the hooks in :mod:`.hooks`, one sub-adapter per LightLLM process kind."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.http = HttpAdapter(telemetry)
        self.router = RouterAdapter(telemetry)
        self.worker = WorkerAdapter(telemetry)
