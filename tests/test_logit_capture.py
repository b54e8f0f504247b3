"""Which requests get ``llm.logit_dist`` (one policy for every engine) and the capture of their
logit rows around an engine's sampler (telemetry/logit_capture.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from llm_otel.config import Settings
from llm_otel.telemetry import logit_capture
from llm_otel.telemetry.logit_capture import capture_rows, logit_dist_chosen, logit_top_k, stage_row, wrap_sampler


def span_of(trace_id: int) -> NonRecordingSpan:
    return NonRecordingSpan(SpanContext(trace_id, 1, False, TraceFlags(1)))


def test_the_default_ratio_chooses_its_share_of_traces_by_the_random_low_56_bits_of_the_trace_id():
    """The choice depends on the trace id's random low 56 bits alone: a trace is chosen alike in
    every process that sees it (vLLM's frontend and worker, LightLLM's HTTP worker and model-infer
    worker), and about the default share of sampled requests is."""
    settings = Settings.from_env({})
    ratio = settings.logit_dist_ratio
    rng = random.Random(4)
    chosen = 0
    for _ in range(20_000):
        trace_id = rng.getrandbits(128) | 1
        picked = logit_dist_chosen(ratio, span_of(trace_id))
        assert picked == ((trace_id & ((1 << 56) - 1)) < ratio * (1 << 56))
        # the high 72 bits (W3C: not necessarily random) never change the choice
        assert logit_dist_chosen(ratio, span_of((trace_id & ((1 << 56) - 1)) | (rng.getrandbits(72) << 56))) == picked
        chosen += picked
    assert abs(chosen / 20_000 - ratio) < 4 * (0.05 * 0.95 / 20_000) ** 0.5


def test_ratio_one_chooses_every_trace_and_zero_none():
    for trace_id in (1, (1 << 56) - 1, (1 << 128) - 1):
        assert logit_dist_chosen(1.0, span_of(trace_id)) is True
        assert logit_dist_chosen(0.0, span_of(trace_id)) is False


def test_top_k_is_the_setting_capped_by_the_engine_for_chosen_recording_requests_only():
    settings = Settings.from_env({"LLM_OTEL_LOGIT_DIST_RATIO": "1", "LLM_OTEL_LOGPROBS_TOP_K": "5"})
    span = span_of(12345)
    assert logit_top_k(settings, span, recording=True) == 5
    assert logit_top_k(settings, span, recording=True, limit=3) == 3  # vLLM's max_logprobs
    assert logit_top_k(settings, span, recording=False) == 0  # not sampled: nothing to attach it to
    assert logit_top_k(settings, span, recording=True, limit=0) == 0
    off = Settings.from_env({"LLM_OTEL_LOGIT_DIST_RATIO": "1", "LLM_OTEL_LOGPROBS_TOP_K": "0"})
    assert logit_top_k(off, span, recording=True, user_asked=True) == 0


def test_a_request_that_asked_for_log_probs_gets_them_whatever_the_ratio():
    settings = Settings.from_env({"LLM_OTEL_LOGIT_DIST_RATIO": "0"})
    span = span_of(12345)
    assert logit_top_k(settings, span, recording=True) == 0
    assert logit_top_k(settings, span, recording=True, user_asked=True) == settings.logprobs_top_k


def test_both_engine_adapters_choose_with_the_one_policy():
    """vLLM's frontend and LightLLM's HTTP worker ask the core; neither keeps a copy of the rule."""
    from llm_otel.instrumentation.lightllm import httpserver
    from llm_otel.instrumentation.vllm import adapter as vllm_adapter

    for module in (httpserver, vllm_adapter):
        assert module.logit_top_k is logit_capture.logit_top_k
    assert not hasattr(httpserver.HttpAdapter, "_wants_logit_dist")
    assert not hasattr(vllm_adapter.VLLMAdapter, "_wants_logit_dist")


class Errors:
    def __init__(self):
        self.reported = []

    def report(self, site, exc):
        self.reported.append((site, type(exc).__name__))


def test_the_sampler_runs_as_called_and_failures_around_it_are_counted():
    errors = Errors()
    calls = []

    def sampler(*args, **kwargs):
        calls.append((args, kwargs))
        return "out"

    def boom(*a):
        raise RuntimeError("ours")

    wrapper = wrap_sampler(errors, "hook", boom, boom)
    assert wrapper(sampler, None, (1, 2), {"k": 3}) == "out"
    assert calls == [((1, 2), {"k": 3})] and errors.reported == [("hook", "RuntimeError")]
    seen = []
    wrapper = wrap_sampler(errors, "hook", lambda i, a, k: "plan", lambda i, plan, out: seen.append((plan, out)))
    assert wrapper(sampler, None, (), {}) == "out" and seen == [("plan", "out")]
    wrapper = wrap_sampler(errors, "hook", lambda i, a, k: None, boom)  # no plan: nothing after
    assert wrapper(sampler, None, (), {}) == "out" and len(errors.reported) == 1


def test_chosen_rows_are_reduced_before_the_sampler_and_the_sampled_tokens_read_after():
    torch = pytest.importorskip("torch")
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0, 0.5, 5.0, 0.25]])
    captured = capture_rows(logits, [0, 2], 2)
    logits.fill_(float("nan"))  # a sampler modifying the logits in place changes nothing taken before
    stats, sampled_lp = captured.to_host(torch.tensor([[3], [0], [1]]), [0, 2])
    assert stats.top_ids.tolist() == [[3, 2], [2, 1]] and not stats.nonfinite.any()
    lse0 = math.log(sum(math.exp(v) for v in (0.0, 1.0, 2.0, 3.0)))
    lse2 = math.log(sum(math.exp(v) for v in (0.0, 0.5, 5.0, 0.25)))
    assert sampled_lp == pytest.approx([3.0 - lse0, 0.5 - lse2], abs=1e-6)
    row = stage_row(stats, sampled_lp, 1, 1, 7)
    assert row[0] == 7 and row[1].tolist() == [2] and row[6] == pytest.approx(0.5 - lse2, abs=1e-6)
    assert capture_rows(logits, [], 2) is None
    stats, none = capture_rows(torch.zeros(2, 3), [1], 2).to_host()
    assert none is None and stats.top_ids.shape == (1, 2)
    # one-dimensional sampled ids: the chosen rows themselves (LightLLM's sampler)
    _, lp = capture_rows(torch.zeros(2, 4), [1], 1).to_host(torch.tensor([0, 3]))
    assert lp == pytest.approx([-math.log(4)], abs=1e-6)


def test_nothing_is_captured_while_a_cuda_graph_is_being_captured(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(logit_capture.capture_gate, "active", 1)
    assert capture_rows(torch.zeros(2, 4), [0], 2) is None


def test_a_stage_row_without_sampled_tokens_has_no_sampled_log_prob():
    from llm_otel.telemetry.logits import logit_stats

    row = stage_row(logit_stats(np.zeros((1, 4)), k=1), None, 0, 1, 5)
    assert row[0] == 5 and math.isnan(row[6]) and row[5] is False


def test_staged_rows_read_each_rows_own_position_of_the_sampled_tokens_and_mark_positions_without_one():
    """Speculative decoding: reduced row r reads sampled[sample_rows[r], pos[r]] of the
    (num_reqs, drafts + 1) output; -1 (V1's placeholder for a rejected draft), an id outside the
    vocabulary, or a position at or past ``num_valid`` (MRv2's num_sampled) is no token."""
    torch = pytest.importorskip("torch")
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    captured = capture_rows(logits, [0, 1, 2, 3, 4], 2)
    sampled = torch.tensor([[4, -1, 2], [5, 9, 1]])
    staged = captured.stage(sampled, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1])
    assert staged.ready()  # on CPU the data is on host at once
    stats, lp, tokens = staged.result()
    assert tokens.tolist() == [4, -1, 2, 5, -1]  # 9 is past the 6-token vocabulary
    want = torch.log_softmax(logits, dim=1)
    assert lp[[0, 2, 3]] == pytest.approx([float(want[0, 4]), float(want[2, 2]), float(want[3, 5])], abs=1e-6)
    assert np.isnan(lp[[1, 4]]).all()
    _, lp2, tokens2 = captured.stage(sampled, [0, 0, 0, 1, 1], [0, 1, 2, 0, 1], torch.tensor([3, 1])).result()
    assert tokens2.tolist() == [4, -1, 2, 5, -1] and np.isnan(lp2[4])
    # the synchronous path of every engine gives the same statistics
    sync, sync_lp = captured.to_host(sampled[:, :1].repeat(3, 1)[:5], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(sync.top_ids, stats.top_ids)
    np.testing.assert_array_equal(sync.entropy, stats.entropy)
