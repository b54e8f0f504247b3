"""Reads tritonclient calls and responses for the core's client calls (:mod:`llm_otel.telemetry.client`).

What lives here is tritonclient knowledge only: which arguments a call has (bound with
``inspect.signature``), the GenAI request attributes in its inputs and parameters, the server
address of a client, what an error is called (``InferenceServerException.status()``, gRPC codes),
whether a response has what was asked for, and the bookkeeping of gRPC streams (requests in
flight by id, the raw response behind each callback, how a stream ended). Spans, their times and
the metrics are the core's: this module calls :class:`~llm_otel.telemetry.client.ClientCalls`
and never the tracer or a meter.

One wrapper factory per call shape (the names in :data:`llm_otel.instrumentation.triton.hooks.HOOKS`):
``sync_call`` (http / grpc ``infer``), ``aio_call`` (http.aio / grpc.aio ``infer``),
``handle_call`` + ``handle_result`` (http ``async_infer`` ended by ``get_result``),
``callback_call`` (grpc ``async_infer``), ``stream_start`` / ``stream_request`` / ``stream_stop``
/ ``stream_peek`` (grpc streams), ``aio_stream`` (grpc.aio ``stream_infer``) and
``remember_url``. The synchronous ones share one skeleton (:meth:`TritonAdapter._wrap`).

Every wrapper follows the same rules: the span starts in the caller's context, the headers the
call sends are a *copy* of the caller's dict with ``traceparent``/``tracestate`` added (lowercase
keys: gRPC metadata requires them), the span is current while tritonclient runs (so
``opentelemetry-instrumentation-grpc`` / ``-aiohttp-client`` spans become its children and their
injected ``traceparent`` replaces ours, keeping one chain), and anything that goes wrong inside
llm-otel is counted in ``llm_otel.instrumentation.errors`` and never reaches the application.
The application's exceptions and return values pass through unchanged; its callbacks run exactly
once, after the span has ended.

Clocks: response times are ``time.monotonic()`` seconds (see :mod:`llm_otel.telemetry.client`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable
from urllib.parse import urlsplit

import numpy as np
import wrapt

from llm_otel.errors import guard
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.client import CANCELLED, ClientCall, ClientStream

logger = logging.getLogger("llm_otel")

PROVIDER = "triton"
FINAL_PARAM = "triton_final_response"
# inputs whose presence makes a call an LLM text completion
_LLM_INPUTS = frozenset({"text_input", "prompt", "input_ids", "sampling_parameters"})
# input / parameter / sampling_parameters key -> (GenAI attribute, python type)
_REQUEST_KEYS: dict[str, tuple[str, type]] = {
    "max_tokens": (A.GEN_AI_REQUEST_MAX_TOKENS, int),
    "max_new_tokens": (A.GEN_AI_REQUEST_MAX_TOKENS, int),
    "request_output_len": (A.GEN_AI_REQUEST_MAX_TOKENS, int),  # TensorRT-LLM
    "temperature": (A.GEN_AI_REQUEST_TEMPERATURE, float),
    "top_p": (A.GEN_AI_REQUEST_TOP_P, float),
    "runtime_top_p": (A.GEN_AI_REQUEST_TOP_P, float),
    "top_k": (A.GEN_AI_REQUEST_TOP_K, float),
    "runtime_top_k": (A.GEN_AI_REQUEST_TOP_K, float),
    "seed": (A.GEN_AI_REQUEST_SEED, int),
    "random_seed": (A.GEN_AI_REQUEST_SEED, int),
    "frequency_penalty": (A.GEN_AI_REQUEST_FREQUENCY_PENALTY, float),
    "presence_penalty": (A.GEN_AI_REQUEST_PRESENCE_PENALTY, float),
    "stream": (A.GEN_AI_REQUEST_STREAM, bool),
}
_MAX_SCALAR_BYTES = 4096  # larger inputs are data, not settings: never parsed


class StreamState:
    """One gRPC stream: its core record, the requests in flight on it (by request id, oldest first)
    and the raw response tritonclient is handing to the callback right now (stream thread only)."""

    def __init__(self, stream: ClientStream, client: str, server_attrs: dict) -> None:
        self.stream = stream
        self.client = client
        self.server_attrs = server_attrs
        self.lock = threading.Lock()
        self.inflight: dict[str, deque[ClientCall]] = {}
        self.requests = 0
        self.last_raw: Any = None
        self.error: BaseException | None = None
        self.closed = False
        self.cancelling = False  # stop_stream(cancel_requests=True) is running

    def add(self, call: ClientCall) -> None:
        with self.lock:
            self.requests += 1
            self.inflight.setdefault(call.request_id, deque()).append(call)

    def lookup(self, request_id: str) -> ClientCall | None:
        with self.lock:
            calls = self.inflight.get(request_id)
            if calls:
                return calls[0]
            if len(self.inflight) == 1:  # the server echoes the id; an unknown one can only be ours
                (only,) = self.inflight.values()
                return only[0] if len(only) == 1 else None
            return None

    def remove(self, call: ClientCall) -> None:
        with self.lock:
            calls = self.inflight.get(call.request_id)
            if calls:
                try:
                    calls.remove(call)
                except ValueError:
                    pass
                if not calls:
                    del self.inflight[call.request_id]

    def drain(self) -> list[ClientCall]:
        with self.lock:
            out = [c for calls in self.inflight.values() for c in calls]
            self.inflight.clear()
            return out


def _error_type(exc: BaseException) -> str:
    """``InferenceServerException.status()`` when it has one (``StatusCode.UNAVAILABLE``, ``400``),
    a gRPC error's ``code()`` name (``DEADLINE_EXCEEDED``: grpc.aio raises ``AioRpcError``),
    ``cancelled`` for a cancellation, else the exception's class name."""
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    try:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        if code is not None and isinstance(getattr(code, "name", None), str):
            return code.name
    except Exception:  # noqa: BLE001 - silent: feature probe of the exception's gRPC code
        pass
    status = None
    try:
        status = exc.status() if callable(getattr(exc, "status", None)) else None
    except Exception:  # noqa: BLE001 - silent: feature probe of the exception's status
        status = None
    if isinstance(status, str) and status:
        return status.removeprefix("StatusCode.")
    if status is not None and not isinstance(status, str):
        return str(status)
    return type(exc).__qualname__


