"""Request-class settings: the dimensions, the ``LLM_OTEL_CLASS_HEADERS`` sources and what a
class value may contain. :class:`llm_otel.signals.classes.ClassExtractor` applies them to requests
(rules: :mod:`llm_otel.signals.classes`)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from llm_otel.config.parse import ConfigError

__all__ = [
    "CLASS_DIMENSIONS",
    "ENGINE_PRIORITY",
    "ENGINE_LORA",
    "ENGINE_FIELDS",
    "CLASS_VALUE",
    "HEADER_NAME",
    "parse_class_sources",
    "read_class_sources",
]

#: the request-class dimensions (each has a span attribute, :data:`llm_otel.signals.classes.DIMENSIONS`)
CLASS_DIMENSIONS = ("tenant", "priority", "operation", "revision")
#: engine request fields a dimension may come from: vLLM ``EngineCoreRequest.priority`` (an int) and
#: the LoRA adapter name of ``EngineCoreRequest.lora_request``
ENGINE_PRIORITY, ENGINE_LORA = "engine:priority", "engine:lora"
ENGINE_FIELDS = {ENGINE_PRIORITY, ENGINE_LORA}
#: a class value that may become a metric label (also ``LLM_OTEL_MODEL_REVISION``)
CLASS_VALUE = re.compile(r"[A-Za-z0-9._:/@+\-]+")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~\-]+")  # RFC 9110 token


def parse_class_sources(raw: str | None, name: str = "LLM_OTEL_CLASS_HEADERS") -> dict[str, str]:
    """``"tenant:x-tenant-id,priority:engine:priority"`` -> ``{"tenant": "x-tenant-id", ...}``
    (header names lower-cased). Raises ConfigError naming the bad entry."""
    out: dict[str, str] = {}
    if not raw or not raw.strip():
        return out
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        dim, sep, source = entry.partition(":")
        dim, source = dim.strip().lower(), source.strip().lower()
        if not sep or dim not in CLASS_DIMENSIONS:
            raise ConfigError(
                f"{name}: entry {entry!r}: expected dimension:source with dimension one of {sorted(CLASS_DIMENSIONS)}"
            )
        if source.startswith("engine:"):
            if source not in ENGINE_FIELDS:
                raise ConfigError(f"{name}: entry {entry!r}: engine field must be one of {sorted(ENGINE_FIELDS)}")
        elif not HEADER_NAME.fullmatch(source):
            raise ConfigError(f"{name}: entry {entry!r}: {source!r} is not an HTTP header name")
        if dim in out:
            raise ConfigError(f"{name}: entry {entry!r}: dimension {dim!r} given twice")
        out[dim] = source
    return out


def read_class_sources(env: Mapping[str, str], name: str, default: Mapping[str, str]) -> Mapping[str, str]:
    """The parser of ``LLM_OTEL_CLASS_HEADERS`` (:func:`parse_class_sources`); unset or blank -> ``default``."""
    raw = env.get(name)
    if not raw or not raw.strip():
        return default
    return parse_class_sources(raw, name)
