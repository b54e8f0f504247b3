"""The frame protocol between a serving process and its exporter process: how frames travel on the
pipes, and the layout of the records they carry.

A frame is a pickled tuple behind a 4-byte big-endian length (:data:`HEADER`); its first item names
it. Serving process -> exporter process (its stdin): ``("init", resource attributes, schema url,
buffer size)`` first, then ``("spans", records)``, ``("metrics", records)``, ``("resource", attributes, schema
url)``, ``("instruments", scope name, version, schema url, itl_every)`` and ``("flush", token,
timeout_ms, final)``. Exporter process -> serving process (its stdout): ``("status", exported,
failed, last error, error.type)`` for every export (frames waiting together are exported together)
and for every frame the export queue could not take, ``("flushed", token, ok)``, ``("metrics_failed", n,
last error)`` and ``("metrics_exported", points)``.

Records in a ``spans`` frame: a span record (:meth:`~llm_otel.export.offload.recorder.OffloadSpan.end`:
name, trace id, span id, flags, tracestate items, parent, kind, start, end, attributes, events,
links, status, scope) or a tree record (``(None, spans, scope, parent, children, end_ns,``
:func:`settings_fields` ``, RequestRecord.span_fields)``:
:meth:`~llm_otel.export.offload.recorder.OffloadTracer.ship_children`). Records in a ``metrics``
frame: ``(instrument attribute, value, attributes, (trace_id, span_id, flags) or None)``, or one
finished request's ``("request", Instruments.observations(...), weight, ids)``.
"""

from __future__ import annotations

import pickle
import struct

HEADER = struct.Struct("!I")

# the children SpanBuilder.children creates, in its order (llm.token_stream only after a token)
CHILDREN = ("llm.prompt", "llm.token_stream")
PROMPT_ONLY = CHILDREN[:1]
# the Settings fields SpanBuilder.children reads (a tree record carries their values)
TREE_SETTINGS = ("stall_factor", "token_events", "max_stall_events", "capture_content")
# the observations of one finished request besides its ITL gaps, at most: duration, TTFT, TPOT,
# output token rate, the request count, queue time, input and output tokens (Instruments.apply)
REQUEST_POINTS = 8


def settings_fields(settings) -> tuple:
    """The :data:`TREE_SETTINGS` values of ``settings`` (a tree record carries them)."""
    return tuple(getattr(settings, name) for name in TREE_SETTINGS)


def read_frame(stream):
    """The next frame of ``stream`` (a binary file), None at its end or a cut frame."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def write_frame(stream, frame) -> None:
    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def encode(frame: tuple) -> bytes:
    """One frame as the pipe carries it (header + pickle); raises what pickle raises."""
    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def span_count(records) -> int:
    """Spans in a batch of span records and tree records (``(None, spans, ...)``)."""
    n = len(records)
    for record in records:
        if record[0] is None:
            n += record[1] - 1
    return n


def metric_weight(records) -> int:
    """The buffer weight of a batch of metric records (:meth:`OffloadBuffer.push_metric
    <llm_otel.export.offload.writer.OffloadBuffer.push_metric>`)."""
    n = 0
    for record in records:
        n += record[2] if record[0] == "request" else 1
    return n


def metric_points(records) -> int:
    """Metric points in a batch of metric records: one per observation, :meth:`Instruments.points
    <llm_otel.telemetry.metrics.Instruments.points>` per request record (asked per batch written
    and per batch applied, for the exporter process's export marks, and for what is lost)."""
    from llm_otel.telemetry.metrics import Instruments  # once per batch, not per record

    points = Instruments.points
    n = 0
    for record in records:
        n += points(record[1]) if record[0] == "request" else 1
    return n


_VALID = (str, bool, int, float)


def _clean_value(value):
    """An attribute value as the SDK accepts it (``opentelemetry.attributes._clean_attribute``:
    str/bool/int/float, or a homogeneous sequence of them with None allowed), numpy-style scalars
    converted with ``.item()``; ``_INVALID`` when it is none of these."""
    if isinstance(value, _VALID):
        return value
    if isinstance(value, (list, tuple)):
        out, kind = [], None
        for item in value:
            if item is not None:
                item = _clean_value(item)
                if item is _INVALID or isinstance(item, tuple) or (kind is not None and type(item) is not kind):
                    return _INVALID
                kind = type(item)
            out.append(item)
        return tuple(out)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        try:
            value = item()
        except Exception:  # noqa: BLE001 - silent: counted as a dropped attribute by the caller
            return _INVALID
        return value if isinstance(value, _VALID) else _INVALID
    return _INVALID


_INVALID = object()


def clean_attributes(attributes) -> tuple[dict | None, int]:
    """``attributes`` with only values the SDK accepts (see :func:`_clean_value`); (dict, number of
    values dropped). Keys that are not str are dropped too."""
    if not attributes:
        return attributes, 0
    out, dropped = {}, 0
    for key, value in attributes.items():
        value = _clean_value(value)
        if value is _INVALID or not isinstance(key, str):
            dropped += 1
        else:
            out[key] = value
    return out, dropped


def clean_record(kind: str, record: tuple) -> tuple[tuple, int]:
    """A span record (see :meth:`~llm_otel.export.offload.recorder.OffloadSpan.end`) or metric
    record (``push_metric``) with its
    attributes, event and link attributes cleaned; (record, values dropped)."""
    if kind == "metrics":
        if record[0] == "request":  # a request's observations: its four attribute sets
            sets, n = [], 0
            for attributes in record[1][0]:
                attributes, k = clean_attributes(attributes)
                sets.append(attributes)
                n += k
            return (record[0], (tuple(sets), *record[1][1:]), record[2], record[3]), n
        attributes, n = clean_attributes(record[2])
        return (record[0], record[1], attributes, record[3]), n
    fields = list(record)
    fields[9], n = clean_attributes(fields[9])
    events = []
    for name, attributes, ts in fields[10]:
        attributes, k = clean_attributes(attributes)
        n += k
        events.append((name, attributes, ts))
    fields[10] = events
    links = []
    for link in fields[11]:
        attributes, k = clean_attributes(link[5])
        n += k
        links.append((*link[:5], attributes))
    fields[11] = links
    return tuple(fields), n
