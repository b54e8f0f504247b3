"""tritonclient's gRPC streams: which request each response belongs to, and how a stream and the
requests still open on it end.

A stream is the core's :class:`~llm_otel.telemetry.client.ClientStream` (its span, the requests in
flight by id) plus what tritonclient adds: the raw response behind the callback it is calling now
(tritonclient drops the request id of error responses; the response iterators are wrapped to see
each raw response first), how the stream ended (a gRPC status, ``stop_stream(cancel_requests=True)``,
``cancel()``, the grpc.aio response iterator exhausted, failed or dropped). Spans and metrics are
the core's (:class:`~llm_otel.telemetry.client.ClientCalls`).

Fields read (tritonclient 2.x): ``_InferStream._init_handler(responses)`` iterates raw gRPC
``ModelStreamInferResponse`` (``error_message``, ``infer_response``); the grpc.aio ``stream_infer``
iterator's ``_grpc_call``; ``InferResult.get_response()`` (``id``, ``outputs``, ``parameters``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

import wrapt

from llm_otel.errors import guard
from llm_otel.instrumentation.triton.parsing import Cancelled, error_type, is_final, response_problem
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.telemetry.client import ClientCalls, ClientStream


class StreamState:
    """One gRPC stream: its core record (span, requests in flight), the client kind and server, the
    raw response tritonclient is handing to the callback right now (stream thread only), and how
    it ended."""

    def __init__(self, stream: ClientStream, client: str, server_attrs: dict) -> None:
        self.stream = stream
        self.client = client
        self.server_attrs = server_attrs
        self.last_raw: Any = None
        self.error: BaseException | None = None
        self.cancelling = False  # stop_stream(cancel_requests=True) is running


class Streams:
    """The gRPC streams of one adapter: ``calls`` are its client calls; ``finish(call, error=,
    end_reason=, end_mono=)`` ends a call with what tritonclient handed back (the adapter's error
    naming); failures are counted on ``errors``."""

    def __init__(self, calls: ClientCalls, finish: Callable[..., None], errors: Any) -> None:
        self.calls = calls
        self.finish = finish
        self.errors = errors

    def open(self, flavour: str, server: dict) -> StreamState:
        """A stream's span now, in the current context (``flavour``: the client kind)."""
        stream = self.calls.start_stream(S.LLM_TRITON_STREAM, {A.LLM_TRITON_CLIENT: flavour, **server})
        return StreamState(stream, flavour, server)

    def observe(self, state: StreamState, result: Any, error: Any) -> None:
        """One stream response ``(result, error)`` as tritonclient hands it to the callback (stream
        thread / event loop): attributed to its request by the id the server echoes (the raw
        response's, for an error response whose result tritonclient drops); an error without a
        response is the stream's own end, which ends every request on it."""
        now = time.monotonic()
        raw = state.last_raw
        state.last_raw = None
        if result is not None:
            response = result.get_response()
        elif raw is not None and getattr(raw, "error_message", None):
            response = raw.infer_response
        else:
            # the stream itself ended with a gRPC status: every request on it ends with it
            if state.cancelling:
                for ended in state.stream.drain():
                    self.finish(
                        ended,
                        error=Cancelled("stream stopped with cancel_requests=True"),
                        end_reason="cancelled",
                        end_mono=now,
                    )
                return
            state.error = error
            for ended in state.stream.drain():
                self.finish(ended, error=error, end_mono=now)
            return
        call = state.stream.lookup(response.id)
        if call is None:
            return
        final = is_final(response)
        if error is not None:
            self.finish(call, error=error, end_reason="error", end_mono=now)
            return
        empty = len(response.outputs) == 0
        if not empty:
            call.on_response(now)
            if call.problem is None:
                call.problem = response_problem(response, call.expected, streaming=True)
        if final:
            self.finish(call, end_reason="empty_final" if empty else "final_flag", end_mono=now)

    def close(self, state: StreamState, cancelled: bool = False, error: BaseException | None = None) -> None:
        """The stream ended (once; later calls do nothing): its open requests end - cancelled, or
        at their last response - and then the stream span."""
        if state.stream.closed:
            return
        state.stream.closed = True
        # a cancelled stream's gRPC CANCELLED status is the application's choice, not a failure
        error = error or (None if cancelled else state.error)
        for call in state.stream.drain():
            if cancelled:
                self.finish(call, error=Cancelled("stream stopped with cancel_requests=True"), end_reason="cancelled")
            else:
                # no final flag came: the request ended with its last response
                end = call.times[-1] if call.times else None
                self.finish(call, error=error, end_reason="stream_end", end_mono=end)
        self.calls.end_stream(
            state.stream,
            {A.LLM_TRITON_STREAM_REQUESTS: state.stream.requests},
            error_type=None if error is None else error_type(error),
            cancelled=cancelled,
        )

    def abandon(self, state: StreamState) -> None:
        """Finalizer of a grpc.aio response iterator collected before its stream ended: each open
        request ends as ``abandoned``, the stream as cancelled."""
        if state.stream.closed:
            return
        with guard("triton.aio_stream_abandoned", self.errors):  # runs from the garbage collector
            state.stream.closed = True
            now = time.monotonic()
            for call in state.stream.drain():
                self.finish(
                    call, error=Cancelled("the response iterator was dropped"), end_reason="abandoned", end_mono=now
                )
            self.calls.end_stream(state.stream, {A.LLM_TRITON_STREAM_REQUESTS: state.stream.requests}, cancelled=True)