class _Malformed(Exception):
    """A success response that does not have what the call asked for (description in the message:
    output names and data types only, never content)."""

    def status(self) -> str:
        return "malformed_response"


def _outputs(response: Any) -> list[tuple[str, str]]:
    """``(name, datatype)`` of a response's outputs: a gRPC ``ModelInferResponse`` or the JSON
    dict of an HTTP ``InferResult.get_response()``."""
    outputs = response.get("outputs") if isinstance(response, dict) else response.outputs
    out = []
    for item in outputs or ():
        if isinstance(item, dict):
            out.append((str(item.get("name")), str(item.get("datatype"))))
        else:
            out.append((item.name, item.datatype))
    return out


def response_problem(response: Any, expected: tuple[str, ...], streaming: bool) -> str | None:
    """What is wrong with a success response, or None: no outputs at all (a unary call), a
    requested output missing, or ``text_output`` (the LLM backends' text) not BYTES. A response
    that cannot be read at all is itself the problem. Never raises."""
    try:
        outputs = _outputs(response)
    except Exception as exc:  # noqa: BLE001 - silent: the response problem goes on the call's span
        return f"unreadable response ({type(exc).__name__})"
    names = dict(outputs)
    if streaming and not outputs:
        return None  # an empty response carrying only the final flag
    missing = [n for n in expected if n not in names]
    if missing:
        return "response lacks requested output(s) " + ", ".join(missing)
    if not outputs:
        return "response has no outputs"
    dtype = names.get("text_output")
    if dtype is not None and dtype != "BYTES":
        return f"text_output is {dtype}, expected BYTES"
    return None


