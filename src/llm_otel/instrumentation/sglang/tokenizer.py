"""SGLang's HTTP process (``TokenizerManager``): one request span per request id (``n`` > 1: one per
choice), built by the core from a :class:`~llm_otel.telemetry.RequestRecord` - ``llm.prompt``
(arrival -> first output), ``llm.token_stream`` (first -> last output, a timing per output batch) -
and the GenAI server metrics for every request, sampled or not.

Engine fields read (sgl-project/sglang 0.5.23, python/sglang/srt/managers/tokenizer_manager.py):
``_init_req_state(obj, request)`` after ``GenerateReqInput.normalize_batch_and_arguments()``:
``obj.rid`` (str, or a list when the request fans out), ``obj.is_single``, ``obj.stream``,
``obj.sampling_params`` (dict: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``n``),
``obj.external_trace_header``, ``request.headers`` / ``request.url.path`` (fastapi),
``self.rid_to_state[rid].time_stats`` (``APIServerReqTimeStats``: the carrier to the scheduler),
``self.enable_trace``, ``self.served_model_name``; ``_handle_batch_output(recv_obj)``:
``BatchStrOutput``/``BatchTokenIDOutput`` ``.rids``, ``.output_ids[i]`` (the ids new since the last
output of that request), ``.finished_reasons[i]`` (``{"type": "stop"|"length"|"abort", ...}`` or
None), ``.prompt_tokens[i]``, ``.completion_tokens[i]``, ``.cached_tokens[i]`` - the values SGLang
puts in ``meta_info``; ``abort_request(rid)``.

Token timing: SGLang's scheduler sends a streaming request's output every ``--stream-interval``
steps (1) and a non-streaming request's every ``SGLANG_FORCE_STREAM_INTERVAL`` steps (50) and at its
finish, so a non-streaming request has a token batch per 50 tokens (its TTFT is the time to its first
batch).
"""

from __future__ import annotations

import contextvars
import math
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from llm_otel.errors import guard
from llm_otel.instrumentation.sglang.fields import class_fields, kv_spec
from llm_otel.listeners import RequestFacts
from llm_otel.propagation import TRACEPARENT, TRACESTATE, carrier_from_span, context_from_carrier, extract_carrier
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import RequestRecord, Telemetry
from llm_otel.telemetry.logit_capture import logit_top_k
from llm_otel.telemetry.record import ChoiceGroup

PROVIDER = "sglang"
MAX_LIVE = 100_000  # per-process cap on tracked requests
CARRIER_ATTR = "_llm_otel_carrier"  # on APIServerReqTimeStats; pickled by the carrier_getstate hook
TOPK_KEY = "llm_otel.logit_top_k"  # in the carrier: k of the logit statistics asked for (chosen requests)
CHOICE_KEY = "llm_otel.choice"  # in the carrier: the request's choice index
HEALTH_PREFIX = "HEALTH_CHECK"  # sglang/srt/constants.py HEALTH_CHECK_RID_PREFIX


class _Call:
    """One ``generate_request`` call: the rids whose records it owns and, for ``n`` > 1, how many
    ``_init_req_state`` calls are SGLang's prefix-cache warm-ups (``max_new_tokens=0``, one per
    prompt, not requests of the client) before the ``n`` samples per prompt."""

    __slots__ = ("rids", "warmups", "samples", "n", "started", "origin", "group")

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.warmups = 0
        self.samples = 0
        self.n = 1
        self.started = False
        self.origin: tuple = ()
        self.group: ChoiceGroup | None = None  # the prompt's n choices: request metrics count it once


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("llm_otel_sglang_call", default=None)


def engine_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - silent: a source checkout without metadata (no version)
        return ""


def _bind(args, kwargs, names: tuple[str, ...]) -> list[Any]:
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(names)]


def _rids(obj) -> list[str]:
    rid = getattr(obj, "rid", None)
    if isinstance(rid, str):
        return [rid]
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str)]
    return []


