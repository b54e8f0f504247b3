"""Counting semantics for fleets (issue 16): ``n > 1`` (C15) on the engine-agnostic core."""

from __future__ import annotations

import pytest
from conftest import make_captured

from llm_otel.telemetry.record import ChoiceGroup

ARRIVAL = 1_700_000_000.0


def _points(cap, name):
    data = cap.metrics.get_metrics_data()
    return [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


@pytest.mark.case("C15")
def test_n_choices_count_the_prompt_and_the_request_once():
    cap = make_captured()
    group = ChoiceGroup(3)
    for i, out in enumerate((4, 5, 6)):
        rec = cap.telemetry.start_request(
            f"{i}_parent",
            operation="text_completion",
            provider="vllm",
            model="tiny",
            arrival_s=ARRIVAL,
            input_tokens=7,
            choice_index=i,
        )
        rec.choice_group = group
        rec.on_tokens(list(range(out)), 10.0 + i)
        rec.finish_reason = "length"
        cap.telemetry.finish(rec, end_ns=round((ARRIVAL + 1 + i) * 1e9))
    usage = {p.attributes["gen_ai.token.type"]: p for p in _points(cap, "llm.server.token.usage")}
    assert (usage["input"].count, usage["input"].sum) == (1, 7)  # one prompt
    assert (usage["output"].count, usage["output"].sum) == (3, 15)  # three outputs
    (requests,) = _points(cap, "llm.server.requests")
    assert requests.value == 1
    (duration,) = _points(cap, "gen_ai.server.request.duration")
    assert duration.count == 1 and abs(duration.sum - 3.0) < 1e-6  # arrival -> the last choice's finish
    assert sum(p.count for p in _points(cap, "gen_ai.server.time_to_first_token")) == 3  # per choice
    # each choice keeps its own span with the prompt it consumed and its index
    roots = [s for s in cap.finished() if s.name == "text_completion tiny"]
    assert sorted(s.attributes["llm.request.choice.index"] for s in roots) == [0, 1, 2]


@pytest.mark.case("C22")
def test_lora_metric_dimension_is_bounded_per_process(caplog):
    import logging

    from llm_otel.instrumentation.vllm.adapter import MAX_LORA_NAMES, VLLMAdapter

    adapter = VLLMAdapter(make_captured().telemetry)
    names = [f"adapter-{i}" for i in range(MAX_LORA_NAMES + 3)]
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        got = [adapter._lora_metric_name(n) for n in names]
    assert got[:MAX_LORA_NAMES] == names[:MAX_LORA_NAMES]
    assert got[MAX_LORA_NAMES:] == ["_OTHER"] * 3
    assert adapter._lora_metric_name("adapter-0") == "adapter-0"  # known names keep their series
    assert caplog.text.count("LoRA adapters served") == 1