def _expected(outputs: Any) -> tuple[str, ...]:
    names = []
    for out in outputs or ():
        try:
            name = out.name()
        except Exception:  # noqa: BLE001 - silent: an output without a name is skipped
            continue
        if isinstance(name, str):
            names.append(name)
    return tuple(names)


def _first_value(inp: Any) -> Any:
    """First element of a tritonclient InferInput's data (http or grpc), or None. Only small
    inputs are read: settings such as ``max_tokens`` or ``sampling_parameters``."""
    data = getattr(inp, "_data", None)  # http InferInput with binary_data=False: a python list
    if isinstance(data, list) and data:
        return data[0]
    raw = getattr(inp, "_raw_data", None)
    if raw is None:
        raw = getattr(inp, "_raw_content", None)  # grpc InferInput
    if not isinstance(raw, (bytes, bytearray)) or not raw or len(raw) > _MAX_SCALAR_BYTES:
        return None
    dtype = inp.datatype()
    if dtype == "BYTES":  # 4-byte little-endian length, then the bytes
        n = int.from_bytes(raw[:4], "little")
        return bytes(raw[4:4 + n]).decode("utf-8", "replace")
    from tritonclient.utils import triton_to_np_dtype

    np_dtype = triton_to_np_dtype(dtype)
    if np_dtype is None or np_dtype is np.object_:
        return None
    values = np.frombuffer(raw, dtype=np_dtype)
    return values[0].item() if values.size else None


def _coerce(value: Any, typ: type) -> Any:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if typ is bool:
        if isinstance(value, str):
            return value.strip().lower() in {"1", "true", "yes"}
        return bool(value)
    return typ(value)


def request_attributes(inputs: Any, parameters: Any) -> tuple[bool, dict[str, Any]]:
    """(is an LLM-style call, GenAI request attributes) from the call's inputs and parameters.

    LLM-style: an input named ``text_input``/``prompt``/``input_ids``/``sampling_parameters``.
    Settings come from inputs named like ``max_tokens``/``temperature``/``stream`` (TensorRT-LLM
    names too), the vLLM backend's JSON ``sampling_parameters`` input and the request
    ``parameters`` dict; a value that does not parse is skipped.
    """
    attrs: dict[str, Any] = {}
    llm = False

    def put(key: str, value: Any) -> None:
        spec = _REQUEST_KEYS.get(key)
        if spec is None or value is None:
            return
        try:
            attrs[spec[0]] = _coerce(value, spec[1])
        except (TypeError, ValueError):
            pass

    for inp in inputs or ():
        try:
            name = inp.name()
        except Exception:  # noqa: BLE001 - silent: an input without a name is skipped
            continue
        if name in _LLM_INPUTS:
            llm = True
        if name == "sampling_parameters":
            text = _first_value(inp)
            try:
                params = json.loads(text) if isinstance(text, str) else None
            except ValueError:
                params = None
            if isinstance(params, dict):
                for key, value in params.items():
                    put(key, value)
        elif name in _REQUEST_KEYS:
            put(name, _first_value(inp))
    if isinstance(parameters, dict):
        for key, value in parameters.items():
            put(key, value)
    return llm, attrs


def _url_server(url: Any) -> dict[str, Any]:
    """``server.address``/``server.port`` from a tritonclient url (``host:port[/base]``, no scheme)."""
    if not isinstance(url, str) or not url:
        return {}
    try:
        parts = urlsplit(url if "://" in url else "//" + url)
        out: dict[str, Any] = {}
        if parts.hostname:
            out[A.SERVER_ADDRESS] = parts.hostname
        if parts.port:
            out[A.SERVER_PORT] = parts.port
        return out
    except ValueError:
        return {}


