"""One sampling decision across the serving path (issue 29, CASES.md C27).

Test vectors and rules come from their published sources:

* OpenTelemetry specification, "TraceState: Probability Sampling"
  (specification/trace/tracestate-probability-sampling.md, OTEP 235): the 1-in-N table of
  thresholds at precision 3/4/5 with their exact probabilities, and the keep rule
  ``shouldSample = (randomness >= threshold)``; randomness is ``rv`` or the trace id's least
  significant 56 bits.
* ai-dynamo/nixl#2273 (``tracing: add head-based trace sampling gate``): "a request is sampled when
  the random part of its trace id falls in the top ``ratio`` of the range", the rule llm-d's router
  uses too: keep when the trace id's low 56 bits, as an integer, are >= ``(1 - ratio) * 2**56``.
* W3C Trace Context Level 2, trace-flags: ``random-trace-id`` is bit 0x02; when set inbound it
  must be set on every outgoing ``traceparent`` of the same trace id.
"""

from __future__ import annotations

import random

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace._sampling_experimental._trace_state import OtelTraceState
from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from tests.support.pollers import idle_poller

from llm_otel.propagation import carrier_from_span, context_from_carrier, parse_traceparent
from llm_otel.sampling import TraceBudget, UtilizationPolicy, adaptive_sampler, quantize_threshold
from llm_otel.semconv import attributes as A

LOW56 = (1 << 56) - 1

# (1-in-N, input probability, {th at precision 3, 4, 5: the exact probability it encodes}) from the
# specification's table ("Converting floating-point probability to threshold value")
SPEC_TABLE = [
    (1, 1.0, {"0": 1.0}),
    (2, 0.5, {"8": 0.5}),
    (3, 1 / 3, {"aab": 0.333251953125, "aaab": 0.3333282470703125, "aaaab": 0.33333301544189453}),
    (4, 0.25, {"c": 0.25}),
    (5, 0.2, {"ccd": 0.199951171875, "cccd": 0.1999969482421875, "ccccd": 0.19999980926513672}),
    (8, 0.125, {"e": 0.125}),
    (10, 0.1, {"e66": 0.10009765625, "e666": 0.100006103515625, "e6666": 0.10000038146972656}),
    (16, 0.0625, {"f": 0.0625}),
    (100, 0.01, {"fd71": 0.0099945068359375, "fd70a": 0.010000228881835938, "fd70a4": 0.009999990463256836}),
    (1000, 0.001, {"ffbe7": 0.0010004043579101562, "ffbe77": 0.0009999871253967285, "ffbe76d": 0.000999998301267624}),
]


def _th(value: str) -> int:
    return OtelTraceState.parse(trace.TraceState([("ot", f"th:{value}")])).threshold


def _fixed(p: float):
    """llm-otel's adaptive sampler at a fixed probability ``p`` (no budget)."""
    return adaptive_sampler(UtilizationPolicy(floor=p, ceiling=p), poller=idle_poller())


def _nixl_keeps(trace_id: int, ratio: float) -> bool:
    """NIXL's head-sampling gate / llm-d's router rule, written from their description."""
    return (trace_id & LOW56) >= round((1.0 - ratio) * 2**56)


@pytest.mark.case("C27")
@pytest.mark.parametrize("n, p, encodings", SPEC_TABLE, ids=[f"1-in-{row[0]}" for row in SPEC_TABLE])
def test_the_specifications_threshold_table_decodes_and_our_roots_encode_within_one_quantum(n, p, encodings):
    for th, exact in encodings.items():
        assert (MAX_THRESHOLD - _th(th)) / MAX_THRESHOLD == exact, th
    # what llm-otel's root writes for p: within one 12-bit quantum of the specification's finest
    # threshold, never above it (a root is never sampled at less than the probability asked)
    finest = _th(max(encodings, key=len))
    sampler = _fixed(p)
    result = sampler.should_sample(None, random.getrandbits(128) | LOW56, "root")  # randomness max: kept
    ours = OtelTraceState.parse(result.trace_state).threshold
    assert ours == quantize_threshold(p)
    assert 0 <= finest - ours < 1 << 44, (hex(finest), hex(ours))