def _request_attributes(params: Any) -> dict[str, Any]:
    """GenAI request attributes from SGLang's sampling params (a dict, or a list of dicts when the
    request fans out: the first one)."""
    if isinstance(params, list):
        params = params[0] if params else None
    if not isinstance(params, dict):
        return {}
    attrs: dict[str, Any] = {}
    value = params.get("max_new_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = value
    value = params.get("top_k")  # SGLang: -1 = disabled
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        attrs[A.GEN_AI_REQUEST_TOP_K] = float(value)
    for attr, field in ((A.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (A.GEN_AI_REQUEST_TOP_P, "top_p")):
        value = params.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            attrs[attr] = float(value)
    n = params.get("n")
    if isinstance(n, int) and n > 1:
        attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = n
    return attrs


class TokenizerAdapter:
    """Wrapper factories for the TokenizerManager hooks (``tokenizer.*`` in hooks.py)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.version = engine_version()
        self.live: dict[str, RequestRecord] = {}  # request id -> record, freed at finish/abort/close
        self.kv: Any = None  # the KVSpec of this process's TokenizerManager (llm_otel.signals), or None
        self._kv_of: Any = None  # the TokenizerManager self.kv was read from (one per process)

    def init_req_state(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            started: list[tuple[str, RequestRecord]] = []
            with guard(hook, self.telemetry.errors):
                started = self._start(instance, *_bind(args, kwargs, ("obj", "request")))
            try:
                result = wrapped(*args, **kwargs)
            except BaseException as exc:
                with guard(hook, self.telemetry.errors):
                    for rid, rec in started:  # refused (a duplicate id): the record ends as an error
                        if self.live.pop(rid, None) is not None:
                            rec.error_type = type(exc).__qualname__
                            self.telemetry.finish(rec)
                raise
            with guard(hook, self.telemetry.errors):
                states = getattr(instance, "rid_to_state", None) or {}
                for rid, rec in started:
                    state = states.get(rid)
                    span = rec.span
                    if state is not None and span is not None and rec.recording:
                        carrier: dict[str, Any] = dict(carrier_from_span(span))
                        k = logit_top_k(self.telemetry.settings, span, recording=True)
                        if k:  # chosen for llm.logit_dist: the scheduler captures its logit rows
                            carrier[TOPK_KEY] = k
                            carrier[CHOICE_KEY] = rec.request_attributes.get(A.LLM_REQUEST_CHOICE_INDEX, 0)
                        setattr(state.time_stats, CARRIER_ATTR, carrier)
            return result

        return wrapper

    def _start(self, manager, obj, request) -> list[tuple[str, RequestRecord]]:
        rids = [r for r in _rids(obj) if not r.startswith(HEALTH_PREFIX)]
        call = _CALL.get()
        choice = 0
        if call is None or not call.started:
            origin = self._origin(manager, obj, request)
            if call is not None:
                call.started, call.origin = True, origin
                # TokenizerManager._handle_batch_request with n > 1: the initial rids are replaced;
                # one warm-up per prompt, then n samples per prompt, each through _init_req_state
                # (without the fastapi request: the origin found now is theirs)
                n = getattr(obj, "parallel_sample_num", 1)
                if isinstance(n, int) and n > 1:
                    call.n, call.warmups = n, max(1, len(rids) // n)  # rids: prompts x n
                    return []
        elif call.warmups:
            call.warmups -= 1
            return []
        else:
            origin = call.origin
            if call.n > 1:
                choice = call.samples % call.n
                call.samples += 1
                if choice == 0:
                    call.group = ChoiceGroup(call.n)
        if not rids or len(self.live) + len(rids) > MAX_LIVE or not hasattr(obj, "sampling_params"):
            return []
        if call is not None:
            call.rids.extend(rids)
        kind, operation, headers, parent, attrs, arrival_s = origin
        model = str(getattr(manager, "served_model_name", None) or "unknown")
        if manager is not self._kv_of:
            self._kv_of, self.kv = manager, kv_spec(manager)
        started = []
        for index, rid in enumerate(rids):
            rec = self.telemetry.start_request(
                rid,
                operation=operation,
                provider=PROVIDER,
                model=model,
                arrival_s=arrival_s,
                input_tokens=0,
                kind=kind,
                parent=parent,
                engine_version=self.version,
                choice_index=choice + index,
                request_attributes=attrs,
                facts=RequestFacts(headers, class_fields(obj, index if call is None else 0)),
            )
            if call is not None and call.n > 1:
                rec.choice_group = call.group
            self.live[rid] = rec
            started.append((rid, rec))
        first = started[0][1].span
        if getattr(manager, "enable_trace", False) and first is not None and first.is_recording():
            # SGLang's own request root ("Req <rid>") and its stage spans nest under our request span
            carrier = carrier_from_span(first)
            obj.external_trace_header = {k: carrier[k] for k in (TRACEPARENT, TRACESTATE) if k in carrier}
        return started

    @staticmethod
    def _origin(manager, obj, request) -> tuple:
        """(kind, operation, headers, parent context, request attributes, arrival s) of a request."""
        kind, operation, headers, parent = SpanKind.INTERNAL, "text_completion", None, None
        if request is not None:
            kind = SpanKind.SERVER
            headers = getattr(request, "headers", None)
            parent = context_from_carrier(extract_carrier(headers or {}))
            if "chat" in str(getattr(getattr(request, "url", None), "path", "") or ""):
                operation = "chat"
        if parent is None:
            parent = otel_context.get_current()
        return kind, operation, headers, parent, _request_attributes(getattr(obj, "sampling_params", None)), time.time()

    def generate_request(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            (obj,) = _bind(args, kwargs, ("obj",))
            return self._traced(hook, obj, wrapped(*args, **kwargs))

        return wrapper

    async def _traced(self, hook: str, obj, agen):
        error: str | None = None
        call = _Call()
        try:
            while True:
                token = _CALL.set(call)
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    _CALL.reset(token)
                yield item
        except GeneratorExit:  # the consumer closed the stream: client disconnected
            error = "aborted"
            await agen.aclose()
            raise
        except BaseException as exc:
            error = "aborted" if type(exc).__name__ == "CancelledError" else type(exc).__qualname__
            raise
        finally:
            with guard(hook, self.telemetry.errors):
                for rid in call.rids:
                    rec = self.live.pop(rid, None)
                    if rec is not None:  # the engine's finished output did not come
                        rec.error_type = rec.error_type or error or "incomplete"
                        self.telemetry.finish(rec)

    def abort(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                (rid,) = _bind(args, kwargs, ("rid",))
                rec = self.live.get(rid) if isinstance(rid, str) else None
                if rec is not None:
                    rec.error_type = "aborted"
            return wrapped(*args, **kwargs)

        return wrapper

    def batch_output(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if self.live:
                try:  # per output batch: inline, not errors.guard
                    (recv,) = _bind(args, kwargs, ("recv_obj",))
                    self._on_output(recv)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper

    def _on_output(self, recv) -> None:
        rids = getattr(recv, "rids", None) or ()
        output_ids = getattr(recv, "output_ids", None)
        if output_ids is None:  # embeddings: no tokens
            return
        now = time.monotonic()
        live = self.live
        total = 0
        for i, rid in enumerate(rids):
            rec = live.get(rid)
            if rec is None:
                continue
            if not rec.input_tokens and self.kv is not None:
                # SGLang tokenizes after _init_req_state: the prompt's length (and its KV estimate,
                # docs/signals.md) comes with the request's first output batch
                rec.input_tokens = int(recv.prompt_tokens[i])
                self.telemetry.signals.admit(rec, rec.metric_attributes, (rec.signal_state or (None,))[0], self.kv)
            ids = output_ids[i]
            if ids is not None and len(ids):
                total += rec.on_tokens(list(ids), now)
            reason = recv.finished_reasons[i]
            if reason is None:
                continue
            live.pop(rid, None)
            rec.input_tokens = int(recv.prompt_tokens[i])
            rec.num_output_tokens = int(recv.completion_tokens[i])
            rec.cached_tokens = int(recv.cached_tokens[i])
            kind = reason.get("type") if isinstance(reason, dict) else None
            if kind == "abort":
                rec.error_type = "aborted"
                message = reason.get("message")
                if isinstance(message, str):
                    rec.error_message = message
            rec.finish_reason = kind if isinstance(kind, str) else None
            self.telemetry.finish(rec)
        if total:
            self.telemetry.on_tokens(total, now)
