"""The core's request-lifecycle listeners (llm_otel.listeners, issue 21): what a listener sees at
start, per step and at finish, where its notes land, and that a failing listener never stops a
request. The built-in listeners (metrics, drift, signals) are covered by test_signals.py,
test_sampling.py and test_telemetry_core.py; these tests register one of their own."""

from __future__ import annotations

from conftest import make_captured
from opentelemetry.trace import SpanKind

from llm_otel.listeners import RequestFacts, SpanNotes
from llm_otel.sampling import UtilizationPolicy, adaptive_sampler


class Recorder:
    """A listener that records what it is told and annotates the request span."""

    error_key = "telemetry.test_listener"

    def __init__(self) -> None:
        self.calls: list = []

    def on_start(self, rec, facts):
        self.calls.append(("start", rec.request_id, facts.headers, facts.engine_fields, facts.kv))
        return SpanNotes(
            {"llm.request.tenant": "acme"},
            {"llm.request.tier": "premium"},
            (("llm.vram.pressure", {"llm.vram.pressure.level": "warn"}),),
        )

    def on_tokens(self, count, engine_mono):
        self.calls.append(("tokens", count, engine_mono))

    def on_finish(self, rec, duration_s):
        self.calls.append(("finish", rec.request_id, round(duration_s, 3)))
        return SpanNotes(attributes={"llm.request.model.revision": "canary"})


def start(cap, facts=None, request_id="r1"):
    return cap.telemetry.start_request(
        request_id,
        operation="chat",
        provider="vllm",
        model="m",
        arrival_s=1000.0,
        input_tokens=3,
        kind=SpanKind.SERVER,
        facts=facts,
    )


def test_a_registered_listener_sees_start_every_step_and_finish_and_its_notes_land_on_the_span():
    cap = make_captured()
    listener = Recorder()
    cap.telemetry.add_listener(listener)
    rec = start(cap, RequestFacts([("x-tenant-id", "acme")], {"engine:priority": "1"}, None))
    cap.telemetry.on_tokens(2, 5.0)  # two listeners count tokens now (signals and this one): the loop
    cap.telemetry.on_tokens(0, 5.1)
    cap.telemetry.finish(rec, end_ns=rec.arrival_ns + 250_000_000)
    assert listener.calls == [
        ("start", "r1", [("x-tenant-id", "acme")], {"engine:priority": "1"}, None),
        ("tokens", 2, 5.0),
        ("tokens", 0, 5.1),
        ("finish", "r1", 0.25),
    ]
    assert sum(n for _, n in cap.telemetry.signals._steps) == 2  # the signals still count tokens (0: none)
    (span,) = [s for s in cap.finished() if s.name == "chat m"]
    assert span.attributes["llm.request.tenant"] == "acme" and span.attributes["llm.request.tier"] == "premium"
    assert span.attributes["llm.request.model.revision"] == "canary"
    assert [(e.name, dict(e.attributes)) for e in span.events if e.name == "llm.vram.pressure"] == [
        ("llm.vram.pressure", {"llm.vram.pressure.level": "warn"})
    ]
    # request attributes are the record's too (an outlier root is rebuilt from them)
    assert rec.request_attributes["llm.request.tenant"] == "acme"


def test_without_facts_no_listener_sees_the_start_but_every_one_sees_the_finish():
    cap = make_captured()
    listener = Recorder()
    cap.telemetry.add_listener(listener)
    rec = start(cap)
    cap.telemetry.finish(rec, end_ns=rec.arrival_ns)
    assert [c[0] for c in listener.calls] == ["finish"]


def test_a_failing_listener_is_counted_under_its_key_and_the_request_goes_on():
    class Broken(Recorder):
        def on_start(self, rec, facts):
            raise ValueError("start bug")

        def on_tokens(self, count, engine_mono):
            raise ValueError("tokens bug")

        def on_finish(self, rec, duration_s):
            raise ValueError("finish bug")

    cap = make_captured()
    cap.telemetry.add_listener(Broken())
    rec = start(cap, RequestFacts())
    cap.telemetry.on_tokens(3, 5.0)  # never raises into the adapter; the listeners after it still count
    assert sum(n for _, n in cap.telemetry.signals._steps) == 3
    cap.telemetry.finish(rec)
    assert [s.name for s in cap.finished()].count("chat m") == 1
    assert cap.telemetry.errors.counts == {"telemetry.test_listener": 3}
    (point,) = cap.metric_points("gen_ai.server.request.duration")  # the metrics listener ran first
    assert point.count == 1


def test_notes_of_an_unsampled_request_touch_no_span_and_the_drift_detector_listens_with_the_adaptive_sampler():
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.0001, ceiling=0.0001))
    cap = make_captured(sampler=sampler)
    assert cap.telemetry.sampling is sampler.sampling  # the provider's own llm-otel sampler
    assert sampler.sampling.listener in cap.telemetry.listeners
    listener = Recorder()
    cap.telemetry.add_listener(listener)
    rec = None
    for i in range(50):  # find a request the head sampler dropped
        rec = start(cap, RequestFacts(), request_id=f"r{i}")
        if not rec.recording:
            break
        cap.telemetry.finish(rec)
    assert not rec.recording
    rec.mono_offset_ns = 0
    rec.on_tokens([1], 1000.2)
    cap.telemetry.finish(rec, end_ns=rec.arrival_ns + 300_000_000)
    assert listener.calls[-1][0] == "finish" and rec.request_attributes["llm.request.tenant"] == "acme"
    assert not [s for s in cap.finished() if s.attributes.get("llm.request.id") == rec.request_id]
    assert sampler.sampling.listener.drift._series["ttft"]  # the drift detector saw the request's TTFT
