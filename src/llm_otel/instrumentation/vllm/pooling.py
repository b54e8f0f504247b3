"""Pooling requests of vLLM (embeddings, classification, scoring, token-level encode): a request
span with input tokens, queue and prefill times, and the request-duration and input-token metrics;
no output tokens, no ``llm.token_stream``, no ``llm.logit_dist`` (a pooling model emits no tokens).

Engine fields read (vLLM 0.32, V1): a pooling ``EngineCoreRequest`` has ``pooling_params``
(``PoolingParams.task``: ``embed``, ``classify``, ``token_embed``, ``token_classify``, ``plugin``,
``embed&token_classify``; ``vllm/tasks.py``) and no ``sampling_params``; its one output
(``EngineCoreOutput.pooling_output``, with ``finish_reason``) ends the prefill. The OpenAI pooling
handlers (``vllm/entrypoints/pooling/*/serving.py``) share ``PoolingBaseServing.__call__``; the
class's ``request_id_prefix`` (``embd``, ``classify``, ``score``, ``pooling``) names the endpoint,
and ``_init_ctx`` returns the ``PoolingServeContext`` whose ``request_id`` is the response body's
``id``.

Operation names (``gen_ai.operation.name``): ``embeddings`` (the GenAI semantic conventions'
value) for ``embed``; llm-otel's own bounded values ``classify``, ``score`` (``LLM.score`` and
``/score``, ``/rerank``: the requests it issues, whatever the task) and ``encode`` (token-level
and plugin tasks).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind

from llm_otel.errors import guard
from llm_otel.instrumentation.vllm.fields import class_fields
from llm_otel.instrumentation.vllm.inbound import ENGINE_CARRIER, INBOUND, OPERATION
from llm_otel.instrumentation.vllm.requests import EngineState
from llm_otel.listeners import RequestFacts
from llm_otel.propagation import context_from_carrier
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import Telemetry

# PoolingParams.task -> gen_ai.operation.name
TASK_OPERATIONS = {
    "embed": "embeddings",
    "classify": "classify",
    "token_embed": "encode",
    "token_classify": "encode",
    "plugin": "encode",
    "embed&token_classify": "encode",
}
# the OpenAI pooling handler's request_id_prefix -> gen_ai.operation.name
HANDLER_OPERATIONS = {"embd": "embeddings", "classify": "classify", "score": "score", "pooling": "encode"}
POOLING_OPERATIONS = frozenset({"embeddings", "classify", "score", "encode"})


def handler_operation(instance: Any) -> str:
    """The operation of an OpenAI pooling handler (``PoolingBaseServing`` subclass) from its
    ``request_id_prefix``; ``encode`` for one we do not know."""
    return HANDLER_OPERATIONS.get(getattr(instance, "request_id_prefix", ""), "encode")


class PoolingRequests:
    """Mixin of :class:`~llm_otel.instrumentation.vllm.adapter.VLLMAdapter`: starts the records of
    pooling requests, and the wrapper that reads the OpenAI pooling handler's response id."""

    telemetry: Telemetry
    version: str

    def _start_pooling(self, state: EngineState, request: Any, prompt: str | None) -> None:
        """Start the record of the pooling ``EngineCoreRequest`` ``request`` (tracked in
        ``state.records``; it ends like any request when vLLM finishes it)."""
        rid = request.request_id
        task = getattr(request.pooling_params, "task", None)
        operation = OPERATION.get()
        if operation not in POOLING_OPERATIONS:
            operation = TASK_OPERATIONS.get(str(task), "encode")
        inbound = INBOUND.get()
        carrier = ENGINE_CARRIER.get() or (inbound.carrier if inbound is not None else None)
        if inbound is not None:
            inbound.started += 1
        response_id = inbound.response_id() if inbound is not None else None
        prompt_ids = request.prompt_token_ids
        rec = self.telemetry.start_request(
            rid,
            operation=operation,
            provider="vllm",
            model=state.model,
            kind=SpanKind.SERVER if inbound is not None else SpanKind.INTERNAL,
            parent=context_from_carrier(carrier) if carrier else None,
            arrival_s=float(request.arrival_time),
            input_tokens=len(prompt_ids) if prompt_ids is not None else 0,
            engine_version=self.version,
            request_attributes={
                A.GEN_AI_RESPONSE_ID: response_id or str(getattr(request, "external_req_id", None) or rid)
            },
            prompt_text=prompt,
            facts=RequestFacts(inbound.headers if inbound is not None else None, class_fields(request), state.kv),
        )
        rec.pooling = True
        rec.logprob_cap = 0
        rec.engine_clock = state.clock
        state.records[rid] = rec
        rec.on_handed()

    def pooling_context(self, hook: str):
        """``PoolingBaseServing._init_ctx``: the ``PoolingServeContext.request_id`` it returns is the
        response body's ``id`` (``embd-...``); kept on the HTTP request's :class:`.inbound.Inbound`."""

        async def wrapper(wrapped, instance, args, kwargs):
            ctx = await wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                inbound = INBOUND.get()
                rid = getattr(ctx, "request_id", None)
                if inbound is not None and isinstance(rid, str):
                    inbound.fixed_id = rid
            return ctx

        return wrapper