class PeekIterator(wrapt.ObjectProxy):
    """The gRPC response iterator of a sync stream, remembering each raw response for the callback."""

    def __init__(self, iterator, state: StreamState) -> None:
        super().__init__(iterator)
        self._self_state = state

    def __iter__(self):
        return self

    def __next__(self):
        self._self_state.last_raw = None
        raw = next(self.__wrapped__)
        self._self_state.last_raw = raw
        return raw


class PeekAioCall(wrapt.ObjectProxy):
    """The grpc.aio stream call, remembering each raw response for :class:`AioResponses`."""

    def __init__(self, call, state: StreamState) -> None:
        super().__init__(call)
        self._self_state = state

    def __aiter__(self):
        return PeekAioIterator(self.__wrapped__.__aiter__(), self._self_state)


class PeekAioIterator:
    def __init__(self, iterator, state: StreamState) -> None:
        self._iterator = iterator
        self._state = state

    def __aiter__(self):
        return self

    async def __anext__(self):
        self._state.last_raw = None
        raw = await self._iterator.__anext__()
        self._state.last_raw = raw
        return raw


class AioResponses(wrapt.ObjectProxy):
    """tritonclient.grpc.aio's response iterator: yields the same ``(result, error)`` pairs, and
    attributes each to its request; the stream span ends when the iteration ends.

    How it ends: exhausted -> each open request ends with the stream (``stream_end``); a gRPC error
    (a deadline cutting the stream short, the server going away) -> error spans with the gRPC code;
    ``cancel()`` or the consuming task being cancelled -> ``error.type=cancelled`` without an error
    status; abandoned (``break`` out of ``async for``, the iterator dropped) -> when it is
    collected, each open request ends as ``abandoned`` (a weakref callback: it holds the state, not the
    iterator).
    """

    def __init__(self, responses, streams: Streams, state: StreamState) -> None:
        super().__init__(responses)
        self._self_streams = streams
        self._self_state = state
        # a weakref callback, not weakref.finalize: the first finalize() registers weakref's atexit
        # hook, which must not come before multiprocessing's (see export/providers.py)
        _ABANDONED[weakref.ref(self, _collected)] = (streams, state)

    def __aiter__(self):
        return self

    def cancel(self):
        """tritonclient's ``cancel()`` (cancels the gRPC call); the open requests and the stream
        end now, as cancelled."""
        state = self._self_state
        state.cancelling = True
        try:
            return self.__wrapped__.cancel()
        finally:
            with guard("triton.aio_stream", self._self_streams.errors):
                self._self_streams.close(state, cancelled=True)

    async def __anext__(self):
        streams, state = self._self_streams, self._self_state
        try:
            item = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            streams.close(state)
            raise
        except asyncio.CancelledError:
            try:
                state.cancelling = True
                streams.close(state, cancelled=True)
            except Exception as inner:  # noqa: BLE001
                streams.errors.report("triton.aio_stream", inner)
            raise
        except BaseException as exc:
            try:
                state.last_raw = None
                streams.observe(state, None, exc)
                streams.close(state, error=exc)
            except Exception as inner:  # noqa: BLE001
                streams.errors.report("triton.aio_stream", inner)
            raise
        try:  # per response: inline, not errors.guard (0.3-0.7 us more)
            result, error = item
            streams.observe(state, result, error)
        except Exception as exc:  # noqa: BLE001
            streams.errors.report("triton.aio_stream", exc)
        return item


# weakref to a live grpc.aio response iterator -> (its Streams, its stream); one entry per iterator
_ABANDONED: dict = {}


def _collected(ref) -> None:
    streams, state = _ABANDONED.pop(ref, (None, None))
    if state is not None:
        streams.abandon(state)
