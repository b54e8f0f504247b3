"""Every tritonclient function the Triton client instrumentation wraps (tritonclient 2.x layout).

Signatures are read at call time with ``inspect.signature`` so keyword/positional use and small
signature changes between 2.x releases do not matter; a target missing from the installed
tritonclient is skipped with one warning (see :func:`llm_otel.instrumentation._hooks.apply_hooks`).
"""

from __future__ import annotations

from llm_otel.instrumentation._hooks import Hook

_L = "tritonclient 2.x"
HTTP = "tritonclient.http._client"
HTTP_AIO = "tritonclient.http.aio"
GRPC = "tritonclient.grpc._client"
GRPC_STREAM = "tritonclient.grpc._infer_stream"
GRPC_AIO = "tritonclient.grpc.aio"

HOOKS: list[Hook] = [
    Hook(HTTP, "InferenceServerClient.infer", "sync_call", _L, "CLIENT span, headers copy + traceparent"),
    Hook(
        HTTP,
        "InferenceServerClient.async_infer",
        "handle_call",
        _L,
        "span started and headers injected in the caller (the send runs in a gevent greenlet)",
    ),
    Hook(HTTP, "InferAsyncRequest.get_result", "handle_result", _L, "ends the async_infer span"),
    Hook(HTTP_AIO, "InferenceServerClient.infer", "aio_call", _L, "CLIENT span around the coroutine"),
    Hook(GRPC, "InferenceServerClient.__init__", "remember_url", _L, "server.address/port of gRPC clients"),
    Hook(GRPC, "InferenceServerClient.infer", "sync_call", _L, "CLIENT span, metadata copy + traceparent"),
    Hook(
        GRPC,
        "InferenceServerClient.async_infer",
        "callback_call",
        _L,
        "span ended by the wrapped callback on the gRPC thread",
    ),
    Hook(
        GRPC,
        "InferenceServerClient.start_stream",
        "stream_start",
        _L,
        "llm.triton.stream span; its traceparent is the stream's metadata",
    ),
    Hook(
        GRPC,
        "InferenceServerClient.async_stream_infer",
        "stream_request",
        _L,
        "one CLIENT span per request on the stream",
    ),
    Hook(GRPC, "InferenceServerClient.stop_stream", "stream_stop", _L, "ends the stream span and requests still open"),
    Hook(
        GRPC_STREAM,
        "_InferStream._init_handler",
        "stream_peek",
        _L,
        "raw stream responses (request id and final flag of error responses)",
    ),
    Hook(GRPC_AIO, "InferenceServerClient.__init__", "remember_url", _L, "server.address/port of gRPC aio clients"),
    Hook(GRPC_AIO, "InferenceServerClient.infer", "aio_call", _L, "CLIENT span around the coroutine"),
    Hook(
        GRPC_AIO,
        "InferenceServerClient.stream_infer",
        "aio_stream",
        _L,
        "stream span; one CLIENT span per item of the request iterator",
    ),
]
