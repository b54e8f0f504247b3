"""Trace context across LightLLM's processes on the per-request ``MultimodalParams`` object.

LightLLM's ``Req`` and ``SamplingParams`` are fixed ctypes layouts in shared memory; the one
per-request Python object that every hop pickles by value is ``MultimodalParams``
(``lightllm/server/multimodal_params.py``; created for text-only requests too): inside
``GroupReqIndexes`` HTTP -> (visual ->) router -> detokenization, inside the
``Req.to_router_rpc_obj()`` tuples router -> model-infer worker, and in P/D and multinode
forwarding (ModelTC/lightllm main @ fc72ffab). The HTTP worker sets one instance attribute on it::

    multimodal_params._llm_otel_carrier = {
        "traceparent": "00-<trace>-<span of choice 0>-01", "tracestate": "...",   # if any
        "group_req_id": 1024,                               # LightLLM group request id
        "choices": ["00-<trace>-<span of choice i>-01", ...],  # one per sub-request (n > 1)
        "logit_top_k": 5,                                   # only for requests chosen for llm.logit_dist
    }

The class has no ``__setstate__``; the one llm-otel adds registers the carrier in a bounded
per-process :class:`CarrierTable` keyed by group request id whenever the object is unpickled
("this request has arrived in this process"), and otherwise restores the state exactly as the
default unpickling would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, TypeGuard

from opentelemetry.context import Context

from llm_otel.propagation import TRACEPARENT, TRACESTATE, context_from_carrier, parse_traceparent

CARRIER_ATTR = "_llm_otel_carrier"
GROUP_KEY = "group_req_id"
CHOICES_KEY = "choices"
TOPK_KEY = "logit_top_k"  # present: the worker computes llm.logit_dist with this k
MAX_BEST_OF = 8  # lightllm ReqIDGenerator: group ids step by 8, sub-request i = group id + i


def group_of(request_id: int) -> int:
    """LightLLM group request id of a sub-request id (``convert_sub_id_to_group_id``)."""
    return (request_id // MAX_BEST_OF) * MAX_BEST_OF


class CarrierTable:
    """Carriers that arrived in this process, by group request id; oldest dropped past ``cap``."""

    def __init__(self, cap: int = 65536) -> None:
        self._items: OrderedDict[int, dict] = OrderedDict()
        self._lock = threading.Lock()
        self.cap = cap

    def put(self, group_req_id: int, carrier: dict) -> None:
        with self._lock:
            self._items[group_req_id] = carrier
            self._items.move_to_end(group_req_id)
            while len(self._items) > self.cap:
                self._items.popitem(last=False)

    def get(self, group_req_id: int) -> dict | None:
        return self._items.get(group_req_id)

    def pop(self, group_req_id: int) -> None:
        with self._lock:
            self._items.pop(group_req_id, None)

    def __len__(self) -> int:
        return len(self._items)


TABLE = CarrierTable()


def valid(carrier: Any) -> TypeGuard[dict[str, Any]]:
    return (
        isinstance(carrier, dict)
        and isinstance(carrier.get(GROUP_KEY), int)
        and isinstance(carrier.get(TRACEPARENT), str)
    )


def make_setstate(original=None):
    """A ``MultimodalParams.__setstate__`` that restores the pickled state (like the default, or by
    calling ``original`` if the class had one) and registers the carrier it finds in :data:`TABLE`."""

    def __setstate__(self, state):
        if original is not None:
            original(self, state)
        elif isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            if state[0]:
                self.__dict__.update(state[0])
            for key, value in (state[1] or {}).items():
                setattr(self, key, value)
        elif state:
            self.__dict__.update(state)
        try:
            carrier = getattr(self, CARRIER_ATTR, None)
            if valid(carrier):
                TABLE.put(carrier[GROUP_KEY], carrier)
        except Exception:  # noqa: BLE001 - silent: never break LightLLM's unpickling
            pass

    __setstate__.__llm_otel__ = True
    return __setstate__


def carrier_for(multimodal_params: Any, group_req_id: int) -> dict | None:
    """The carrier of a request in this process: on the object when it is at hand, else from the table."""
    carrier = getattr(multimodal_params, CARRIER_ATTR, None) if multimodal_params is not None else None
    if not valid(carrier):
        carrier = TABLE.get(group_req_id)
    return carrier if valid(carrier) else None


def parent_for(carrier: dict, request_id: int) -> tuple[Context | None, bool]:
    """(parent context, sampled) for sub-request ``request_id``: the span of its own choice."""
    choices = carrier.get(CHOICES_KEY) or ()
    index = request_id - carrier[GROUP_KEY]
    tp = choices[index] if 0 <= index < len(choices) and isinstance(choices[index], str) else carrier[TRACEPARENT]
    sub = {TRACEPARENT: tp}
    if carrier.get(TRACESTATE):
        sub[TRACESTATE] = carrier[TRACESTATE]
    sc = parse_traceparent(tp)
    return context_from_carrier(sub), bool(sc is not None and sc.trace_flags.sampled)
