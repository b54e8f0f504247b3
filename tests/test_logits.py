"""Top-k, entropy and margin: NumPy and torch agree with a float64 reference; bad rows never raise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from llm_otel.telemetry.logits import logit_stats, perplexity, topk_logprob_stats


def reference(row: np.ndarray, k: int):
    x = row.astype(np.float64)
    logp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    p = np.exp(logp)
    order = np.argsort(-logp, kind="stable")[:k]
    return order, logp[order], float(-(p[p > 0] * logp[p > 0]).sum())


def test_numpy_matches_the_float64_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 50)) * 3
    s = logit_stats(x, k=5)
    for i in range(4):
        ids, lps, ent = reference(x[i], 5)
        assert list(s.top_ids[i]) == list(ids)
        assert s.top_logprobs[i] == pytest.approx(lps, abs=1e-9)
        assert s.entropy[i] == pytest.approx(ent, abs=1e-9)
        assert s.margin[i] == pytest.approx(lps[0] - lps[1], abs=1e-9)
    assert not s.nonfinite.any()


def test_torch_matches_numpy_including_half_precision():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 2048)).astype(np.float32) * 4
    ref = logit_stats(x, k=5)
    for tensor in (torch.from_numpy(x), torch.from_numpy(x).half()):
        got = logit_stats(tensor, k=5)
        tol = 1e-4 if tensor.dtype == torch.float32 else 2e-2
        assert got.entropy == pytest.approx(ref.entropy, abs=tol)
        assert got.top_logprobs == pytest.approx(ref.top_logprobs, abs=tol * 5)
        if tensor.dtype == torch.float32:
            assert (got.top_ids == ref.top_ids).all()


def test_huge_logits_are_stable():
    x = np.array([[1e4, 1e4 - 1.0, -1e4, 0.0]])
    s = logit_stats(x, k=2)
    assert np.isfinite(s.entropy).all()
    assert s.margin[0] == pytest.approx(1.0, abs=1e-6)


def test_logprob_input_gives_the_same_result_as_logits():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 30))
    lp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    a, b = logit_stats(x, k=4), logit_stats(lp, k=4, is_logprobs=True)
    assert a.entropy == pytest.approx(b.entropy) and (a.top_ids == b.top_ids).all()


def test_nan_inf_and_all_masked_rows_are_reported_not_raised():
    x = np.array(
        [
            [0.0, np.nan, 1.0],
            [np.inf, 0.0, 1.0],
            [-np.inf, -np.inf, -np.inf],
            [-np.inf, 0.0, 0.0],  # masked tokens are legitimate
        ]
    )
    s = logit_stats(x, k=2)
    assert list(s.nonfinite) == [True, True, True, False]
    assert np.isnan(s.entropy[:3]).all() and (s.top_ids[:3] == -1).all()
    assert s.entropy[3] == pytest.approx(math.log(2))
    assert s.margin[3] == pytest.approx(0.0)


def test_k_larger_than_vocab_and_one_dimensional_input():
    s = logit_stats(np.array([1.0, 2.0]), k=10)
    assert s.top_ids.shape == (1, 2) and list(s.top_ids[0]) == [1, 0]


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError):
        logit_stats([[1.0, 2.0]])
    with pytest.raises(ValueError):
        logit_stats(np.zeros((1, 2, 3)))
    with pytest.raises(ValueError):
        logit_stats(np.zeros((1, 3)), k=0)


@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(2, 64)), elements=st.floats(-50, 50, allow_nan=False)),
    st.integers(1, 8),
)
def test_properties_entropy_bounds_sorted_topk_nonnegative_margin(x, k):
    s = logit_stats(x, k=k)
    vocab = x.shape[1]
    assert ((s.entropy >= -1e-9) & (s.entropy <= math.log(vocab) + 1e-9)).all()
    assert (np.diff(s.top_logprobs, axis=1) <= 1e-12).all()
    if min(k, vocab) >= 2:
        assert (s.margin >= -1e-12).all()
    assert (s.top_logprobs <= 1e-12).all()


def test_topk_entropy_estimate_is_exact_when_topk_hold_all_mass_and_uniform_tail_otherwise():
    p = np.array([[0.5, 0.3, 0.2]])
    ent, margin, bad = topk_logprob_stats(np.log(p), vocab_size=10)
    assert ent[0] == pytest.approx(-(p * np.log(p)).sum())
    assert margin[0] == pytest.approx(np.log(0.5) - np.log(0.3))
    flat = np.full((1, 5), np.log(1 / 2048))  # top-5 of a uniform 2048-token distribution
    ent, _, _ = topk_logprob_stats(flat, vocab_size=2048)
    assert ent[0] == pytest.approx(math.log(2048), rel=1e-9)
    lower, _, _ = topk_logprob_stats(flat)  # no vocab size: the tail counts as one token
    assert lower[0] < 0.1


def test_topk_stats_flag_nan_rows():
    ent, margin, bad = topk_logprob_stats(np.array([[np.nan, -1.0], [-0.1, -3.0]]), vocab_size=5)
    assert list(bad) == [True, False] and np.isnan(ent[0]) and np.isnan(margin[0])


def test_perplexity_ignores_nonfinite_entries():
    assert perplexity(np.array([-1.0, -1.0, np.nan])) == pytest.approx(math.e)
    assert math.isnan(perplexity(np.array([np.nan])))