@pytest.mark.case("C27")
@pytest.mark.parametrize("p", [0.5, 0.25, 0.1, 0.01])
def test_the_keep_rule_is_randomness_at_or_above_the_threshold(p):
    sampler = _fixed(p)
    t = quantize_threshold(p)
    high = random.getrandbits(72) << 56
    for randomness, kept in ((t - 1, False), (t, True), (t + 1, True), (0, False), (LOW56, True)):
        result = sampler.should_sample(None, high | randomness, "root")
        assert (result.decision == Decision.RECORD_AND_SAMPLE) == kept, (hex(t), hex(randomness))


@pytest.mark.case("C27")
@pytest.mark.parametrize("p", [0.75, 0.5, 0.25, 0.125, 1 / 16, 2**-10, 0.1, 0.01])
def test_our_keep_or_drop_equals_nixls_and_llm_ds_threshold_rule(p):
    rng = random.Random(int(p * 1e6))
    sampler = _fixed(p)
    band = (quantize_threshold(p), round((1.0 - p) * 2**56))  # our quantised threshold .. theirs
    disagree = 0
    for _ in range(20_000):
        tid = rng.getrandbits(128)
        ours = sampler.should_sample(None, tid, "root").decision == Decision.RECORD_AND_SAMPLE
        if ours != _nixl_keeps(tid, p):
            # only where our threshold, rounded down to 12 bits, is below theirs: kept here, not there
            assert ours and band[0] <= (tid & LOW56) < band[1], (p, hex(tid))
            disagree += 1
    if band[0] == band[1]:  # a probability the 12-bit quantisation represents exactly
        assert disagree == 0
    assert disagree <= 20_000 * (band[1] - band[0]) / 2**56 * 3 + 3


@pytest.mark.case("C27")
def test_proxy_prefill_and_decode_agree_on_every_trace():
    """A proxy deciding by NIXL's rule (random-flagged traceparent, ot=th), then llm-otel in two
    engine processes at other probabilities, each a hop through a formatted traceparent."""
    prefill, decode = _fixed(0.01), _fixed(1.0)
    provider_p = TracerProvider(sampler=prefill)
    provider_d = TracerProvider(sampler=decode)
    rng = random.Random(7)
    kept = 0
    for _ in range(400):
        tid = rng.getrandbits(128)
        keep = _nixl_keeps(tid, 0.25)
        carrier = {"traceparent": f"00-{tid:032x}-{rng.getrandbits(63) | 1:016x}-{0x02 | int(keep):02x}"}
        if keep:
            carrier["tracestate"] = "ot=th:c"
        with provider_p.get_tracer("t").start_as_current_span(
            "prefill", context=context_from_carrier(carrier), kind=SpanKind.SERVER
        ) as span:
            hop = carrier_from_span(span)
        with provider_d.get_tracer("t").start_as_current_span(
            "decode", context=context_from_carrier(hop), kind=SpanKind.SERVER
        ) as child:
            out = carrier_from_span(child)
        for sp, c in ((span, hop), (child, out)):
            assert sp.get_span_context().trace_flags.sampled == keep
            assert c["traceparent"].endswith("-03" if keep else "-02")  # the random flag goes on
        if keep:
            kept += 1
            assert span.attributes[A.LLM_SAMPLING_REASON] == "parent"
            assert hop["tracestate"] == out["tracestate"] == "ot=th:c"  # randomness passes: th kept
    assert 60 < kept < 140