class _Signatures:
    """``inspect.signature`` of each wrapped method, computed once."""

    def __init__(self) -> None:
        self._cache: dict[Any, inspect.Signature] = {}

    def bind(self, wrapped: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
        """The call's arguments with defaults, or None when they do not fit the signature (the
        application's own mistake: tritonclient raises its TypeError, not llm-otel)."""
        func = getattr(wrapped, "__func__", wrapped)
        sig = self._cache.get(func)
        if sig is None:
            sig = self._cache[func] = inspect.signature(wrapped)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        return bound


def _flavour(qualname: str) -> str:
    """``http``, ``http.aio``, ``grpc`` or ``grpc.aio``: the client a hook's ``module:target`` belongs to."""
    module = qualname.partition(":")[0]
    kind = "http" if module.startswith("tritonclient.http") else "grpc"
    return f"{kind}.aio" if module.endswith(".aio") else kind


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
        self._sigs = _Signatures()
        self._urls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grpc client -> server attrs
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # InferAsyncRequest -> call
        self._streams: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grpc client -> StreamState
        self._lock = threading.Lock()

    # --- shared pieces --------------------------------------------------------------------------
    def _server(self, client: Any) -> dict[str, Any]:
        try:
            parsed = getattr(client, "_parsed_url", None)  # tritonclient.http (geventhttpclient URL)
            if parsed is not None:
                return {A.SERVER_ADDRESS: parsed.host, A.SERVER_PORT: int(parsed.port)}
            url = getattr(client, "_url", None)  # tritonclient.http.aio ("http://host:port")
            if isinstance(url, str):
                return _url_server(url)
            return dict(self._urls.get(client, {}))
        except Exception:  # noqa: BLE001 - silent: feature probe: server address unknown
            return {}

    def _start_call(self, flavour: str, client: Any, model: Any, version: Any, request_id: Any,
                    inputs: Any, parameters: Any, streaming: bool, stream: ClientStream | None = None,
                    outputs: Any = None) -> ClientCall:
        """A call's core record from tritonclient's arguments (``flavour``: the client kind)."""
        llm, req_attrs = request_attributes(inputs, parameters)
        attrs: dict[str, Any] = {A.LLM_TRITON_CLIENT: flavour, **req_attrs}
        if version:
            attrs[A.LLM_TRITON_MODEL_VERSION] = str(version)
        return self.calls.start(operation="text_completion" if llm else "infer", model=str(model),
                                server=self._server(client), attributes=attrs,
                                request_id=str(request_id or ""), streaming=streaming,
                                expected=_expected(outputs), stream=stream)

    def _headers_with_context(self, headers: Any, record: ClientCall | ClientStream) -> dict:
        """A new dict: the caller's headers plus ``traceparent``/``tracestate`` of ``record``'s span."""
        out = dict(headers) if headers else {}
        for key in [k for k in out if isinstance(k, str) and k.lower() in ("traceparent", "tracestate")]:
            del out[key]
        out.update(self.calls.carrier(record))
        return out

    def _malformed(self, call: ClientCall, result: Any) -> _Malformed | None:
        """The finding of :func:`response_problem` on a unary call's ``InferResult``, or None."""
        if result is None:
            return None
        try:
            response = result.get_response()
        except Exception as exc:  # noqa: BLE001 - silent: the response problem goes on the call's span
            return _Malformed(f"unreadable response ({type(exc).__name__})")
        problem = response_problem(response, call.expected, streaming=False)
        return _Malformed(problem) if problem else None

    def finish(self, call: ClientCall, error: BaseException | None = None, end_reason: str | None = None,
               end_mono: float | None = None) -> None:
        """End ``call`` exactly once (:meth:`~llm_otel.telemetry.client.ClientCalls.finish`) with what
        tritonclient raised or handed back (``error``), or a streamed response's finding. Never raises."""
        if error is None and call.problem is not None:
            error = _Malformed(call.problem)
        self.calls.finish(call, error=error, error_type=None if error is None else _error_type(error),
                          content_free=isinstance(error, _Malformed), end_reason=end_reason, end_mono=end_mono)

    def _begin(self, hook: str, fn: Callable[[], Any]) -> Any:
        """Run llm-otel's own set-up; on failure report once and return None (call goes on bare)."""
        with guard(hook, self.errors):
            return fn()
        return None

    def _wrap(self, qualname: str, prepare: Callable, *, returned: Callable, failed: Callable,
              current: Callable | None = None):
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
            call = self._start_call(flavour, instance, a.get("model_name"), a.get("model_version"),
                                    a.get("request_id"), a.get("inputs"), a.get("parameters"), False,
                                    outputs=a.get("outputs"))
            a["headers"] = self._headers_with_context(a.get("headers"), call)
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
        return self._wrap(qualname, self._unary(_flavour(qualname)), current=_itself,
                          returned=self._returned, failed=self._failed)

    def aio_call(self, qualname: str):
        """http.aio / grpc.aio ``infer``: the same around the coroutine."""
        prepare = self._unary(_flavour(qualname))

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

        return self._wrap(qualname, self._unary(_flavour(qualname)), returned=hold, failed=self._failed)

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
        unary = self._unary(_flavour(qualname))

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
                self._urls[instance] = _url_server(url)
            return result

        return wrapper

    # --- gRPC streams ---------------------------------------------------------------------------
    def _open_stream(self, flavour: str, client: Any) -> StreamState:
        server = self._server(client)
        stream = self.calls.start_stream(S.LLM_TRITON_STREAM, {A.LLM_TRITON_CLIENT: flavour, **server})
        return StreamState(stream, flavour, server)

    def _stream_request(self, state: StreamState, client: Any, model, version, request_id, inputs,
                        parameters) -> ClientCall:
        """A request on a stream (parent and link: :meth:`ClientCalls.start`), now in flight on it."""
        call = self._start_call(state.client, client, model, version, request_id, inputs, parameters,
                                streaming=True, stream=state.stream)
        state.add(call)
        return call

    def _observe(self, state: StreamState, result: Any, error: Any) -> None:
        """One stream response (stream thread / event loop): attribute it to its request."""
        now = time.monotonic()
        raw = state.last_raw
        state.last_raw = None
        if result is not None:
            response = result.get_response()
        elif raw is not None and getattr(raw, "error_message", ""):
            response = raw.infer_response
        else:
            # the stream itself ended with a gRPC status: every request on it ends with it
            if state.cancelling:
                for call in state.drain():
                    self.finish(call, error=_Cancelled("stream stopped with cancel_requests=True"),
                                end_reason="cancelled", end_mono=now)
                return
            state.error = error
            for call in state.drain():
                self.finish(call, error=error, end_mono=now)
            return
        call = state.lookup(response.id)
        if call is None:
            return
        final = False
        try:
            if FINAL_PARAM in response.parameters:
                final = bool(response.parameters[FINAL_PARAM].bool_param)
        except Exception:  # noqa: BLE001 - silent: feature probe: a response without the final flag
            final = False
        if error is not None:
            state.remove(call)
            self.finish(call, error=error, end_reason="error", end_mono=now)
            return
        empty = len(response.outputs) == 0
        if not empty:
            call.on_response(now)
            if call.problem is None:
                call.problem = response_problem(response, call.expected, streaming=True)
        if final:
            state.remove(call)
            self.finish(call, end_reason="empty_final" if empty else "final_flag", end_mono=now)

    def _end_stream(self, state: StreamState, cancelled: bool = False, error: BaseException | None = None) -> None:
        if state.closed:
            return
        state.closed = True
        # a cancelled stream's gRPC CANCELLED status is the application's choice, not a failure
        error = error or (None if cancelled else state.error)
        for call in state.drain():
            if cancelled:
                self.finish(call, error=_Cancelled("stream stopped with cancel_requests=True"),
                            end_reason="cancelled")
            else:
                # no final flag came: the request ended with its last response
                end = call.times[-1] if call.times else None
                self.finish(call, error=error, end_reason="stream_end", end_mono=end)
        self.calls.end_stream(state.stream, {A.LLM_TRITON_STREAM_REQUESTS: state.requests},
                              error_type=None if error is None else _error_type(error), cancelled=cancelled)

    def _stream_failed(self, instance: Any, state: StreamState, exc: BaseException) -> None:
        self._end_stream(state, error=exc)

    def stream_start(self, qualname: str):
        """grpc ``start_stream``: the stream span (its context is the stream's metadata) and a
        callback wrapper that attributes each response to its request before the application's
        callback runs."""
        flavour = _flavour(qualname)

        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None or getattr(instance, "_stream", None) is not None:
                return None  # tritonclient refuses a second stream; nothing to trace
            state = self._open_stream(flavour, instance)
            user_callback = bound.arguments["callback"]

            def callback(*cb_args, **cb_kwargs):
                try:
                    result = cb_kwargs.get("result", cb_args[0] if cb_args else None)
                    error = cb_kwargs.get("error", cb_args[1] if len(cb_args) > 1 else None)
                    self._observe(state, result, error)
                except Exception as exc:  # noqa: BLE001
                    self.errors.report("triton.stream_callback", exc)
                return user_callback(*cb_args, **cb_kwargs)

            callback._llm_otel_stream = state  # found again by stream_peek
            bound.arguments["callback"] = callback
            bound.arguments["headers"] = self._headers_with_context(bound.arguments.get("headers"), state.stream)
            return state, bound

        def returned(instance: Any, state: StreamState, result: Any) -> Any:
            with self._lock:
                self._streams[instance] = state
            return result

        return self._wrap(qualname, prepare, current=lambda state: state.stream, returned=returned,
                          failed=self._stream_failed)

    def stream_peek(self, qualname: str):
        """Wraps the response iterator so the callback wrapper sees each raw response (tritonclient
        drops the request id of error responses)."""

        def wrapper(wrapped, instance, args, kwargs):
            state = getattr(getattr(instance, "_callback", None), "_llm_otel_stream", None)
            if state is not None and args:
                args = (_PeekIterator(args[0], state),) + tuple(args[1:])
            return wrapped(*args, **kwargs)

        return wrapper

    def stream_request(self, qualname: str):
        """grpc ``async_stream_infer``: one call per request on the open stream (tritonclient gets
        the application's own arguments: a stream request has no headers)."""

        def prepare(wrapped, instance, args, kwargs):
            with self._lock:
                state = self._streams.get(instance)
            if state is None or state.closed:
                return None
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            a = bound.arguments
            call = self._stream_request(state, instance, a.get("model_name"), a.get("model_version"),
                                        a.get("request_id"), a.get("inputs"), a.get("parameters"))
            return (call, state), None

        def failed(instance: Any, record: tuple[ClientCall, StreamState], exc: BaseException) -> None:
            call, state = record
            state.remove(call)
            self.finish(call, error=exc)

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
                self._end_stream(state, cancelled=state.cancelling)

        def returned(instance: Any, state: StreamState, result: Any) -> Any:
            close(instance, state)
            return result

        return self._wrap(qualname, prepare, returned=returned, failed=close)

    def aio_stream(self, qualname: str):
        """grpc.aio ``stream_infer``: the stream span, one call per item of the request iterator,
        and a response iterator that attributes each response and ends the stream with the iteration."""
        flavour = _flavour(qualname)

        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            state = self._open_stream(flavour, instance)
            bound.arguments["headers"] = self._headers_with_context(bound.arguments.get("headers"), state.stream)
            bound.arguments["inputs_iterator"] = self._aio_requests(state, instance,
                                                                    bound.arguments["inputs_iterator"])
            return state, bound

        def returned(instance: Any, state: StreamState, responses: Any) -> Any:
            with guard(qualname, self.errors):  # on failure still traced, without error request ids
                grpc_call = responses._grpc_call
                responses._grpc_call = _PeekAioCall(grpc_call, state)
            return _AioResponses(responses, self, state)

        return self._wrap(qualname, prepare, current=lambda state: state.stream, returned=returned,
                          failed=self._stream_failed)

    async def _aio_requests(self, state: StreamState, client: Any, inputs_iterator):
        async for item in inputs_iterator:
            if isinstance(item, dict):
                with guard("triton.aio_stream_request", self.errors):
                    self._stream_request(state, client, item.get("model_name"), item.get("model_version"),
                                         item.get("request_id"), item.get("inputs"), item.get("parameters"))
            yield item


class _Cancelled(Exception):
    """Stands for the cancellation of requests still open when the stream was stopped."""

    def status(self) -> str:
        return "cancelled"


class _PeekIterator(wrapt.ObjectProxy):
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


class _PeekAioCall(wrapt.ObjectProxy):
    """The grpc.aio stream call, remembering each raw response for :class:`_AioResponses`."""

    def __init__(self, call, state: StreamState) -> None:
        super().__init__(call)
        self._self_state = state

    def __aiter__(self):
        return _PeekAioIterator(self.__wrapped__.__aiter__(), self._self_state)


class _PeekAioIterator:
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


class _AioResponses(wrapt.ObjectProxy):
    """tritonclient.grpc.aio's response iterator: yields the same ``(result, error)`` pairs, and
    attributes each to its request; the stream span ends when the iteration ends.

    How it ends: exhausted -> each open request ends with the stream (``stream_end``); a gRPC error
    (a deadline cutting the stream short, the server going away) -> error spans with the gRPC code;
    ``cancel()`` or the consuming task being cancelled -> ``error.type=cancelled`` without an error
    status; abandoned (``break`` out of ``async for``, the iterator dropped) -> when it is
    collected, each open request ends as ``abandoned`` (a weakref callback: it holds the state, not the
    iterator).
    """

    def __init__(self, responses, adapter: TritonAdapter, state: StreamState) -> None:
        super().__init__(responses)
        self._self_adapter = adapter
        self._self_state = state
        # a weakref callback, not weakref.finalize: the first finalize() registers weakref's atexit
        # hook, which must not come before multiprocessing's (see export/providers.py)
        _ABANDONED[weakref.ref(self, _collected)] = (adapter, state)

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
            with guard("triton.aio_stream", self._self_adapter.errors):
                self._self_adapter._end_stream(state, cancelled=True)

    async def __anext__(self):
        adapter, state = self._self_adapter, self._self_state
        try:
            item = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            adapter._end_stream(state)
            raise
        except asyncio.CancelledError:
            try:
                state.cancelling = True
                adapter._end_stream(state, cancelled=True)
            except Exception as inner:  # noqa: BLE001
                adapter.errors.report("triton.aio_stream", inner)
            raise
        except BaseException as exc:
            try:
                state.last_raw = None
                adapter._observe(state, None, exc)
                adapter._end_stream(state, error=exc)
            except Exception as inner:  # noqa: BLE001
                adapter.errors.report("triton.aio_stream", inner)
            raise
        try:
            result, error = item
            adapter._observe(state, result, error)
        except Exception as exc:  # noqa: BLE001
            adapter.errors.report("triton.aio_stream", exc)
        return item


# weakref to a live grpc.aio response iterator -> (adapter, its stream); one entry per iterator
_ABANDONED: dict = {}


def _collected(ref) -> None:
    adapter, state = _ABANDONED.pop(ref, (None, None))
    if state is not None:
        _abandon(adapter, state)


def _abandon(adapter: TritonAdapter, state: StreamState) -> None:
    """Finalizer of a grpc.aio response iterator collected before its stream ended."""
    if state.closed:
        return
    with guard("triton.aio_stream_abandoned", adapter.errors):  # runs from the garbage collector
        state.closed = True
        now = time.monotonic()
        for call in state.drain():
            adapter.finish(call, error=_Cancelled("the response iterator was dropped"), end_reason="abandoned",
                           end_mono=now)
        adapter.calls.end_stream(state.stream, {A.LLM_TRITON_STREAM_REQUESTS: state.requests}, cancelled=True)
