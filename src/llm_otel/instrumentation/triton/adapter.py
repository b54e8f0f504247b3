"""The wrapper factories of the tritonclient hooks: each call becomes one of the core's client calls
(:mod:`llm_otel.telemetry.client`), started, made current and ended where tritonclient delivers
its outcome. What tritonclient's arguments, responses and errors mean is read in :mod:`.parsing`;
gRPC streams (matching responses to requests, how a stream ends) are kept in :mod:`.streams`.
Spans, their times and the metrics are the core's: this package calls
:class:`~llm_otel.telemetry.client.ClientCalls` and never the tracer or a meter.

One wrapper factory per call shape (the names in :data:`llm_otel.instrumentation.triton.hooks.HOOKS`):
``sync_call`` (http / grpc ``infer``), ``aio_call`` (http.aio / grpc.aio ``infer``),
``handle_call`` + ``handle_result`` (http ``async_infer`` ended by ``get_result``),
``callback_call`` (grpc ``async_infer``), ``stream_start`` / ``stream_request`` / ``stream_stop``
/ ``stream_peek`` (grpc streams), ``aio_stream`` (grpc.aio ``stream_infer``) and
``remember_url``. The synchronous ones share one skeleton (:meth:`TritonAdapter._wrap`).

Every wrapper follows the same rules: the span starts in the caller's context, the headers the
call sends are a *copy* of the caller's dict with ``traceparent``/``tracestate`` added
(:meth:`~llm_otel.telemetry.client.ClientCalls.headers_with_context`), the span is current while tritonclient runs (so
``opentelemetry-instrumentation-grpc`` / ``-aiohttp-client`` spans become its children and their
injected ``traceparent`` replaces ours, keeping one chain), and anything that goes wrong inside
llm-otel is counted in ``llm_otel.instrumentation.errors`` and never reaches the application.
The application's exceptions and return values pass through unchanged; its callbacks run exactly
once, after the span has ended.

Clocks: response times are ``time.monotonic()`` seconds (see :mod:`llm_otel.telemetry.client`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from llm_otel.errors import guard
from llm_otel.instrumentation.triton.parsing import (
    Malformed,
    Signatures,
    client_server,
    error_type,
    expected_outputs,
    flavour,
    request_attributes,
    response_problem,
    url_server,
)
from llm_otel.instrumentation.triton.streams import AioResponses, PeekAioCall, PeekIterator, Streams, StreamState
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.client import ClientCall, ClientStream

PROVIDER = "triton"


def _itself(record: Any) -> Any:
    return record


def _pass_on(instance: Any, record: Any, result: Any) -> Any:
    return result


class TritonAdapter:
    """The wrapper factories named in :data:`llm_otel.instrumentation.triton.hooks.HOOKS`, one per
    call shape. Spans and metrics go through ``telemetry.client_calls("triton")``."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.errors = telemetry.errors
        self.calls = telemetry.client_calls(PROVIDER)
        self._sigs = Signatures()
        self._urls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grpc client -> server attrs
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # InferAsyncRequest -> call
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grpc client -> StreamState
        self.streams = Streams(self.calls, self.finish, self.errors)
        self._lock = threading.Lock()

    # --- shared pieces --------------------------------------------------------------------------
    def _server(self, client: Any) -> dict[str, Any]:
        return client_server(client, self._urls)

    def _start_call(
        self,
        flavour: str,
        client: Any,
        model: Any,
        version: Any,
        request_id: Any,
        inputs: Any,
        parameters: Any,
        streaming: bool,
        stream: ClientStream | None = None,
        outputs: Any = None,
    ) -> ClientCall:
        """A call's core record from tritonclient's arguments (``flavour``: the client kind)."""
        llm, req_attrs = request_attributes(inputs, parameters)
        attrs: dict[str, Any] = {A.LLM_TRITON_CLIENT: flavour, **req_attrs}
        if version:
            attrs[A.LLM_TRITON_MODEL_VERSION] = str(version)
        return self.calls.start(
            operation="text_completion" if llm else "infer",
            model=str(model),
            server=self._server(client),
            attributes=attrs,
            request_id=str(request_id or ""),
            streaming=streaming,
            expected=expected_outputs(outputs),
            stream=stream,
        )

    def _malformed(self, call: ClientCall, result: Any) -> Malformed | None:
        """The finding of :func:`response_problem` on a unary call's ``InferResult``, or None."""
        if result is None:
            return None
        try:
            response = result.get_response()
        except Exception as exc:  # noqa: BLE001 - silent: the response problem goes on the call's span
            return Malformed(f"unreadable response ({type(exc).__name__})")
        problem = response_problem(response, call.expected, streaming=False)
        return Malformed(problem) if problem else None

    def finish(
        self,
        call: ClientCall,
        error: BaseException | None = None,
        end_reason: str | None = None,
        end_mono: float | None = None,
    ) -> None:
        """End ``call`` exactly once (:meth:`~llm_otel.telemetry.client.ClientCalls.finish`) with what
        tritonclient raised or handed back (``error``), or a streamed response's finding. Never raises."""
        if error is None and call.problem is not None:
            error = Malformed(call.problem)
        self.calls.finish(
            call,
            error=error,
            error_type=None if error is None else error_type(error),
            content_free=isinstance(error, Malformed),
            end_reason=end_reason,
            end_mono=end_mono,
        )

    def _begin(self, hook: str, fn: Callable[[], Any]) -> Any:
        """Run llm-otel's own set-up; on failure report once and return None (call goes on bare)."""
        with guard(hook, self.errors):
            return fn()
        return None

    def _wrap(
        self, qualname: str, prepare: Callable, *, returned: Callable, failed: Callable, current: Callable | None = None
    ):
        """The one skeleton of every synchronous traced call.

        ``prepare(wrapped, instance, args, kwargs)`` is llm-otel's set-up: ``(record, bound)``, with
        ``bound`` the arguments to pass on (None: the application's own, untouched), or None to run
        tritonclient bare (also when the set-up fails: reported once). ``current(record)``: the core
        record whose span is current while tritonclient runs (None: the caller's context stays).
        ``returned(instance, record, result)`` gives what the application gets;
        ``failed(instance, record, exc)`` runs before tritonclient's exception propagates unchanged.
        """

        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            record, bound = prepared
            if bound is not None:
                args, kwargs = bound.args, bound.kwargs
            try:
                if current is None:
                    result = wrapped(*args, **kwargs)
                else:
                    with self.calls.use(current(record)):
                        result = wrapped(*args, **kwargs)
            except BaseException as exc:
                failed(instance, record, exc)
                raise
            return returned(instance, record, result)

        return wrapper

    # --- unary calls ----------------------------------------------------------------------------
    def _unary(self, flavour: str) -> Callable:
        """``prepare`` of a unary call: its record and the arguments with a headers copy carrying
        its context."""

        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            a = bound.arguments
            call = self._start_call(
                flavour,
                instance,
                a.get("model_name"),
                a.get("model_version"),
                a.get("request_id"),
                a.get("inputs"),
                a.get("parameters"),
                False,
                outputs=a.get("outputs"),
            )
            a["headers"] = self.calls.headers_with_context(a.get("headers"), call)
            return call, bound

        return prepare

    def _returned(self, instance: Any, call: ClientCall, result: Any) -> Any:
        """A unary call returned: it ends (an error when the response is malformed), result unchanged."""
        self.finish(call, error=self._malformed(call, result))
        return result

    def _failed(self, instance: Any, call: ClientCall, exc: BaseException) -> None:
        self.finish(call, error=exc)

    def sync_call(self, qualname: str):
        """http / grpc ``infer``: the span ends when tritonclient returns or raises."""
        return self._wrap(
            qualname, self._unary(flavour(qualname)), current=_itself, returned=self._returned, failed=self._failed
        )

    def aio_call(self, qualname: str):
        """http.aio / grpc.aio ``infer``: the same around the coroutine."""
        prepare = self._unary(flavour(qualname))

        async def run(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return await wrapped(*args, **kwargs)
            call, bound = prepared
            try:
                with self.calls.use(call):
                    result = await wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self._failed(instance, call, exc)
                raise
            return self._returned(instance, call, result)

        def wrapper(wrapped, instance, args, kwargs):
            return run(wrapped, instance, args, kwargs)

        return wrapper

    def handle_call(self, qualname: str):
        """http ``async_infer``: the POST runs later in a gevent greenlet with an empty context, so
        the span starts and the headers are injected here; :meth:`handle_result` ends it."""

        def hold(client: Any, call: ClientCall, handle: Any) -> Any:
            with guard(qualname, self.errors) as g:
                with self._lock:
                    self._pending[handle] = call
            if g.failed:
                self.finish(call)
            return handle

        return self._wrap(qualname, self._unary(flavour(qualname)), returned=hold, failed=self._failed)

    def handle_result(self, qualname: str):
        """``InferAsyncRequest.get_result``: ends the call of :meth:`handle_call` when the result or
        error arrives (a ``get_result`` timeout that leaves the request running does not)."""

        def prepare(wrapped, instance, args, kwargs):
            with self._lock:
                call = self._pending.get(instance)
            return None if call is None else (call, None)

        def failed(handle: Any, call: ClientCall, exc: BaseException) -> None:
            if self._done(handle):
                self._forget(handle)
                self.finish(call, error=exc)

        def returned(handle: Any, call: ClientCall, result: Any) -> Any:
            self._forget(handle)
            return self._returned(handle, call, result)

        return self._wrap(qualname, prepare, returned=returned, failed=failed)

    @staticmethod
    def _done(handle) -> bool:
        """False while a get_result timeout left the request running (retrieved later)."""
        try:
            return bool(handle._greenlet.ready())
        except Exception:  # noqa: BLE001 - silent: feature probe of the gevent handle
            return True

    def _forget(self, handle) -> None:
        with self._lock:
            self._pending.pop(handle, None)

    def callback_call(self, qualname: str):
        """grpc ``async_infer``: the span ends on gRPC's callback thread, before the application's
        callback runs, exactly once."""
        unary = self._unary(flavour(qualname))

        def prepare(wrapped, instance, args, kwargs):
            prepared = unary(wrapped, instance, args, kwargs)
            if prepared is None:
                return None
            call, bound = prepared
            user_callback = bound.arguments["callback"]

            def callback(*cb_args, **cb_kwargs):
                error = cb_kwargs.get("error", cb_args[1] if len(cb_args) > 1 else None)
                if error is None:
                    error = self._malformed(call, cb_kwargs.get("result", cb_args[0] if cb_args else None))
                self.finish(call, error=error)
                return user_callback(*cb_args, **cb_kwargs)

            bound.arguments["callback"] = callback
            return call, bound

        return self._wrap(qualname, prepare, current=_itself, returned=_pass_on, failed=self._failed)

    def remember_url(self, qualname: str):
        """gRPC clients' ``__init__``: their ``server.address``/``server.port`` for later calls."""

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            with guard(qualname, self.errors):
                url = kwargs["url"] if "url" in kwargs else (args[0] if args else None)
                self._urls[instance] = url_server(url)
            return result

        return wrapper

    # --- gRPC streams ---------------------------------------------------------------------------
    def _open_stream(self, flavour: str, client: Any) -> StreamState:
        return self.streams.open(flavour, self._server(client))

    def _stream_request(
        self, state: StreamState, client: Any, model, version, request_id, inputs, parameters
    ) -> ClientCall:
        """A request on a stream (parent and link: :meth:`ClientCalls.start`), now in flight on it."""
        return self._start_call(
            state.client, client, model, version, request_id, inputs, parameters, streaming=True, stream=state.stream
        )

    def _stream_failed(self, instance: Any, state: StreamState, exc: BaseException) -> None:
        self.streams.close(state, error=exc)

    def stream_start(self, qualname: str):
        """grpc ``start_stream``: the stream span (its context is the stream's metadata) and a
        callback wrapper that attributes each response to its request before the application's
        callback runs."""
        kind = flavour(qualname)

        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None or getattr(instance, "_stream", None) is not None:
                return None  # tritonclient refuses a second stream; nothing to trace
            state = self._open_stream(kind, instance)
            user_callback = bound.arguments["callback"]

            def callback(*cb_args, **cb_kwargs):
                try:  # per response: inline, not errors.guard (0.3-0.7 us more)
                    result = cb_kwargs.get("result", cb_args[0] if cb_args else None)
                    error = cb_kwargs.get("error", cb_args[1] if len(cb_args) > 1 else None)
                    self.streams.observe(state, result, error)
                except Exception as exc:  # noqa: BLE001
                    self.errors.report("triton.stream_callback", exc)
                return user_callback(*cb_args, **cb_kwargs)

            callback._llm_otel_stream = state  # found again by stream_peek
            bound.arguments["callback"] = callback
            bound.arguments["headers"] = self.calls.headers_with_context(bound.arguments.get("headers"), state.stream)
            return state, bound

        def returned(instance: Any, state: StreamState, result: Any) -> Any:
            with self._lock:
                self._streams[instance] = state
            return result

        return self._wrap(
            qualname, prepare, current=lambda state: state.stream, returned=returned, failed=self._stream_failed
        )

    def stream_peek(self, qualname: str):
        """Wraps the response iterator so the callback wrapper sees each raw response (tritonclient
        drops the request id of error responses)."""

        def wrapper(wrapped, instance, args, kwargs):
            state = getattr(getattr(instance, "_callback", None), "_llm_otel_stream", None)
            if state is not None and args:
                args = (PeekIterator(args[0], state),) + tuple(args[1:])
            return wrapped(*args, **kwargs)

        return wrapper

    def stream_request(self, qualname: str):
        """grpc ``async_stream_infer``: one call per request on the open stream (tritonclient gets
        the application's own arguments: a stream request has no headers)."""

        def prepare(wrapped, instance, args, kwargs):
            with self._lock:
                state = self._streams.get(instance)
            if state is None or state.stream.closed:
                return None
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            a = bound.arguments
            call = self._stream_request(
                state,
                instance,
                a.get("model_name"),
                a.get("model_version"),
                a.get("request_id"),
                a.get("inputs"),
                a.get("parameters"),
            )
            return (call, state), None

        def failed(instance: Any, record: tuple[ClientCall, StreamState], exc: BaseException) -> None:
            self.finish(record[0], error=exc)  # no longer in flight on its stream

        return self._wrap(qualname, prepare, returned=_pass_on, failed=failed)

    def stream_stop(self, qualname: str):
        """grpc ``stop_stream``: ends the requests still open and the stream span, after
        tritonclient's own stop returned or raised."""

        def prepare(wrapped, instance, args, kwargs):
            with self._lock:
                state = self._streams.pop(instance, None)
            if state is None:
                return None
            bound = self._sigs.bind(wrapped, args, kwargs)
            state.cancelling = bool(bound is not None and bound.arguments.get("cancel_requests"))
            return state, None

        def close(instance: Any, state: StreamState, _outcome: Any = None) -> None:
            with guard(qualname, self.errors):
                self.streams.close(state, cancelled=state.cancelling)

        def returned(instance: Any, state: StreamState, result: Any) -> Any:
            close(instance, state)
            return result

        return self._wrap(qualname, prepare, returned=returned, failed=close)

    def aio_stream(self, qualname: str):
        """grpc.aio ``stream_infer``: the stream span, one call per item of the request iterator,
        and a response iterator that attributes each response and ends the stream with the iteration."""
        kind = flavour(qualname)

        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            state = self._open_stream(kind, instance)
            bound.arguments["headers"] = self.calls.headers_with_context(bound.arguments.get("headers"), state.stream)
            bound.arguments["inputs_iterator"] = self._aio_requests(state, instance, bound.arguments["inputs_iterator"])
            return state, bound

        def returned(instance: Any, state: StreamState, responses: Any) -> Any:
            with guard(qualname, self.errors):  # on failure still traced, without error request ids
                grpc_call = responses._grpc_call
                responses._grpc_call = PeekAioCall(grpc_call, state)
            return AioResponses(responses, self.streams, state)

        return self._wrap(
            qualname, prepare, current=lambda state: state.stream, returned=returned, failed=self._stream_failed
        )

    async def _aio_requests(self, state: StreamState, client: Any, inputs_iterator):
        async for item in inputs_iterator:
            if isinstance(item, dict):
                with guard("triton.aio_stream_request", self.errors):
                    self._stream_request(
                        state,
                        client,
                        item.get("model_name"),
                        item.get("model_version"),
                        item.get("request_id"),
                        item.get("inputs"),
                        item.get("parameters"),
                    )
            yield item
