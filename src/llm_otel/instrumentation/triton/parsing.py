"""Reads tritonclient's calls and responses as plain values: which arguments a call has (bound with
``inspect.signature``), the GenAI request attributes in its inputs and parameters, the server
address of a client, what an error is called (``InferenceServerException.status()``, gRPC codes),
whether a response has what was asked for, and whether a stream response is a request's last.

Fields read (tritonclient 2.x): ``InferInput.name() / datatype() / _data / _raw_data /
_raw_content`` (http and grpc), ``InferRequestedOutput.name()``, ``InferResult.get_response()``
(a gRPC ``ModelInferResponse`` or the HTTP JSON dict: ``outputs[].name / datatype``, ``id``,
``parameters["triton_final_response"].bool_param``), the http client's ``_parsed_url`` (host,
port) and the http.aio client's ``_url``; ``tritonclient.utils.triton_to_np_dtype``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from llm_otel.semconv import attributes as A
from llm_otel.telemetry.client import CANCELLED

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


def error_type(exc: BaseException) -> str:
    """``InferenceServerException.status()`` when it has one (``StatusCode.UNAVAILABLE``, ``400``),
    a gRPC error's ``code()`` name (``DEADLINE_EXCEEDED``: grpc.aio raises ``AioRpcError``),
    ``cancelled`` for a cancellation, else the exception's class name."""
    if isinstance(exc, asyncio.CancelledError):
        return CANCELLED
    try:
        code_of = getattr(exc, "code", None)
        code = code_of() if callable(code_of) else None
        if code is not None and isinstance(getattr(code, "name", None), str):
            return code.name
    except Exception:  # noqa: BLE001 - silent: feature probe of the exception's gRPC code
        pass
    status = None
    try:
        status_of = getattr(exc, "status", None)
        status = status_of() if callable(status_of) else None
    except Exception:  # noqa: BLE001 - silent: feature probe of the exception's status
        status = None
    if isinstance(status, str) and status:
        return status.removeprefix("StatusCode.")
    if status is not None and not isinstance(status, str):
        return str(status)
    return type(exc).__qualname__


class Malformed(Exception):
    """A success response that does not have what the call asked for (description in the message:
    output names and data types only, never content)."""

    def status(self) -> str:
        return "malformed_response"


def outputs_of(response: Any) -> list[tuple[str, str]]:
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
        outputs = outputs_of(response)
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


def expected_outputs(outputs: Any) -> tuple[str, ...]:
    """Names of the outputs a call asked for (its ``InferRequestedOutput`` objects)."""
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
        return bytes(raw[4 : 4 + n]).decode("utf-8", "replace")
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


def url_server(url: Any) -> dict[str, Any]:
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


class Signatures:
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


def flavour(qualname: str) -> str:
    """``http``, ``http.aio``, ``grpc`` or ``grpc.aio``: the client a hook's ``module:target`` belongs to."""
    module = qualname.partition(":")[0]
    kind = "http" if module.startswith("tritonclient.http") else "grpc"
    return f"{kind}.aio" if module.endswith(".aio") else kind


class Cancelled(Exception):
    """Stands for the cancellation of requests still open when the stream was stopped."""

    def status(self) -> str:
        return "cancelled"


def client_server(client: Any, known: Any) -> dict[str, Any]:
    """``server.address``/``server.port`` of a tritonclient client: the http client's parsed URL,
    the http.aio client's URL, else what ``known`` (client -> attributes, remembered from a gRPC
    client's ``__init__``) holds; ``{}`` when none says."""
    try:
        parsed = getattr(client, "_parsed_url", None)  # tritonclient.http (geventhttpclient URL)
        if parsed is not None:
            return {A.SERVER_ADDRESS: parsed.host, A.SERVER_PORT: int(parsed.port)}
        url = getattr(client, "_url", None)  # tritonclient.http.aio ("http://host:port")
        if isinstance(url, str):
            return url_server(url)
        return dict(known.get(client, {}))
    except Exception:  # noqa: BLE001 - silent: feature probe: server address unknown
        return {}


def is_final(response: Any) -> bool:
    """Whether a stream response carries ``triton_final_response`` = true (decoupled models)."""
    try:
        if FINAL_PARAM in response.parameters:
            return bool(response.parameters[FINAL_PARAM].bool_param)
    except Exception:  # noqa: BLE001 - silent: feature probe: a response without the final flag
        pass
    return False
