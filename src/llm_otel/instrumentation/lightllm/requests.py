"""LightLLM's request objects as plain values, in every LightLLM process: request ids, a
``FinishStatus``, the bound arguments of a hooked call, the served model, and a sub-request leaving
a process (router or model-infer worker) - what the HTTP worker (:mod:`.http`), the router
(:mod:`.router`) and the model-infer worker (:mod:`.worker`) share.
"""

from __future__ import annotations

import inspect
import json
import math
import operator
import os
from collections.abc import Mapping
from typing import Any

from llm_otel.errors import guard
from llm_otel.instrumentation.lightllm import carrier as C
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.stages import StageRecord
from llm_otel.version import installed_version

PROVIDER = "lightllm"
MAX_LIVE = 100_000  # per-process cap on tracked requests (aborted/lost ones cannot leak past it)


def request_id(value: Any) -> int | None:
    """A LightLLM request id as a Python int, or None when ``value`` is not an integer.

    LightLLM's ids are ``numpy.int64``: ``ReqIDGenerator.generate_id()`` reads them from a numpy
    array in shared memory (``lightllm/server/req_id_generator.py``), and ``group_request_id + i``
    stays one; ids read back from a ctypes ``Req`` struct are Python ints. Any integer type is
    accepted (``operator.index``); ``bool`` is not an id.
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def bind(wrapped, args, kwargs) -> dict:
    """The call's arguments by name (those given; ``{}`` when they do not fit the signature)."""
    try:
        return inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}


def finish_info(finish_status: Any) -> tuple[bool, bool, str | None]:
    """(finished, aborted, reason) of a LightLLM ``FinishStatus``."""
    try:
        finished = bool(finish_status.is_finished())
    except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
        return False, False, None
    aborted = False
    try:
        aborted = bool(finish_status.is_aborted())
    except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
        pass
    reason = None
    if finished and not aborted:
        try:
            reason = finish_status.get_finish_reason()
        except Exception:  # noqa: BLE001 - silent: feature probe of a FinishStatus layout
            reason = None
    return finished, aborted, reason if isinstance(reason, str) else None


def sampling_attributes(sampling_params: Any) -> dict[str, Any]:
    """Request-span attributes of a LightLLM ``SamplingParams``: ``gen_ai.request.max_tokens``
    (``max_new_tokens``), ``top_k`` (``top_k``; -1 = disabled, left out), ``temperature``,
    ``top_p`` and ``gen_ai.request.choice_count`` (``n``, else ``best_of``, when above 1)."""
    sp = sampling_params
    attrs: dict[str, Any] = {}
    value = getattr(sp, "max_new_tokens", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = value
    value = getattr(sp, "top_k", None)  # LightLLM: -1 = disabled
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        attrs[A.GEN_AI_REQUEST_TOP_K] = float(value)
    for attr, field in ((A.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (A.GEN_AI_REQUEST_TOP_P, "top_p")):
        value = getattr(sp, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            attrs[attr] = float(value)
    n = getattr(sp, "n", None) or getattr(sp, "best_of", None)
    if isinstance(n, int) and n > 1:
        attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = n
    return attrs


def model_name(env: Mapping[str, str] | None = None, args: Any = None) -> str:
    """Served model name: ``args.model_name`` unless it is LightLLM's default
    (``"default_model_name"``), else the last part of ``args.model_dir``; "unknown" without either.

    ``args`` is the start-args object ``HttpServerManager`` is built with (an attribute object or a
    mapping); without it (or when it names no model) the JSON in ``LIGHTLLM_START_ARGS`` that every
    LightLLM process inherits is read, from ``env`` (default ``os.environ``) at call time.
    """
    for source in (args, None):
        if source is None:
            env = os.environ if env is None else env
            try:
                source = json.loads(env.get("LIGHTLLM_START_ARGS") or "{}")
            except ValueError:
                return "unknown"
        get = source.get if isinstance(source, dict) else (lambda key, s=source: getattr(s, key, None))
        name = get("model_name")
        if isinstance(name, str) and name and name != "default_model_name":
            return name
        model_dir = get("model_dir")
        if isinstance(model_dir, str) and model_dir.rstrip("/"):
            return os.path.basename(model_dir.rstrip("/"))
    return "unknown"


def engine_version() -> str:
    """The installed LightLLM's version, ``""`` when unknown."""
    return installed_version("lightllm")


def end_stage(telemetry: Telemetry, reqs: dict[int, StageRecord], rid: int, facts: dict) -> None:
    """Sub-request ``rid`` left this process (router or worker): its record, popped from ``reqs``,
    gets the facts read off LightLLM's request as it left (``read`` of its process: input/output/cached tokens,
    finish reason, aborted), the core builds its span; the carrier is dropped once no choice of its
    group is left here."""
    st = reqs.pop(rid)
    if isinstance(facts["input"], int):  # else the length read at admission / first token
        st.input_tokens = facts["input"]
    if isinstance(facts.get("output"), int):  # router: the engine's count; the worker counts its own
        st.output_tokens = facts["output"]
    st.cached_tokens = facts["cache"]
    st.finish_reason = facts["reason"]
    st.aborted = facts["aborted"]
    telemetry.end_stage(st)
    if not any(r.group_id == st.group_id for r in reqs.values()):
        C.TABLE.pop(st.group_id)


def read_then_call(telemetry: Telemetry, hook: str, read):
    """A wrapper that hands a call's arguments to ``read(wrapped, args, kwargs)`` first (failures
    counted under ``hook``, never raised), then calls LightLLM as it was called."""

    def wrapper(wrapped, instance, args, kwargs):
        with guard(hook, telemetry.errors):
            read(wrapped, args, kwargs)
        return wrapped(*args, **kwargs)

    return wrapper
