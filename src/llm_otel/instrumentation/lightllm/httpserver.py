"""LightLLM's HTTP worker (``HttpServerManager``): one request span per choice, built by the core
from a :class:`~llm_otel.telemetry.RequestRecord` (``llm.prompt`` arrival -> first token,
``llm.token_stream`` first -> last token), and the trace carrier (:mod:`.carrier`) on the
``MultimodalParams`` that travel to the router and the model-infer worker.

Engine fields read (ModelTC/lightllm main @ fc72ffab unless noted): ``generate(prompt,
sampling_params, multimodal_params, request, is_health_req=False)`` (2024: ``(prompt,
sampling_params, group_request_id, multimodal_params, request=None)``) yields ``(sub_req_id, text,
metadata, finish_status)``; ``metadata["id"]`` (token id), ``["count_output_tokens"]`` (engine
output count), ``["prompt_tokens"]``; ``FinishStatus.is_finished() / is_aborted() /
get_finish_reason()``; ``transfer_to_next_module(group_req_objs)``: ``GroupReqObjs.group_req_id``,
``shm_req_objs[i].input_len / .prompt_cache_len`` (shared memory, read at finish);
``SamplingParams.n, max_new_tokens, temperature, top_p, top_k``; ``request.headers``,
``request.url.path``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import TYPE_CHECKING, cast

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from llm_otel.errors import guard
from llm_otel.instrumentation.lightllm import carrier as C
from llm_otel.instrumentation.lightllm.requests import (
    MAX_LIVE,
    PROVIDER,
    bind,
    engine_version,
    finish_info,
    model_name,
    request_id,
    sampling_attributes,
)
from llm_otel.listeners import RequestFacts
from llm_otel.propagation import TRACEPARENT, TRACESTATE, carrier_from_span, context_from_carrier, extract_carrier
from llm_otel.telemetry import RequestRecord, Telemetry
from llm_otel.telemetry.logit_capture import logit_top_k

_STATE_KEY = otel_context.create_key("llm_otel.lightllm.http_request")

# set while LightLLM's own health check (lightllm/utils/health_check.py health_check) runs: the
# generate() it calls is a probe, not a request. v1.0.x probes have no is_health_req flag and a
# positive id from the ordinary id generator, so the call site is the only thing that tells them apart.
_HEALTH_PROBE: contextvars.ContextVar[bool] = contextvars.ContextVar("llm_otel_lightllm_health_probe", default=False)


class _HttpRequest:
    """One ``generate`` call (a group of ``n`` choices) in an HTTP worker."""

    __slots__ = (
        "arrival_s",
        "parent",
        "kind",
        "operation",
        "attrs",
        "headers",
        "group_id",
        "records",
        "shm_reqs",
        "health",
        "aborted",
        "done",
        "context",
    )

    def __init__(self, arrival_s: float, parent: Context, kind, operation: str, attrs: dict, headers=None) -> None:
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
        self.context: Context = otel_context.set_value(_STATE_KEY, self, parent)


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
                name = model_name(args=bind(wrapped, args, kwargs).get("args"))
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
                    bound = bind(wrapped, args, kwargs)
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
                gid = request_id(bind(wrapped, args, kwargs).get("group_req_id", args[0] if args else None))
                state = self.live.get(gid) if gid is not None else None
                if state is not None:
                    state.aborted = True
            return wrapped(*args, **kwargs)

        return wrapper

    # request life
    def _begin(self, wrapped, args, kwargs) -> _HttpRequest | None:
        if _HEALTH_PROBE.get():
            return None
        bound = bind(wrapped, args, kwargs)
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
        attrs = sampling_attributes(sp)
        n = getattr(sp, "n", None) or getattr(sp, "best_of", None)
        state = _HttpRequest(time.time(), parent, kind, operation, attrs, headers)
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
                str(gid + i),
                operation=state.operation,
                provider=PROVIDER,
                model=self.model,
                arrival_s=state.arrival_s,
                input_tokens=int(input_tokens),
                kind=state.kind,
                parent=state.parent,
                engine_version=self.version,
                choice_index=i,
                request_attributes=state.attrs,
                facts=RequestFacts(state.headers),
            )
            state.records[i] = rec
        self.live[gid] = state
        first = state.records[0].span
        if TYPE_CHECKING:  # for the checker only: start_request always starts a span
            assert first is not None
        state.context = otel_context.set_value(
            _STATE_KEY, state, self.telemetry.request_context(state.records[0], state.parent)
        )
        if multimodal_params is not None:
            carrier = carrier_from_span(first)
            if TRACEPARENT in carrier:
                choices: list[str] = []
                for rec in state.records.values():
                    span = rec.span
                    if TYPE_CHECKING:  # for the checker only: start_request always starts a span
                        assert span is not None
                    choices.append(carrier_from_span(span).get(TRACEPARENT, ""))
                value = {
                    TRACEPARENT: carrier[TRACEPARENT],
                    C.GROUP_KEY: gid,
                    C.CHOICES_KEY: choices,
                }
                if carrier.get(TRACESTATE):
                    value[TRACESTATE] = carrier[TRACESTATE]
                k = logit_top_k(self.telemetry.settings, first, recording=first.is_recording())
                if k:
                    value[C.TOPK_KEY] = k
                setattr(multimodal_params, C.CARRIER_ATTR, value)

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
                try:  # per token: inline, not errors.guard (0.3-0.7 us more)
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
        index = sub_id - cast(int, state.group_id)  # set by _start
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
        finished, aborted, reason = finish_info(finish_status)
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
            self.telemetry.reject(
                operation=state.operation,
                provider=PROVIDER,
                model=self.model,
                arrival_s=state.arrival_s,
                error=failure,
                kind=state.kind,
                parent=state.parent,
                engine_version=self.version,
                request_attributes=state.attrs,
            )
            return
        for index, rec in state.records.items():
            if index in state.done:
                continue
            rec.error_type = error or "incomplete"
            self._finish(state, index)
