"""LightLLM's P/D mode: the KV transfer between a prefill node and a decode node as one
``llm.kv_transfer`` span per request and side (core: :mod:`llm_otel.telemetry.kv_transfer`), and
the trace context from the PD master to both nodes.

Where things happen (ModelTC/lightllm main @ fc72ffab; PR #965 merged as 538487aab leaves these
files unchanged; v1.0.1 has the same steps in ``TransProcessObj`` of the kv-move-manager modules):

* PD master (``httpserver_for_pd_master/manager.py``): ``fetch_stream(p_node, d_node, prompt,
  sampling_params, multimodal_params, request)`` pickles ``(prompt, sampling_params,
  multimodal_params)`` to the prefill node over its websocket, waits for the decode node's
  ``UpKVStatus`` (KV received), then pickles the same objects to the decode node. No HTTP header
  reaches either node: :meth:`KVAdapter.pd_master` puts the client's W3C context on
  ``multimodal_params`` as the carrier (:mod:`.carrier`), where both nodes' ``generate(request=None)``
  already continue under it (:mod:`.httpserver`).
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

import queue
import time
from typing import Any

from llm_otel.errors import guard
from llm_otel.instrumentation.lightllm import carrier as C
from llm_otel.instrumentation.lightllm.requests import bind, request_id
from llm_otel.propagation import TRACEPARENT, TRACESTATE, extract_carrier, parse_traceparent
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.kv_transfer import RECEIVE, SEND, KVTransfer

CONNECTOR = "lightllm-nccl"
"""``llm.kv_transfer.connector`` of LightLLM's P/D mode in these layouts: ``pd_mode`` moves KV
between nodes with NCCL (its ``*_trans_process``); bounded, never client input."""


def _int(value: Any) -> int | None:
    out = request_id(value)  # any integer type (numpy included), not bool
    return out if out is not None and out >= 0 else None


class KVAdapter:
    """Wrapper factories ``kv.*`` for the P/D hooks in :mod:`.hooks`."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def pd_master(self, hook: str):
        """``HttpServerManagerForPDMaster.fetch_stream(p_node, d_node, prompt, sampling_params,
        multimodal_params, request)``: the client's ``traceparent``/``tracestate`` (``request.headers``)
        and ``sampling_params.group_request_id`` go on ``multimodal_params`` as the carrier before
        it is pickled to the prefill and decode nodes. Without an inbound context nothing is set
        (each node's request span then starts its own trace)."""

        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                bound = bind(wrapped, args, kwargs)
                mm = bound.get("multimodal_params")
                request = bound.get("request")
                gid = _int(getattr(bound.get("sampling_params"), "group_request_id", None))
                if (
                    mm is not None
                    and request is not None
                    and gid is not None
                    and not C.valid(getattr(mm, C.CARRIER_ATTR, None))
                ):
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
