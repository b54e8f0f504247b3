"""Reads LightLLM's own objects in each of its processes and calls the telemetry core: one
sub-adapter per LightLLM process kind, each in its own module.

* HTTP worker (:mod:`.httpserver`, ``HttpServerManager``): one request span per choice, built by the core
  from a :class:`~llm_otel.telemetry.RequestRecord`, and the trace carrier on the request's
  ``MultimodalParams``.
* router (:mod:`.router`, ``RouterManager``, request queues, ``Batch``): ``llm.router.request`` per
  sub-request and ``llm.engine.step`` per router-driven step (the core's step API).
* model-infer worker (:mod:`.worker`, ``InferenceContext``, ``InferReq``; master rank of its DP
  group only): ``llm.infer.request`` per sub-request and ``llm.logit_dist`` from the logits around
  LightLLM's sampler (:mod:`llm_otel.telemetry.logit_capture`).
* P/D mode (:mod:`.kv`, PD master, ``KVMoveTask``, the kv-move managers' ``_transfer_kv``): the
  carrier from the PD master to both nodes and ``llm.kv_transfer`` per request and side.

Router and worker spans are children of the request span of their choice, found through the
carrier (:mod:`.carrier`); both are built by the core (:mod:`llm_otel.telemetry.stages`) from one
:class:`~llm_otel.telemetry.stages.StageRecord` per sub-request that the adapter fills and hands to
``Telemetry.end_stage`` (:func:`.requests.end_stage`). What all three read alike (request ids,
``FinishStatus``, bound arguments, the served model) is in :mod:`.requests`. The adapter calls no
tracer or meter; each module lists the engine fields it reads.

Every wrapper calls LightLLM exactly as it was called and returns its result untouched; our own
failures are counted in ``llm_otel.instrumentation.errors`` and never reach LightLLM.
"""

from __future__ import annotations

from llm_otel.instrumentation.lightllm.httpserver import HttpAdapter
from llm_otel.instrumentation.lightllm.kv import KVAdapter
from llm_otel.instrumentation.lightllm.router import RouterAdapter
from llm_otel.instrumentation.lightllm.worker import WorkerAdapter
from llm_otel.telemetry import Telemetry

__all__ = ["LightLLMAdapter", "HttpAdapter", "KVAdapter", "RouterAdapter", "WorkerAdapter"]


class LightLLMAdapter:
    """Wrapper factories for the hooks in :mod:`.hooks`, one sub-adapter per LightLLM process kind
    (factory names ``http.*``, ``router.*``, ``worker.*``; ``kv.*`` for P/D mode)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.http = HttpAdapter(telemetry)
        self.router = RouterAdapter(telemetry)
        self.worker = WorkerAdapter(telemetry)
        self.kv = KVAdapter(telemetry)
