"""Turns tritonclient calls into CLIENT spans, streamed-response timing and GenAI client metrics.

Every wrapper follows the same rules: the span starts in the caller's context, the headers the
call sends are a *copy* of the caller's dict with ``traceparent``/``tracestate`` added (lowercase
keys: gRPC metadata requires them), the span is current while tritonclient runs (so
``opentelemetry-instrumentation-grpc`` / ``-aiohttp-client`` spans become its children and their
injected ``traceparent`` replaces ours, keeping one chain), and anything that goes wrong inside
llm-otel is counted in ``llm_otel.instrumentation.errors`` and never reaches the application.
The application's exceptions and return values pass through unchanged; its callbacks run exactly
once, after the span has ended.

Clocks: span times are epoch ns (``time.time_ns()``); response times are ``time.monotonic()``
seconds mapped to epoch ns once per call (:func:`llm_otel.telemetry.record.mono_offset_ns`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
import weakref
from array import array
from collections import deque
from typing import Any, Callable
from urllib.parse import urlsplit

import numpy as np
import wrapt
from opentelemetry import trace
from opentelemetry.metrics import get_meter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llm_otel.semconv import SCHEMA_URL
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.semconv import spans as S
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.record import mono_offset_ns

logger = logging.getLogger("llm_otel")

PROVIDER = "triton"
_W3C = TraceContextTextMapPropagator()  # Triton reads only W3C trace context
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


class ClientInstruments:
    """GenAI client histograms (seconds), created once per meter with the semconv bucket advisories.

    * ``gen_ai.client.operation.duration``: call -> last response or error, every call.
    * ``gen_ai.client.operation.time_to_first_chunk``: call -> first response, successful streams.
    * ``gen_ai.client.operation.time_per_output_chunk``: each gap between consecutive responses
      after the first, successful streams.
    """

    def __init__(self, meter) -> None:
        def hist(name, unit, buckets, description):
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(buckets))

        self.duration = hist(M.GEN_AI_CLIENT_OPERATION_DURATION, M.GEN_AI_CLIENT_OPERATION_DURATION_UNIT,
                             M.GEN_AI_CLIENT_OPERATION_DURATION_BUCKETS, "GenAI operation duration.")
        self.first_chunk = hist(M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
                                M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK_UNIT,
                                M.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK_BUCKETS,
                                "Time to the first chunk of a streamed response.")
        self.per_chunk = hist(M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK,
                              M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK_UNIT,
                              M.GEN_AI_CLIENT_OPERATION_TIME_PER_OUTPUT_CHUNK_BUCKETS,
                              "Time between consecutive chunks of a streamed response.")


class Call:
    """One inference request: its span and the client-side times of its responses.

    ``start_mono``/``times`` are ``time.monotonic()`` seconds; ``offset_ns`` maps them to epoch ns.
    """

    __slots__ = ("span", "recording", "request_id", "metric_attrs", "start_mono", "offset_ns",
                 "times", "streaming", "finished", "end_reason", "lock", "expected", "problem")

    def __init__(self, span, request_id: str, metric_attrs: dict, streaming: bool,
                 expected: tuple[str, ...] = ()) -> None:
        self.expected = expected  # output names the caller requested (``outputs=``)
        self.problem: str | None = None  # first malformed-response finding of a stream request
        self.span = span
        self.recording = span.is_recording()
        self.request_id = request_id
        self.metric_attrs = metric_attrs
        self.offset_ns = mono_offset_ns()
        self.start_mono = time.monotonic()
        self.times = array("d")
        self.streaming = streaming
        self.finished = False
        self.end_reason: str | None = None
        self.lock = threading.Lock()

    def epoch_ns(self, mono_s: float) -> int:
        return round(mono_s * 1e9) + self.offset_ns


class StreamState:
    """One gRPC stream: its span, the requests in flight on it (by request id, oldest first) and
    the raw response tritonclient is handing to the callback right now (stream thread only)."""

    def __init__(self, span, client: str, server_attrs: dict) -> None:
        self.span = span
        self.client = client
        self.server_attrs = server_attrs
        self.lock = threading.Lock()
        self.inflight: dict[str, deque[Call]] = {}
        self.requests = 0
        self.last_raw: Any = None
        self.error: BaseException | None = None
        self.closed = False
        self.cancelling = False  # stop_stream(cancel_requests=True) is running

    def add(self, call: Call) -> None:
        with self.lock:
            self.requests += 1
            self.inflight.setdefault(call.request_id, deque()).append(call)

    def lookup(self, request_id: str) -> Call | None:
        with self.lock:
            calls = self.inflight.get(request_id)
            if calls:
                return calls[0]
            if len(self.inflight) == 1:  # the server echoes the id; an unknown one can only be ours
                (only,) = self.inflight.values()
                return only[0] if len(only) == 1 else None
            return None

    def remove(self, call: Call) -> None:
        with self.lock:
            calls = self.inflight.get(call.request_id)
            if calls:
                try:
                    calls.remove(call)
                except ValueError:
                    pass
                if not calls:
                    del self.inflight[call.request_id]

    def drain(self) -> list[Call]:
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
    except Exception:  # noqa: BLE001
        pass
    status = None
    try:
        status = exc.status() if callable(getattr(exc, "status", None)) else None
    except Exception:  # noqa: BLE001
        status = None
    if isinstance(status, str) and status:
        return status.removeprefix("StatusCode.")
    if status is not None and not isinstance(status, str):
        return str(status)
    return type(exc).__qualname__


CANCELLED = "cancelled"


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
    except Exception as exc:  # noqa: BLE001
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
        except Exception:  # noqa: BLE001
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
        except Exception:  # noqa: BLE001
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


def _percentiles(values: np.ndarray) -> tuple[float, float, float, float]:
    p50, p90, p99 = np.percentile(values, (50, 90, 99))
    return float(p50), float(p90), float(p99), float(values.max())


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


class TritonAdapter:
    """The wrapper factories named in :data:`llm_otel.instrumentation.triton.hooks.HOOKS`."""

    def __init__(self, telemetry: Telemetry, meter_provider=None) -> None:
        from llm_otel.version import __version__

        self.telemetry = telemetry
        self.tracer = telemetry.tracer
        self.settings = telemetry.settings
        self.errors = telemetry.errors
        meter = get_meter("llm_otel.instrumentation.triton", __version__, meter_provider, schema_url=SCHEMA_URL)
        self.instruments = ClientInstruments(meter)
        self._sigs = _Signatures()
        self._urls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # grpc client -> server attrs
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # InferAsyncRequest -> Call
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
        except Exception:  # noqa: BLE001
            return {}

    def _start_call(self, flavour: str, client: Any, model: Any, version: Any, request_id: Any,
                    inputs: Any, parameters: Any, streaming: bool, parent=None,
                    links: list | None = None, outputs: Any = None) -> Call:
        llm, req_attrs = request_attributes(inputs, parameters)
        operation = "text_completion" if llm else "infer"
        model = str(model)
        server = self._server(client)
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: operation,
            A.GEN_AI_PROVIDER_NAME: PROVIDER,
            A.GEN_AI_REQUEST_MODEL: model,
            A.LLM_TRITON_CLIENT: flavour,
            **server,
            **req_attrs,
        }
        if streaming:
            attrs[A.GEN_AI_REQUEST_STREAM] = True
        if version:
            attrs[A.LLM_TRITON_MODEL_VERSION] = str(version)
        if request_id:
            attrs[A.LLM_REQUEST_ID] = str(request_id)
        span = self.tracer.start_span(f"{operation} {model}", context=parent, kind=SpanKind.CLIENT,
                                      attributes=attrs, links=links)
        metric_attrs = {A.GEN_AI_OPERATION_NAME: operation, A.GEN_AI_PROVIDER_NAME: PROVIDER,
                        A.GEN_AI_REQUEST_MODEL: model, **server}
        return Call(span, str(request_id or ""), metric_attrs, streaming, _expected(outputs))

    @staticmethod
    def _headers_with_context(headers: Any, span) -> dict:
        """A new dict: the caller's headers plus ``traceparent``/``tracestate`` of ``span``."""
        out = dict(headers) if headers else {}
        for key in [k for k in out if isinstance(k, str) and k.lower() in ("traceparent", "tracestate")]:
            del out[key]
        _W3C.inject(out, context=trace.set_span_in_context(span))
        return out

    def _malformed(self, call: Call, result: Any) -> _Malformed | None:
        """The finding of :func:`response_problem` on a unary call's ``InferResult``, or None."""
        if result is None:
            return None
        try:
            response = result.get_response()
        except Exception as exc:  # noqa: BLE001
            return _Malformed(f"unreadable response ({type(exc).__name__})")
        problem = response_problem(response, call.expected, streaming=False)
        return _Malformed(problem) if problem else None

    def _on_response(self, call: Call, now: float | None = None) -> None:
        """Hot path: one response arrived (monotonic seconds)."""
        call.times.append(time.monotonic() if now is None else now)

    def finish(self, call: Call, error: BaseException | None = None, end_reason: str | None = None,
               end_mono: float | None = None) -> None:
        """End ``call`` exactly once: ``llm.token_stream`` (streams with responses), status, metrics."""
        with call.lock:
            if call.finished:
                return
            call.finished = True
        try:
            if error is None and call.problem is not None:
                error = _Malformed(call.problem)
            end = time.monotonic() if end_mono is None else end_mono
            end_ns = call.epoch_ns(end)
            error_type = _error_type(error) if error is not None else None
            if call.streaming:
                call.end_reason = end_reason or ("error" if error is not None else "stream_end")
            if call.recording:
                self._emit(call, end_ns, error, error_type)
            else:
                call.span.end(end_time=end_ns)
            attrs = call.metric_attrs
            if error_type is not None:
                attrs = {**attrs, A.ERROR_TYPE: error_type}
            self.instruments.duration.record(max(0.0, end - call.start_mono), attrs)
            if error_type is None and call.streaming and call.times:
                self.instruments.first_chunk.record(max(0.0, call.times[0] - call.start_mono), attrs)
                for gap in np.diff(np.frombuffer(call.times, dtype=np.float64)):
                    self.instruments.per_chunk.record(float(gap), attrs)
        except Exception as exc:  # noqa: BLE001
            self.errors.report("triton.finish", exc)
            try:
                call.span.end()
            except Exception:  # noqa: BLE001
                pass

    def _emit(self, call: Call, end_ns: int, error: BaseException | None, error_type: str | None) -> None:
        span = call.span
        start_ns = span.start_time if getattr(span, "start_time", None) else call.epoch_ns(call.start_mono)
        end_ns = max(end_ns, start_ns)
        if call.streaming:
            span.set_attribute(A.LLM_STREAM_RESPONSES, len(call.times))
            span.set_attribute(A.LLM_STREAM_END, call.end_reason)
            if call.times:
                self._token_stream(call, start_ns, end_ns, error_type)
        if error_type is not None:
            span.set_attribute(A.ERROR_TYPE, error_type)
            if error_type != CANCELLED:  # cancelling is the application's choice, not a failure
                # server messages can quote the request's input: the text only with content capture
                # on; a malformed-response finding names outputs and data types only
                detail = self.telemetry.truncate(str(error)) \
                    if self.settings.capture_content or isinstance(error, _Malformed) else error_type
                span.set_status(Status(StatusCode.ERROR, detail))
        span.end(end_time=end_ns)

    def _token_stream(self, call: Call, start_ns: int, end_ns: int, error_type: str | None) -> None:
        times = np.frombuffer(call.times, dtype=np.float64)
        clamp = lambda t: min(max(t, start_ns), end_ns)  # noqa: E731
        first_ns, last_ns = clamp(call.epoch_ns(times[0])), clamp(call.epoch_ns(times[-1]))
        attrs: dict[str, Any] = {
            A.LLM_STREAM_RESPONSES: len(times),
            A.LLM_TIME_TO_FIRST_TOKEN: max(0.0, float(times[0] - call.start_mono)),
            A.LLM_STREAM_END: call.end_reason,
        }
        gaps = np.diff(times, prepend=call.start_mono)
        if len(times) > 1:
            p50, p90, p99, mx = _percentiles(gaps[1:])
            attrs.update({A.LLM_STREAM_RESPONSE_GAP_P50: p50, A.LLM_STREAM_RESPONSE_GAP_P90: p90,
                          A.LLM_STREAM_RESPONSE_GAP_P99: p99, A.LLM_STREAM_RESPONSE_GAP_MAX: mx})
        n_ev = min(len(times), self.settings.token_events)
        attrs[A.LLM_TOKEN_EVENTS_DROPPED] = len(times) - n_ev
        if error_type is not None:
            attrs[A.ERROR_TYPE] = error_type
        span = self.tracer.start_span(S.LLM_TOKEN_STREAM, context=trace.set_span_in_context(call.span),
                                      kind=SpanKind.INTERNAL, start_time=first_ns, attributes=attrs)
        for i in range(n_ev):
            span.add_event(S.EVENT_LLM_STREAM_RESPONSE,
                           {A.LLM_STREAM_RESPONSE_INDEX: i, A.LLM_STREAM_RESPONSE_GAP: float(gaps[i])},
                           timestamp=clamp(call.epoch_ns(times[i])))
        if error_type is not None and error_type != CANCELLED:
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end(end_time=last_ns)

    def _begin(self, hook: str, fn: Callable[[], Any]) -> Any:
        """Run llm-otel's own set-up; on failure report once and return None (call goes on bare)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            self.errors.report(hook, exc)
            return None

    # --- unary calls ----------------------------------------------------------------------------
    def _prepare_unary(self, flavour: str, wrapped, instance, args, kwargs, streaming=False):
        bound = self._sigs.bind(wrapped, args, kwargs)
        if bound is None:
            return None
        a = bound.arguments
        call = self._start_call(flavour, instance, a.get("model_name"), a.get("model_version"),
                                a.get("request_id"), a.get("inputs"), a.get("parameters"), streaming,
                                outputs=a.get("outputs"))
        a["headers"] = self._headers_with_context(a.get("headers"), call.span)
        return call, bound

    def http_infer(self, qualname: str):
        return self._sync_infer(qualname, "http")

    def grpc_infer(self, qualname: str):
        return self._sync_infer(qualname, "grpc")

    def _sync_infer(self, qualname: str, flavour: str):
        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: self._prepare_unary(flavour, wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            call, bound = prepared
            try:
                with trace.use_span(call.span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    result = wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self.finish(call, error=exc)
                raise
            self.finish(call, error=self._malformed(call, result))
            return result

        return wrapper

    def aio_infer(self, qualname: str):
        flavour = "http.aio" if qualname.startswith("tritonclient.http") else "grpc.aio"

        async def run(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: self._prepare_unary(flavour, wrapped, instance, args, kwargs))
            if prepared is None:
                return await wrapped(*args, **kwargs)
            call, bound = prepared
            try:
                with trace.use_span(call.span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    result = await wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self.finish(call, error=exc)
                raise
            self.finish(call, error=self._malformed(call, result))
            return result

        def wrapper(wrapped, instance, args, kwargs):
            return run(wrapped, instance, args, kwargs)

        return wrapper

    def http_async_infer(self, qualname: str):
        def wrapper(wrapped, instance, args, kwargs):
            # the POST runs later in a gevent greenlet with an empty context: inject here
            prepared = self._begin(qualname, lambda: self._prepare_unary("http", wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            call, bound = prepared
            try:
                handle = wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self.finish(call, error=exc)
                raise
            try:
                with self._lock:
                    self._pending[handle] = call
            except Exception as exc:  # noqa: BLE001
                self.errors.report(qualname, exc)
                self.finish(call)
            return handle

        return wrapper

    def http_get_result(self, qualname: str):
        def wrapper(wrapped, instance, args, kwargs):
            with self._lock:
                call = self._pending.get(instance)
            try:
                result = wrapped(*args, **kwargs)
            except BaseException as exc:
                if call is not None and self._done(instance):
                    self._forget(instance)
                    self.finish(call, error=exc)
                raise
            if call is not None:
                self._forget(instance)
                self.finish(call, error=self._malformed(call, result))
            return result

        return wrapper

    @staticmethod
    def _done(handle) -> bool:
        """False while a get_result timeout left the request running (retrieved later)."""
        try:
            return bool(handle._greenlet.ready())
        except Exception:  # noqa: BLE001
            return True

    def _forget(self, handle) -> None:
        with self._lock:
            self._pending.pop(handle, None)

    def grpc_async_infer(self, qualname: str):
        def prepare(wrapped, instance, args, kwargs):
            prepared = self._prepare_unary("grpc", wrapped, instance, args, kwargs)
            if prepared is None:
                return None
            call, bound = prepared
            user_callback = bound.arguments["callback"]

            def callback(*cb_args, **cb_kwargs):
                # gRPC's callback thread: end the span first, then the user's callback, exactly once
                error = cb_kwargs.get("error", cb_args[1] if len(cb_args) > 1 else None)
                if error is None:
                    error = self._malformed(call, cb_kwargs.get("result", cb_args[0] if cb_args else None))
                self.finish(call, error=error)
                return user_callback(*cb_args, **cb_kwargs)

            bound.arguments["callback"] = callback
            return call, bound

        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            call, bound = prepared
            try:
                with trace.use_span(call.span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    return wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self.finish(call, error=exc)
                raise

        return wrapper

    def remember_url(self, qualname: str):
        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            try:
                url = kwargs["url"] if "url" in kwargs else (args[0] if args else None)
                self._urls[instance] = _url_server(url)
            except Exception as exc:  # noqa: BLE001
                self.errors.report(qualname, exc)
            return result

        return wrapper

    # --- gRPC streams ---------------------------------------------------------------------------
    def _start_stream_span(self, flavour: str, client: Any) -> StreamState:
        server = self._server(client)
        span = self.tracer.start_span(S.LLM_TRITON_STREAM, kind=SpanKind.CLIENT, attributes={
            A.GEN_AI_PROVIDER_NAME: PROVIDER, A.LLM_TRITON_CLIENT: flavour, **server})
        return StreamState(span, flavour, server)

    def _stream_request(self, state: StreamState, client: Any, model, version, request_id, inputs,
                        parameters) -> Call:
        """A request on a stream: child of the caller's span when there is one, else of the stream
        span; always linked to the stream span, whose context Triton's spans carry."""
        current = trace.get_current_span()
        parent = None if current.get_span_context().is_valid else trace.set_span_in_context(state.span)
        call = self._start_call(state.client, client, model, version, request_id, inputs, parameters,
                                streaming=True, parent=parent, links=[Link(state.span.get_span_context())])
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
        except Exception:  # noqa: BLE001
            final = False
        if error is not None:
            state.remove(call)
            self.finish(call, error=error, end_reason="error", end_mono=now)
            return
        empty = len(response.outputs) == 0
        if not empty:
            self._on_response(call, now)
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
        span = state.span
        span.set_attribute(A.LLM_TRITON_STREAM_REQUESTS, state.requests)
        if cancelled:
            span.set_attribute(A.ERROR_TYPE, CANCELLED)  # no error status: the application's choice
        elif error is not None:
            error_type = _error_type(error)
            span.set_attribute(A.ERROR_TYPE, error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end()

    def grpc_start_stream(self, qualname: str):
        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None or getattr(instance, "_stream", None) is not None:
                return None  # tritonclient refuses a second stream; nothing to trace
            state = self._start_stream_span("grpc", instance)
            user_callback = bound.arguments["callback"]

            def callback(*cb_args, **cb_kwargs):
                try:
                    result = cb_kwargs.get("result", cb_args[0] if cb_args else None)
                    error = cb_kwargs.get("error", cb_args[1] if len(cb_args) > 1 else None)
                    self._observe(state, result, error)
                except Exception as exc:  # noqa: BLE001
                    self.errors.report("triton.stream_callback", exc)
                return user_callback(*cb_args, **cb_kwargs)

            callback._llm_otel_stream = state  # found again by grpc_stream_handler
            bound.arguments["callback"] = callback
            bound.arguments["headers"] = self._headers_with_context(bound.arguments.get("headers"), state.span)
            return state, bound

        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            state, bound = prepared
            try:
                with trace.use_span(state.span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    result = wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self._end_stream(state, error=exc)
                raise
            with self._lock:
                self._streams[instance] = state
            return result

        return wrapper

    def grpc_stream_handler(self, qualname: str):
        """Wraps the response iterator so the callback wrapper sees each raw response (tritonclient
        drops the request id of error responses)."""

        def wrapper(wrapped, instance, args, kwargs):
            state = getattr(getattr(instance, "_callback", None), "_llm_otel_stream", None)
            if state is not None and args:
                args = (_PeekIterator(args[0], state),) + tuple(args[1:])
            return wrapped(*args, **kwargs)

        return wrapper

    def grpc_async_stream_infer(self, qualname: str):
        def prepare(wrapped, instance, args, kwargs):
            with self._lock:
                state = self._streams.get(instance)
            if state is None or state.closed:
                return None
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            a = bound.arguments
            return self._stream_request(state, instance, a.get("model_name"), a.get("model_version"),
                                        a.get("request_id"), a.get("inputs"), a.get("parameters")), state

        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            call, state = prepared
            try:
                return wrapped(*args, **kwargs)
            except BaseException as exc:
                state.remove(call)
                self.finish(call, error=exc)
                raise

        return wrapper

    def grpc_stop_stream(self, qualname: str):
        def wrapper(wrapped, instance, args, kwargs):
            with self._lock:
                state = self._streams.pop(instance, None)
            cancel = False
            if state is not None:
                bound = self._sigs.bind(wrapped, args, kwargs)
                cancel = bool(bound is not None and bound.arguments.get("cancel_requests"))
                state.cancelling = cancel
            try:
                result = wrapped(*args, **kwargs)
            finally:
                if state is not None:
                    try:
                        self._end_stream(state, cancelled=cancel)
                    except Exception as exc:  # noqa: BLE001
                        self.errors.report(qualname, exc)
            return result

        return wrapper

    def aio_stream_infer(self, qualname: str):
        def prepare(wrapped, instance, args, kwargs):
            bound = self._sigs.bind(wrapped, args, kwargs)
            if bound is None:
                return None
            state = self._start_stream_span("grpc.aio", instance)
            bound.arguments["headers"] = self._headers_with_context(bound.arguments.get("headers"), state.span)
            bound.arguments["inputs_iterator"] = self._aio_requests(state, instance,
                                                                    bound.arguments["inputs_iterator"])
            return state, bound

        def wrapper(wrapped, instance, args, kwargs):
            prepared = self._begin(qualname, lambda: prepare(wrapped, instance, args, kwargs))
            if prepared is None:
                return wrapped(*args, **kwargs)
            state, bound = prepared
            try:
                with trace.use_span(state.span, end_on_exit=False, record_exception=False,
                                    set_status_on_exception=False):
                    responses = wrapped(*bound.args, **bound.kwargs)
            except BaseException as exc:
                self._end_stream(state, error=exc)
                raise
            try:
                grpc_call = responses._grpc_call
                responses._grpc_call = _PeekAioCall(grpc_call, state)
            except Exception as exc:  # noqa: BLE001 - still traced, without error request ids
                self.errors.report(qualname, exc)
            return _AioResponses(responses, self, state)

        return wrapper

    async def _aio_requests(self, state: StreamState, client: Any, inputs_iterator):
        async for item in inputs_iterator:
            if isinstance(item, dict):
                try:
                    self._stream_request(state, client, item.get("model_name"), item.get("model_version"),
                                         item.get("request_id"), item.get("inputs"), item.get("parameters"))
                except Exception as exc:  # noqa: BLE001
                    self.errors.report("triton.aio_stream_request", exc)
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
            try:
                self._self_adapter._end_stream(state, cancelled=True)
            except Exception as exc:  # noqa: BLE001
                self._self_adapter.errors.report("triton.aio_stream", exc)

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
    try:
        state.closed = True
        now = time.monotonic()
        for call in state.drain():
            adapter.finish(call, error=_Cancelled("the response iterator was dropped"), end_reason="abandoned",
                           end_mono=now)
        span = state.span
        span.set_attribute(A.LLM_TRITON_STREAM_REQUESTS, state.requests)
        span.set_attribute(A.ERROR_TYPE, CANCELLED)
        span.end()
    except Exception as exc:  # noqa: BLE001 - runs from the garbage collector
        adapter.errors.report("triton.aio_stream_abandoned", exc)
