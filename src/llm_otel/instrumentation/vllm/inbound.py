"""Where a vLLM frontend request comes from, carried in context variables from the entry point
that received it to ``OutputProcessor.add_request``, which starts its span: the operation of the
``LLM`` entry point (``chat`` inside ``LLM.chat``), the OpenAI server's HTTP request (its trace
headers and headers for the request classes, and whether any engine request was started for it),
and trace headers handed to ``LLMEngine`` / ``AsyncLLM.add_request`` directly.
"""

from __future__ import annotations

import contextvars
import inspect
import time
from typing import Any

from llm_otel.errors import guard
from llm_otel.instrumentation.vllm.edge import EXCHANGE
from llm_otel.instrumentation.vllm.kv_transfer import trace_context_of
from llm_otel.propagation import extract_carrier

# Operation of the LLM entry point on this thread/task ("chat" inside LLM.chat).
OPERATION: contextvars.ContextVar[str | None] = contextvars.ContextVar("llm_otel_vllm_operation", default=None)
# The HTTP request this task serves (OpenAI server), and trace headers given to AsyncLLM directly.
INBOUND: contextvars.ContextVar[Inbound | None] = contextvars.ContextVar("llm_otel_vllm_inbound", default=None)
ENGINE_CARRIER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("llm_otel_vllm_carrier", default=None)


class Inbound:
    """One HTTP request seen by an OpenAI handler: its valid trace headers, and whether any engine
    request was started for it (if none was and the handler failed, it was rejected)."""

    __slots__ = ("carrier", "operation", "started", "rejected", "headers", "raw", "fixed_id", "models")

    def __init__(
        self, carrier: dict | None, operation: str, headers: Any = None, raw: Any = None, models: Any = None
    ) -> None:
        self.carrier = carrier
        self.operation = operation
        self.started = 0
        self.rejected = False  # the handler hook recorded this request's refusal
        self.headers = headers  # the inbound request's headers, for request classes (llm_otel.signals)
        self.raw = raw  # the handler's raw_request (starlette Request), for the response id
        self.fixed_id: str | None = None  # the response id where the handler tells it otherwise (pooling)
        self.models = models  # the handler's OpenAIServingModels: the names a refusal may carry (edge.py)

    def response_id(self) -> str | None:
        """The ``id`` of the response body the client gets (``cmpl-...``, ``chatcmpl-...``,
        ``embd-...``): vLLM's handler stores it as ``raw_request.state.request_metadata.request_id``
        (``RequestResponseMetadata``, vLLM 0.32 ``entrypoints/openai/*/serving.py``) before it adds
        the engine request; the pooling handlers' :attr:`fixed_id`; None before that or without
        a raw request."""
        if self.fixed_id is not None:
            return self.fixed_id
        meta = getattr(getattr(self.raw, "state", None), "request_metadata", None)
        rid = getattr(meta, "request_id", None)
        return rid if isinstance(rid, str) else None


async def in_context(stream, inbound: Inbound, operation: str):
    """Iterate ``stream`` with this request's inbound context set; closing us closes it (vLLM
    aborts the request when its generator is closed by a client disconnect)."""
    INBOUND.set(inbound)
    OPERATION.set(operation)
    try:
        async for item in stream:
            yield item
    finally:
        await stream.aclose()


def traced_handler(errors, hook: str, rejected, operation_of=None):
    """Wrapper of an OpenAI completions/chat handler ``(request, raw_request)``: the HTTP request's
    trace headers and headers become the task's :data:`INBOUND` (SERVER-kind request spans under
    them); a request the handler refuses before any engine request started (an exception, or an
    ``ErrorResponse`` with ``error.type`` / ``.message``) goes to ``rejected(hook, args, kwargs,
    inbound, arrival_s, error_type, message)``. ``operation_of(handler instance)`` names the
    operation (pooling handlers); else ``chat`` or ``text_completion`` from the hook's name. The
    HTTP edge's :class:`.edge.Exchange` learns of the handler's :class:`Inbound`, so a request the
    handler traced is not traced again there."""
    default = "chat" if "chat" in hook.rsplit(".", 1)[-1] else "text_completion"

    async def wrapper(wrapped, instance, args, kwargs):
        arrival = time.time()
        inbound = None
        operation = default
        with guard(hook, errors):
            if operation_of is not None:
                operation = operation_of(instance)
            raw = kwargs.get("raw_request", args[1] if len(args) > 1 else None)
            carrier = extract_carrier(raw.headers) if raw is not None else None
            if carrier is None:  # a decode hop whose proxy forwarded no traceparent: the prefill's context
                carrier = trace_context_of(args[0] if args else kwargs.get("request"))
            inbound = Inbound(
                carrier,
                operation,
                raw.headers if raw is not None else None,
                raw,
                getattr(instance, "models", None),
            )
            exchange = EXCHANGE.get()
            if exchange is not None:
                exchange.inbound = inbound
            INBOUND.set(inbound)  # the request's task (and the streaming tasks it starts) see it
            OPERATION.set(operation)
        try:
            result = await wrapped(*args, **kwargs)
        except Exception as error:
            if inbound is not None and not inbound.started:
                inbound.rejected = True
                rejected(hook, args, kwargs, inbound, arrival, type(error).__qualname__, str(error))
            raise
        if inbound is not None and not inbound.started:
            err = getattr(result, "error", None)
            if err is not None and hasattr(err, "message"):
                inbound.rejected = True
                rejected(
                    hook, args, kwargs, inbound, arrival, str(getattr(err, "type", None) or "error"), str(err.message)
                )
        if inbound is not None and inspect.isasyncgen(result):
            # vLLM runs the handler in a task of its own (with_cancellation) and the response
            # iterates the stream from another: carry the request's context into that one.
            return in_context(result, inbound, operation)
        return result

    return wrapper