@pytest.mark.case("C27")
def test_roots_carry_the_random_flag_and_inbound_flags_are_kept_on_children_and_outbound():
    provider = TracerProvider(sampler=_fixed(1.0))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("root") as root:
        assert carrier_from_span(root)["traceparent"].endswith("-03")
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers)  # outbound HTTP, the global propagator's way
        assert headers["traceparent"].endswith("-03")
    for inbound, expected in (("03", "-03"), ("01", "-01")):
        carrier = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-{inbound}"}
        assert int(parse_traceparent(carrier["traceparent"]).trace_flags) == int(inbound, 16)
        with tracer.start_as_current_span("child", context=context_from_carrier(carrier)) as child:
            assert carrier_from_span(child)["traceparent"].endswith(expected)
    # bits W3C leaves undefined are not passed on; a malformed flags field is no parent at all
    assert int(parse_traceparent(f"00-{'ab' * 16}-{'cd' * 8}-ff").trace_flags) == 0x03
    assert parse_traceparent(f"00-{'ab' * 16}-{'cd' * 8}-0g") is None


@pytest.mark.case("C27")
def test_llm_otels_own_tracer_sets_the_random_flag_like_the_sdk():
    from llm_otel.export.offload.recorder import OffloadTracerProvider

    tp = OffloadTracerProvider(Resource.create({}), _fixed(1.0), TracerProvider().id_generator, "t", 100, {})
    tracer = tp.get_tracer("t")
    root = tracer.start_span("root", context=Context())
    assert carrier_from_span(root)["traceparent"].endswith("-03")
    plain = context_from_carrier({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
    assert carrier_from_span(tracer.start_span("child", context=plain))["traceparent"].endswith("-01")


@pytest.mark.case("C27")
def test_a_non_random_id_generator_gets_explicit_randomness():
    sampler = adaptive_sampler(UtilizationPolicy(floor=0.5, ceiling=0.5), poller=idle_poller(), random_trace_ids=False)
    kept = 0
    for _ in range(400):
        result = sampler.should_sample(None, 1, "root")  # a trace id with no randomness at all
        ot = OtelTraceState.parse(result.trace_state)
        assert 0 <= ot.random_value <= LOW56
        assert (result.decision == Decision.RECORD_AND_SAMPLE) == (ot.random_value >= quantize_threshold(0.5))
        kept += result.decision == Decision.RECORD_AND_SAMPLE
    assert 120 < kept < 280


@pytest.mark.case("C27")
def test_router_parented_request_spans_say_parent_and_local_children_do_not():
    sampler = _fixed(0.01)
    parent = context_from_carrier({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
    server = sampler.should_sample(parent, int("ab" * 16, 16), "req", SpanKind.SERVER)
    assert server.decision == Decision.RECORD_AND_SAMPLE
    assert server.attributes[A.LLM_SAMPLING_REASON] == A.LlmSamplingReasonValues.PARENT
    internal = sampler.should_sample(parent, int("ab" * 16, 16), "engine", SpanKind.INTERNAL)
    assert A.LLM_SAMPLING_REASON not in (internal.attributes or {})
    dropped = context_from_carrier({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-02"})
    assert sampler.should_sample(dropped, 1, "req", SpanKind.SERVER).decision == Decision.DROP


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.case("C27")
def test_outlier_captures_have_a_bound_of_their_own():
    clock = Clock()
    budget = TraceBudget(10.0, clock=clock)
    sampler = adaptive_sampler(UtilizationPolicy(), poller=idle_poller(), budget=budget)
    outlier = {A.LLM_SAMPLING_REASON: "outlier"}

    def kept(n: int) -> int:
        return sum(
            sampler.should_sample(Context(), random.getrandbits(128), "o", attributes=outlier).decision
            == Decision.RECORD_AND_SAMPLE
            for _ in range(n)
        )

    assert kept(100) == 10  # a storm of failures: the bucket (capacity 10)
    clock.now += 0.5
    assert kept(100) == 5  # refilled at 10/s
    for _ in range(50):  # root decisions do not spend outlier tokens, nor outliers root credit
        sampler.should_sample(None, random.getrandbits(128), "root")
    clock.now += 10.0
    assert kept(100) == 10
