"""LightLLM's P/D mode: the KV transfer between a prefill node and a decode node as one
``llm.kv_transfer`` span per request and side (core: :mod:`llm_otel.telemetry.kv_transfer`), and
the trace context from the PD master to both nodes.

Where things happen (ModelTC/lightllm main @ fc72ffab; PR #965 merged as 538487aab leaves these
files unchanged; v1.0.1 has the same steps in ``TransProcessObj`` of the kv-move-manager modules):

* PD master (``httpserver_for_pd_master/manager.py``, the same in v1.0.1 and PR #965's merge):
  ``HttpServerManagerForPDMaster.generate(prompt, sampling_params, multimodal_params, request)`` is
  the request's entry (the API handlers iterate it): it sets ``sampling_params.group_request_id``,
  picks the two nodes and iterates ``_wait_to_token_package`` -> ``fetch_stream(p_node, d_node,
  prompt, sampling_params, multimodal_params, request)``, which pickles ``(prompt, sampling_params,
  multimodal_params)`` to the prefill node over its websocket, waits for the decode node's
  ``UpKVStatus`` (KV received), then pickles the same objects to the decode node. On any exception
  ``generate`` calls ``abort(group_request_id)`` (ABORT to both nodes) and re-raises; a client that
  disconnects surfaces as the plain ``Exception("req_id ... disconnected")`` that ``fetch_stream``
  and ``_wait_to_token_package`` raise (the only plain ``Exception`` the class raises), or as the
  stream being closed / cancelled. :meth:`KVAdapter.pd_generate` starts the PD master's own request
  span there (SERVER; the client's ``traceparent`` its parent when valid, else a root through the
  provider's sampler) and ends it with the outcome; :meth:`KVAdapter.pd_master` puts that span's
  W3C context - sampled or not - on ``multimodal_params`` as the carrier (:mod:`.carrier`), where
  both nodes' ``generate(request=None)`` continue under it (:mod:`.httpserver`): one trace, one
  sampling decision, whether or not the client sent a ``traceparent``.
* prefill node, model-infer worker (``prefill_impl.py``
  ``prefill_req_frozen_tokens_and_put_to_kvmove_taskqueue``): builds ``KVMoveTask(group_request_id,
  input_tokens, prefill_token_indexes, ..., decode_node=DecodeNodeInfo(node_id, ip, rpyc_port, ...),
  prefill_node_id, ...)`` before the request is filtered out, and puts it on the kv-move manager's
  ``info_queue``. :meth:`KVAdapter.task` (at ``KVMoveTask.__post_init__``) adds this process's carrier of the request (registered
  when its ``MultimodalParams`` arrived) to the task: the dataclass is pickled with its
  ``__dict__`` to the kv-move manager (``mp.Queue``) and on to the decode node (rpyc ``obtain``).
* prefill node, kv-move manager process (``llm.process.role=kv_transfer``):
  ``KVTransConnectObj._transfer_kv(move_tasks)`` (``prefill_trans_obj.py``, one call per group of
  tasks to one decode node) hands the group to the NCCL transfer process and returns when it
  answered ``"ok"`` (``move_tasks`` is cleared then); an ``AssertionError`` (another answer) or
  ``queue.Empty`` (no answer in 60 s, ``error.type=timeout``) propagates to ``kv_trans_handle_loop``,
  which marks the connection failed and releases the tasks. ``move_task.move_kv_len`` is the number
  of tokens moved (the decode node's allocation: fewer than the prompt when it had a prefix cached).
* decode node, kv-move manager process: ``KVTransConnectObj._transfer_kv(move_tasks)``
  (``decode_trans_obj.py``) - the same, receiving; the tasks came from the prefill node through
  ``exposed_request_data_transfer`` (rpyc, ``obtain``), carrier included.

The decode node's request span does not exist yet when its KV arrives (the PD master sends the
request to the decode node only after the transfer), so both sides' spans are children of the
prefill node's request span (the carrier on the task): one trace, prefill request -> send, receive.
LightLLM's KV memory is token-indexed (``mem_manager`` token indexes, no blocks): tokens are
reported, blocks and bytes are not.
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

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
from llm_otel.propagation import (
    TRACEPARENT,
    TRACESTATE,
    carrier_from_span,
    context_from_carrier,
    extract_carrier,
    parse_traceparent,
)
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.kv_transfer import RECEIVE, SEND, KVTransfer

CONNECTOR = "lightllm-nccl"
"""``llm.kv_transfer.connector`` of LightLLM's P/D mode in these layouts: ``pd_mode`` moves KV
between nodes with NCCL (its ``*_trans_process``); bounded, never client input."""


_MASTER_KEY = otel_context.create_key("llm_otel.lightllm.pd_master_request")


class _MasterRequest:
    """One ``HttpServerManagerForPDMaster.generate`` call: its span and what its stream showed."""

    __slots__ = ("span", "context", "arrival_s", "first_s", "input_tokens", "outputs", "reasons", "aborted", "gid")

    def __init__(self, span: Span, parent: Context, arrival_s: float) -> None:
        self.span = span
        self.context: Context = otel_context.set_value(_MASTER_KEY, self, Telemetry.context_of(span, parent))
        self.arrival_s = arrival_s
        self.first_s: float | None = None
        self.input_tokens: int | None = None
        self.outputs = 0  # items the PD master yielded: one token of one choice each
        self.reasons: list[str] = []
        self.aborted = False
        self.gid: int | None = None


def _int(value: Any) -> int | None:
    out = request_id(value)  # any integer type (numpy included), not bool
    return out if out is not None and out >= 0 else None


class KVAdapter:
    """Wrapper factories ``kv.*`` for the P/D hooks in :mod:`.hooks`."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.version = engine_version()
        self.live = 0  # PD master requests in flight (their spans not ended yet), capped at MAX_LIVE

    # --- PD master -------------------------------------------------------------------------------
    def pd_generate(self, hook: str):
        """``HttpServerManagerForPDMaster.generate(prompt, sampling_params, multimodal_params,
        request)`` (an async generator of ``(sub_req_id, text, metadata, finish_status)``): the PD
        master's request span, ``{operation} {model}`` (``chat`` when ``request.url.path`` has
        "chat", else ``text_completion``; model from the master's ``self.args``), SERVER with a
        ``request`` (INTERNAL without), a child of the client's W3C context in ``request.headers``
        when valid, else of the current context (a root: the provider's sampler decides); the
        sampling parameters as on the HTTP workers' spans. Ended when the stream ends: input tokens
        (``metadata["prompt_tokens"]`` of the first item: the prefill node's), output tokens (items yielded), finish reasons
        (``finish_status``), time to first item, ``llm.request.id`` (the group id ``fetch_stream``
        saw) and ``error.type``: ``aborted`` for a closed or cancelled stream, a finish status that
        says aborted, or the plain ``Exception`` LightLLM raises for a disconnected client; else the
        exception's class (``ServerBusyError`` when the KV move timed out, v1.0.1 ``AssertionError``).
        LightLLM's items and exceptions pass through unchanged."""

        def wrapper(wrapped, instance, args, kwargs):
            bound = None
            with guard(hook, self.telemetry.errors):
                if self.live < MAX_LIVE:
                    bound = bind(wrapped, args, kwargs)
            agen = wrapped(*args, **kwargs)
            if bound is None:
                return agen
            # the span starts when the stream does (LightLLM's handlers iterate at once): a stream
            # never iterated has nothing to end
            return self._master_traced(hook, instance, bound, agen)

        return wrapper

    def _master_begin(self, instance, bound: dict) -> _MasterRequest:
        request = bound.get("request")
        kind = SpanKind.INTERNAL
        operation = "text_completion"
        inbound = None
        if request is not None:
            kind = SpanKind.SERVER
            inbound = context_from_carrier(extract_carrier(getattr(request, "headers", None) or {}))
            if "chat" in str(getattr(getattr(request, "url", None), "path", "") or ""):
                operation = "chat"
        parent = inbound if inbound is not None else otel_context.get_current()
        arrival_s = time.time()
        span = self.telemetry.start_forwarded(
            operation=operation,
            provider=PROVIDER,
            model=model_name(args=getattr(instance, "args", None)),
            arrival_s=arrival_s,
            kind=kind,
            parent=parent,
            engine_version=self.version,
            request_attributes=sampling_attributes(bound.get("sampling_params")),
        )
        self.live += 1
        return _MasterRequest(span, parent, arrival_s)

    async def _master_traced(self, hook: str, instance, bound: dict, agen):
        state = None
        with guard(hook, self.telemetry.errors):
            state = self._master_begin(instance, bound)
        if state is None:
            try:
                async for item in agen:
                    yield item
            finally:
                await agen.aclose()
            return
        error: str | None = None
        first = True
        try:
            while True:
                # generate() calls fetch_stream once, before its first item (the real source: via
                # _wait_to_token_package), under the master span's context; later items need none
                token = otel_context.attach(state.context) if first else None
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    if token is not None:
                        otel_context.detach(token)
                first = False
                try:  # per token: inline, not errors.guard
                    self._master_item(state, item)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
                yield item
        except GeneratorExit:  # the consumer closed the stream: the client went away
            error = "aborted"
            await agen.aclose()
            raise
        except BaseException as exc:
            # a disconnected client: LightLLM raises a plain Exception (fetch_stream,
            # _wait_to_token_package), or the handler's task is cancelled
            aborted = isinstance(exc, asyncio.CancelledError) or type(exc) is Exception
            error = "aborted" if aborted else type(exc).__qualname__
            raise
        finally:
            with guard(hook, self.telemetry.errors):
                self._master_end(state, error)

    def _master_item(self, state: _MasterRequest, item) -> None:
        _sub_id, _text, metadata, finish_status = item
        if state.first_s is None:
            state.first_s = time.time()
        state.outputs += 1
        if state.input_tokens is None and isinstance(metadata, dict):
            # the prefill node's count: the decode node's prompt is the prompt ids plus the first token
            prompt = metadata.get("prompt_tokens")
            if isinstance(prompt, int) and not isinstance(prompt, bool):
                state.input_tokens = prompt
        finished, aborted, reason = finish_info(finish_status)
        if finished:
            if aborted:
                state.aborted = True
            elif reason and len(state.reasons) < C.MAX_BEST_OF:
                state.reasons.append(reason)

    def _master_end(self, state: _MasterRequest, error: str | None) -> None:
        self.live = max(0, self.live - 1)
        if error is None and state.aborted:
            error = "aborted"
        self.telemetry.end_forwarded(
            state.span,
            request_id=str(state.gid) if state.gid is not None else None,
            input_tokens=state.input_tokens,
            output_tokens=state.outputs,
            finish_reasons=state.reasons,
            time_to_first_token_s=None if state.first_s is None else state.first_s - state.arrival_s,
            error_type=error,
        )
        state.context = Context()  # nothing of the request stays reachable through the state

    def pd_master(self, hook: str):
        """``HttpServerManagerForPDMaster.fetch_stream(p_node, d_node, prompt, sampling_params,
        multimodal_params, request)``: the W3C context of the PD master's request span
        (:meth:`pd_generate`, the current one when ``fetch_stream`` is called; sampled or not) and
        ``sampling_params.group_request_id`` go on ``multimodal_params`` as the carrier before it is
        pickled to the prefill and decode nodes, whose request spans are then its children and
        follow its sampling decision. Without a span of the master's (``generate`` not traced: past
        the cap, a provider without spans) the client's ``traceparent``/``tracestate``
        (``request.headers``) go instead when valid, else nothing."""

        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                bound = bind(wrapped, args, kwargs)
                mm = bound.get("multimodal_params")
                request = bound.get("request")
                gid = _int(getattr(bound.get("sampling_params"), "group_request_id", None))
                if mm is not None and gid is not None and not C.valid(getattr(mm, C.CARRIER_ATTR, None)):
                    state = otel_context.get_value(_MASTER_KEY)
                    inbound: dict[str, str] = {}
                    if isinstance(state, _MasterRequest):
                        state.gid = gid
                        inbound = carrier_from_span(state.span)
                    if not inbound and request is not None:
                        inbound = extract_carrier(getattr(request, "headers", None) or {}) or {}
                    tp = inbound.get(TRACEPARENT)
                    if isinstance(tp, str) and parse_traceparent(tp) is not None:
                        value: dict[str, Any] = {TRACEPARENT: tp, C.GROUP_KEY: gid, C.CHOICES_KEY: []}
                        if inbound.get(TRACESTATE):
                            value[TRACESTATE] = inbound[TRACESTATE]
                        setattr(mm, C.CARRIER_ATTR, value)
            return wrapped(*args, **kwargs)

        return wrapper

    def task(self, hook: str):
        """``KVMoveTask.__post_init__`` (prefill node's model-infer worker; the dataclass's
        ``__init__`` calls it with every field set): the carrier of
        ``group_request_id`` registered in this process goes on the task as ``_llm_otel_carrier``."""

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                gid = _int(getattr(instance, "group_request_id", None))
                carrier = C.TABLE.get(gid) if gid is not None else None
                if C.valid(carrier):
                    setattr(instance, C.CARRIER_ATTR, carrier)
            return result

        return wrapper

    def send(self, hook: str):
        """``KVTransConnectObj._transfer_kv(move_tasks)`` on the prefill node (v1.0.1:
        ``TransProcessObj._transfer_kv``): one send span per task."""
        return self._transfer(hook, SEND, "prefill")

    def receive(self, hook: str):
        """The same on the decode node: one receive span per task."""
        return self._transfer(hook, RECEIVE, "decode")

    def _transfer(self, hook: str, direction: str, role: str):
        def wrapper(wrapped, instance, args, kwargs):
            tasks: list = []
            start = time.time_ns()
            with guard(hook, self.telemetry.errors):
                # LightLLM clears the list once the transfer succeeded: keep the tasks
                tasks = list(bind(wrapped, args, kwargs).get("move_tasks") or ())
            error: str | None = None
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                error = "timeout" if isinstance(exc, queue.Empty) else type(exc).__qualname__
                raise
            finally:
                if tasks:
                    end = time.time_ns()
                    with guard(hook, self.telemetry.errors):
                        for task in tasks:
                            self._record(task, direction, role, start, end, error)

        return wrapper

    def _record(self, task, direction: str, role: str, start: int, end: int, error: str | None) -> None:
        gid = _int(getattr(task, "group_request_id", None))
        parent = None
        carrier = getattr(task, C.CARRIER_ATTR, None)
        if gid is not None and C.valid(carrier):
            ctx, _sampled = C.parent_for(carrier, gid)
            parent = ctx  # the core reads the context's current span
        if direction == SEND:
            node = getattr(getattr(task, "decode_node", None), "node_id", None)
        else:
            node = getattr(task, "prefill_node_id", None)
        self.telemetry.kv_transfers.record(
            KVTransfer(
                connector=CONNECTOR,
                direction=direction,
                start_ns=start,
                end_ns=end,
                request_id=str(gid) if gid is not None else None,
                parent=parent,
                tokens=_int(getattr(task, "move_kv_len", None)),
                remote_engine=str(node) if node is not None else None,
                asynchronous=True,
                role=role,
                error_type=error,
            )
        )
