"""The frontend half of the per-request speculative-decoding figures (spec_decode.py) on vLLM's
real ``EngineCoreOutput`` and ``RequestSpecDecodeMetrics`` classes, without an engine."""

from __future__ import annotations

import pytest

from llm_otel.instrumentation.vllm.spec_decode import figures, take_figures

vllm_stats = pytest.importorskip("vllm.v1.metrics.stats")
vllm_engine = pytest.importorskip("vllm.v1.engine")


class _Span:
    def __init__(self) -> None:
        self.attributes: dict = {}

    def set_attributes(self, attrs: dict) -> None:
        self.attributes.update(attrs)


class _Rec:
    def __init__(self) -> None:
        self.span = _Span()

    def annotate(self, attributes: dict) -> None:  # RequestRecord.annotate of a recording request
        self.span.set_attributes(attributes)


def _metrics(steps: list[tuple[int, int]]):
    m = vllm_stats.RequestSpecDecodeMetrics.new(3)
    for drafted, accepted in steps:
        m.observe(num_draft_tokens=drafted, num_accepted=accepted)
    return m


def test_figures_are_vllms_to_dict_figures():
    m = _metrics([(3, 0), (3, 3), (2, 1), (3, 2)])
    own = m.to_dict()
    got = figures(m)
    assert got["llm.request.spec_decode.draft_tokens"] == own["num_draft_tokens"] == 11
    assert got["llm.request.spec_decode.accepted_tokens"] == own["num_accepted_draft_tokens"] == 6
    assert got["llm.request.spec_decode.steps"] == own["num_spec_steps"] == 4
    assert got["llm.request.spec_decode.accepted_histogram"] == own["acceptance_histogram"] == [1, 1, 1, 1]
    assert got["llm.request.spec_decode.acceptance_rate"] == own["draft_acceptance_rate"]


@pytest.mark.parametrize("keep", [False, True], ids=["operator-off", "operator-on"])
def test_final_outputs_figures_go_to_the_span_and_leave_the_response_unless_the_operator_asked(keep):
    ours, other = _Rec(), _Rec()
    live = {"a": ours}
    outputs = [
        vllm_engine.EngineCoreOutput(request_id="a", new_token_ids=[1], spec_decode_metrics=_metrics([(3, 1)])),
        vllm_engine.EngineCoreOutput(request_id="b", new_token_ids=[2], spec_decode_metrics=_metrics([(3, 2)])),
        vllm_engine.EngineCoreOutput(request_id="c", new_token_ids=[3]),
    ]
    take_figures(outputs, live, keep)
    assert ours.span.attributes["llm.request.spec_decode.accepted_tokens"] == 1
    assert other.span.attributes == {}  # not a live sampled record of ours
    assert live == {}  # nothing kept once read
    assert [o.spec_decode_metrics is not None for o in outputs] == [keep, keep, False]
