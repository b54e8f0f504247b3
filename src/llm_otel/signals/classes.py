"""Request classes (tenant, priority, operation, model revision) from inbound headers or engine
request fields, sanitised and bounded so they can be metric labels.

Configuration: ``LLM_OTEL_CLASS_HEADERS`` lists ``dimension:source`` pairs, comma-separated, e.g.
``tenant:x-tenant-id,priority:x-priority,revision:x-model-revision``. A source is an HTTP header
name (case-insensitive) or ``engine:priority`` (vLLM ``EngineCoreRequest.priority``, an int) or
``engine:lora`` (the LoRA adapter name of ``EngineCoreRequest.lora_request``). Dimensions:
``tenant``, ``priority``, ``operation``, ``revision``.

Rules for each value (docs/signals.md):

* missing or empty -> the dimension is absent (no attribute, no label);
* the header present more than once with different values -> ``other`` (``duplicate``);
* longer than ``LLM_OTEL_CLASS_MAX_LEN`` characters -> ``other`` (``oversized``);
* any character outside ASCII letters, digits and ``. _ - : / @ +`` -> ``other`` (``invalid``):
  non-ASCII, quotes, braces, ``=``, ``,``, whitespace and control characters never reach a label;
* metric labels: the first ``LLM_OTEL_CLASS_MAX_VALUES`` distinct values per dimension, plus
  every value the tier table names, keep their own label; later ones become ``other``
  (``overflow``). Span attributes keep a valid value even when its metric label overflowed.

Every collapse is counted in ``llm_otel.request_class.collapsed`` (dimension, reason). The
settings (sources, bounds, defaults) are :class:`llm_otel.config.SignalsConfig`'s; the sources
are parsed by :func:`llm_otel.config.classes.parse_class_sources`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from llm_otel.config.classes import CLASS_DIMENSIONS, CLASS_VALUE, ENGINE_FIELDS, ENGINE_LORA, ENGINE_PRIORITY
from llm_otel.config.signals import SignalsConfig
from llm_otel.errors import guard
from llm_otel.semconv import attributes as A

logger = logging.getLogger("llm_otel")

__all__ = ["ClassExtractor", "DIMENSIONS", "OTHER", "ENGINE_PRIORITY", "ENGINE_LORA", "ENGINE_FIELDS", "header_values"]

OTHER = "other"
_ATTRIBUTES = {
    "tenant": A.LLM_REQUEST_TENANT,
    "priority": A.LLM_REQUEST_PRIORITY,
    "operation": A.LLM_REQUEST_OPERATION,
    "revision": A.LLM_REQUEST_MODEL_REVISION,
}
#: dimension -> span attribute, for every request-class dimension the configuration knows
DIMENSIONS = {dim: _ATTRIBUTES[dim] for dim in CLASS_DIMENSIONS}
_DEFAULTS = SignalsConfig()


def header_values(headers: Any, name: str) -> list[str]:
    """All values of header ``name`` (lower-case) in a Starlette/aiohttp multi-dict, a list of
    pairs or a plain mapping. Never raises; unknown shapes give []."""
    try:
        if headers is None:
            return []
        getlist = getattr(headers, "getlist", None) or getattr(headers, "getall", None)
        if getlist is not None:
            try:
                return [str(v) for v in getlist(name)]
            except KeyError:  # aiohttp getall without default
                return []
        items = headers.items() if isinstance(headers, Mapping) else headers
        return [str(v) for k, v in items if str(k).lower() == name]
    except Exception:  # noqa: BLE001 - silent: hostile or odd header objects
        return []


class ClassExtractor:
    """Turns one request's headers and engine fields into bounded class attributes.

    Args:
        sources: ``SignalsConfig.class_sources`` (:func:`llm_otel.config.classes.parse_class_sources`).
        max_values: distinct metric labels per dimension before ``other``.
        max_len: longest accepted value (characters).
        reserved: values always given their own label (those the tier table names), per dimension.
        on_collapse: ``(dimension, reason)`` callback, e.g. a counter's ``add``.
    """

    def __init__(
        self,
        sources: Mapping[str, str],
        max_values: int = _DEFAULTS.class_max_values,
        max_len: int = _DEFAULTS.class_max_len,
        reserved: Mapping[str, Iterable[str]] | None = None,
        on_collapse=None,
    ) -> None:
        self.sources = dict(sources)
        self.max_values = max_values
        self.max_len = max_len
        self.on_collapse = on_collapse
        self._lock = threading.Lock()
        self._reserved = {d: set(v) for d, v in (reserved or {}).items()}
        self._labels: dict[str, set[str]] = {d: set() for d in DIMENSIONS}

    @property
    def enabled(self) -> bool:
        return bool(self.sources)

    def extract(
        self, headers: Any = None, engine_fields: Mapping[str, str | None] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Returns ``(values, labels)``: dimension -> value for the span, dimension -> bounded
        metric label. Dimensions without a value are absent from both.

        ``engine_fields``: the engine sources' values as text, keyed ``engine:priority`` /
        ``engine:lora`` (None or absent: missing), read by the engine adapter (vLLM:
        :func:`llm_otel.instrumentation.vllm.fields.class_fields`)."""
        values: dict[str, str] = {}
        labels: dict[str, str] = {}
        for dim, source in self.sources.items():
            if source.startswith("engine:"):
                raw = engine_fields.get(source) if engine_fields else None
                found = [] if raw is None else [raw]
            else:
                found = header_values(headers, source)
            value, reason = self.sanitise(found)
            if value is None:
                continue
            if reason is not None:
                self._collapsed(dim, reason)
                values[dim] = labels[dim] = OTHER
                continue
            values[dim] = value
            labels[dim] = self.label(dim, value)
        return values, labels

    #: why a value became ``other`` (the ``llm.request.class.reason`` values)
    REASONS = ("duplicate", "oversized", "invalid", "overflow")

    def sanitise(self, found: list[str]) -> tuple[str | None, str | None]:
        """``(value, None)``, ``(None, None)`` when missing, or ``(OTHER, reason)``."""
        stripped = [v.strip() for v in found]
        distinct = {v for v in stripped if v}
        if not distinct:
            return None, None
        if len(distinct) > 1:
            return OTHER, "duplicate"
        value = distinct.pop()
        if len(value) > self.max_len:
            return OTHER, "oversized"
        if not CLASS_VALUE.fullmatch(value):
            return OTHER, "invalid"
        return value, None

    def label(self, dim: str, value: str) -> str:
        """The metric label for a valid ``value``: itself while the bound allows, else ``other``."""
        seen = self._labels[dim]
        if value == OTHER or value in seen or value in self._reserved.get(dim, ()):
            return value
        with self._lock:
            if value in seen:
                return value
            if len(seen) < self.max_values:
                seen.add(value)
                return value
        self._collapsed(dim, "overflow")
        return OTHER

    def _collapsed(self, dim: str, reason: str) -> None:
        if self.on_collapse is not None:
            with guard("signals.classes.on_collapse"):
                self.on_collapse(dim, reason)
