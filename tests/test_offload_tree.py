"""``llm.prompt`` / ``llm.token_stream`` built in the exporter process (:mod:`llm_otel.export.offload`):
the serving process ships the record's raw arrays with the children's ids and sampling decisions
(:meth:`OffloadTracer.ship_children`), the exporter process runs the same
:class:`~llm_otel.telemetry.spans.SpanBuilder` on them (:func:`expand_trees`).

The tree built from a shipped record must equal the tree the serving process builds in process for
the same record: same ids, parents, times, attributes and events, compared field by field. The
end-to-end path (real exporter process, OTLP to the receiver, against the SDK's in-process path) is
tests/test_export_process.py::test_span_trees_are_identical_to_the_in_process_path.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from test_export_process import SeededIds  # the same id sequence for both paths

from llm_otel.config import Settings
from llm_otel.export.offload import BACKLOG, OffloadBuffer, OffloadTracerProvider, expand_trees, request_outlets
from llm_otel.export.offload.frames import span_count
from llm_otel.sampling import UtilizationPolicy, adaptive_sampler
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.telemetry import Telemetry

FIELDS = (
    "name",
    "trace_id",
    "span_id",
    "flags",
    "trace_state",
    "parent",
    "kind",
    "start",
    "end",
    "attributes",
    "events",
    "links",
    "status",
    "scope",
)


class Sink:
    """Stands in for the provider's :class:`OffloadBuffer`: keeps what the serving process hands it,
    pickled and unpickled as the pipe to the exporter process would carry it."""

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def push(self, record: tuple, spans: int = 1) -> None:
        assert spans == (record[1] if record[0] is None else 1)
        self.records.append(pickle.loads(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)))


def _requests(telemetry: Telemetry) -> None:
    """Records covering every branch of SpanBuilder.children: stalls, speculative steps (several
    tokens per step), preemptions before and after the first token, cached tokens, the frontend
    hand-over, a failure without tokens, a failure after tokens, a remote parent with tracestate,
    and log-probs (``llm.logit_dist`` stays in the serving process)."""
    base = 1_700_000_000.0
    parent = TraceContextTextMapPropagator().extract(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "ot=th:0;rv:ffffffffffffff,vendor=x",
        }
    )
    for i in range(6):
        arrival = base + i
        rec = telemetry.start_request(
            f"r-{i}",
            operation="text_completion",
            provider="vllm",
            model="m",
            arrival_s=arrival,
            input_tokens=7 + i,
            parent=parent if i == 3 else None,
            engine_version="0.0",
        )
        mono0 = 1000.0 + i
        rec.mono_offset_ns = round((arrival - mono0) * 1e9)
        if i != 5:
            rec.handed_s = arrival + 0.0004
        rec.on_event("queued", mono0 + 0.001)
        rec.on_event("scheduled", mono0 + 0.002)
        if i == 1:
            rec.cached_tokens = 4
            rec.on_event("preempted", mono0 + 0.003)
        if i == 2:  # failed before any token
            rec.error_type, rec.error_message = "EngineError", "boom"
        else:
            for k in range(40):
                ids = [k, k + 1, k + 2] if i == 1 and k % 5 == 0 else [k]
                rec.on_tokens(ids, mono0 + 0.01 + k * 0.003 + (0.05 if k in (9, 30) else 0.0))
                if i == 1 and k == 20:
                    rec.on_event("preempted", mono0 + 0.01 + k * 0.003 + 0.001)
                if i == 4 and k < 3:
                    lps = np.array([[-0.1, -0.1, -2.0, -3.0]])
                    rec.on_logprobs(np.array([[k, k, 5, 6]]), lps)
            rec.finish_reason = "length"
        if i == 5:
            rec.error_type, rec.error_message = "Aborted", None
        telemetry.finish(rec, end_ns=round((arrival + 0.4) * 1e9))


def _run(sampler, settings: Settings, ship: bool) -> tuple[list[tuple], list[tuple]]:
    """(span records as the exporter process would export them, what the serving process handed over)."""
    tp = OffloadTracerProvider(Resource.create({}), sampler, SeededIds(11), "test", 100, {})
    tp.buffer = sink = Sink()  # no exporter process: the records it would get
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    # without the outlets: the in-process build, same tracer and ids
    telemetry = Telemetry(tp, mp, settings, outlets=request_outlets(tp, mp) if ship else None)
    _requests(telemetry)
    records, lost = expand_trees(sink.records)
    assert lost == 0
    return sorted(records, key=lambda r: r[2]), sink.records


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("sampler", ["always_on", "adaptive"])
def test_the_tree_built_in_the_exporter_process_equals_the_in_process_tree(sampler, capture):
    settings = Settings(console="off", adaptive_sampling="off", capture_content=capture, logit_dist_ratio=1.0)
    make = (
        (lambda: ALWAYS_ON)
        if sampler == "always_on"
        else (lambda: adaptive_sampler(UtilizationPolicy(floor=1.0, ceiling=1.0), poller=None))
    )
    in_process, handed_in = _run(make(), settings, ship=False)
    shipped, handed = _run(make(), settings, ship=True)

    # the serving process handed over tree records, not llm.prompt / llm.token_stream spans
    assert not any(r[0] is None for r in handed_in)
    trees = [r for r in handed if r[0] is None]
    assert len(trees) == 6 and sum(t[1] for t in trees) == 11  # one request without tokens: no token_stream
    assert not [r for r in handed if r[0] in ("llm.prompt", "llm.token_stream")]

    names = [r[0] for r in in_process]
    assert names.count("llm.prompt") == 6 and names.count("llm.token_stream") == 5
    assert names.count("llm.logit_dist") == 1 and len(in_process) == 6 + 6 + 5 + 1
    assert [r[2] for r in shipped] == [r[2] for r in in_process]  # same span ids
    for mine, theirs in zip(shipped, in_process):
        for field, a, b in zip(FIELDS, mine, theirs):
            if field == "attributes":
                assert a.keys() == b.keys(), mine[0]
                for key in a:
                    assert a[key] == b[key] and type(a[key]) is type(b[key]), (mine[0], key)
            elif field == "events":
                assert len(a) == len(b), mine[0]
                for ev_a, ev_b in zip(a, b):
                    assert ev_a == ev_b, (mine[0], ev_a, ev_b)
            else:
                assert a == b, (mine[0], field)
    stream = next(r for r in shipped if r[0] == "llm.token_stream" and any(e[0] == "llm.token.stall" for e in r[10]))
    assert stream[9][A.LLM_TOKEN_EVENTS_DROPPED] == 0
    remote = [r for r in shipped if r[1] == 0x0AF7651916CD43DD8448EB211C80319C and r[0] == "llm.prompt"]
    assert remote and dict(remote[0][4])["vendor"] == "x"
    if capture:
        assert any("llm.token.id" in (e[1] or {}) for r in shipped for e in r[10])


def test_a_tree_that_cannot_be_built_loses_the_spans_it_announced(caplog):
    settings = Settings(console="off", adaptive_sampling="off")
    _, handed = _run(ALWAYS_ON, settings, ship=True)
    tree = next(r for r in handed if r[0] is None and r[1] == 2)
    broken = (*tree[:7], tree[7][:3])  # the record's fields cut short
    span = next(r for r in handed if r[0] is not None)
    records, lost = expand_trees([span, broken])
    assert lost == 2 and records == [span]
    assert len([r for r in caplog.records if "cannot build" in r.getMessage()]) <= 1
    assert span_count([span, tree]) == 3  # what the pipe's accounting counts


def test_a_full_buffer_counts_every_span_of_the_trees_it_drops(receiver):
    reader = InMemoryMetricReader()
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_METRICS_EXPORTER": "none",
    }
    tp = OffloadTracerProvider(Resource.create({}), ALWAYS_ON, SeededIds(3), "rx", 2, env)
    assert isinstance(tp.buffer, OffloadBuffer)
    tp.buffer.bind(MeterProvider(metric_readers=[reader]))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    telemetry = Telemetry(tp, mp, Settings(console="off", adaptive_sampling="off"), outlets=request_outlets(tp, mp))
    with tp.buffer._lock:  # noqa: SLF001 - the writer is busy: nothing leaves the buffer
        _requests(telemetry)  # 6 requests: request span + tree each; room for 2 records
    dropped = 0
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == M.LLM_OTEL_SPANS_DROPPED:
                    dropped += sum(
                        p.value for p in metric.data.data_points if p.attributes.get("error.type") == BACKLOG
                    )
    # kept: request 0's tree and span (3 spans); dropped: the other 5 request spans, their trees
    # (2 spans each, 1 for the request without tokens) and request 4's llm.logit_dist
    assert dropped == 5 + 9 + 1 and tp.buffer.failed == dropped
    assert tp.force_flush(30_000)
    tp.shutdown()
