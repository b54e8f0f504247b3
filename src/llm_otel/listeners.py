"""Listeners of the core's request lifecycle: what observes every request besides its span tree.

:class:`llm_otel.telemetry.Telemetry` owns each request's span and record; the subsystems that
learn from requests - the GenAI metrics, the adaptive sampler's latency drift detector, the
serving signals (request classes, tiers, KV footprint, SLO checks, health) - are listeners it
calls at three points, so that an engine adapter calls only ``Telemetry`` and every engine feeds
every listener::

    rec = telemetry.start_request(..., facts=RequestFacts(headers, engine_fields, kv))
        -> listener.on_start(rec, facts)        once, after the live request span started
    telemetry.on_tokens(count, engine_mono)
        -> listener.on_tokens(count, engine_mono)  once per engine step (or per streamed token)
    telemetry.finish(rec)
        -> listener.on_finish(rec, duration_s)  once, before the span tree is built

A listener is any object with the attributes below; a hook it does not need is None (so the
per-step dispatch is a tuple of bound methods, built when listeners are registered: no lookup
and no allocation per call). ``on_start`` and ``on_finish`` may return :class:`SpanNotes`, which
the core puts on the request span (only when it records): listeners never write on spans. A hook
that raises is counted in ``llm_otel.instrumentation.errors`` under the listener's ``error_key``
and logged once; the request goes on.

This module imports nothing from llm-otel, so that every subsystem can name these types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

__all__ = ["RequestFacts", "SpanNotes", "RequestListener", "token_hooks"]


class RequestFacts(NamedTuple):
    """What an adapter knows about a request when it starts, for the listeners.

    Attributes:
        headers: the inbound request's headers (a Starlette ``Headers``, a mapping, or a list of
            ``(name, value)`` pairs), None for an offline request.
        engine_fields: the engine's request-class sources as text, keyed ``engine:priority`` /
            ``engine:lora`` (None or absent: missing), read by the engine adapter (vLLM:
            :func:`llm_otel.instrumentation.vllm.fields.class_fields`), else None.
        kv: the KV-cache geometry of the engine serving it (:class:`llm_otel.signals.kv.KVSpec`),
            None when unknown.
    """

    headers: Any = None
    engine_fields: Mapping[str, str | None] | None = None
    kv: Any = None


class SpanNotes(NamedTuple):
    """What a listener asks the core to put on the request span.

    Attributes:
        request_attributes: attributes of the request itself (request classes, tier): set on the
            span and kept with the record's request attributes (an outlier root gets them too).
        attributes: attributes of this span only (KV-cache estimates).
        events: ``(name, attributes)`` pairs added as span events now.
    """

    request_attributes: Mapping[str, Any] | None = None
    attributes: Mapping[str, Any] | None = None
    events: tuple = ()


class RequestListener(Protocol):
    """The listener interface (structural: no base class to inherit)."""

    error_key: str  # ``llm.instrumentation.hook`` value of its failures, e.g. ``telemetry.signals``
    on_start: Callable[[Any, RequestFacts], SpanNotes | None] | None
    on_tokens: Callable[[int, float], None] | None  # (output tokens, engine monotonic seconds)
    on_finish: Callable[[Any, float], SpanNotes | None] | None  # (record, duration seconds)


def token_hooks(listeners: Iterable[object]) -> tuple[Callable[[int, float], None], ...]:
    """The bound ``on_tokens`` methods of ``listeners`` that have one, in order."""
    return tuple(hook for hook in (getattr(listener, "on_tokens", None) for listener in listeners) if hook is not None)
