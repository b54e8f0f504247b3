"""Bounds on the strings a client chooses that land on spans (docs/semconv.md, "Values a client
chooses"): ids a client can set (vLLM takes ``X-Request-Id`` as its request id, SGLang a ``rid``
field) are kept, cut to :data:`MAX_ID_CHARS` characters. Metric dimensions are bounded where they
are recorded (model names: ``BoundedValues`` / the served names; request classes:
``llm_otel.signals.classes``)."""

from __future__ import annotations

MAX_ID_CHARS = 256  # characters of an id kept on a span; a longer one is cut (W3C trace ids are 32)


def bounded_id(value: str) -> str:
    """``value`` cut to :data:`MAX_ID_CHARS` characters (an id a client may have chosen)."""
    return value if len(value) <= MAX_ID_CHARS else value[:MAX_ID_CHARS]
