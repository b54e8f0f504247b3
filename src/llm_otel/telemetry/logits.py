"""Next-token distribution statistics: top-k, entropy, top-1/top-2 margin.

Two entry points:

* :func:`logit_stats` - from a full ``(batch, vocab)`` array of logits or log-probs, as NumPy,
  torch (any device) or CuPy. Work happens in the array's own library and device; only the small
  ``(batch, k)`` and ``(batch,)`` results are moved to host NumPy - never the vocabulary.
* :func:`topk_logprob_stats` - from the top-k log-probs an engine already returned (vLLM
  ``LogprobsLists``), where the rest of the vocabulary is unknown: entropy is then estimated with
  the unreturned probability mass spread evenly over the other tokens.

All values are natural-log units (nats). Numerically stable (log-sum-exp). Rows with NaN, +inf or
nothing finite are reported in ``nonfinite`` with NaN statistics - never raised.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray


@dataclasses.dataclass(frozen=True)
class LogitStats:
    """Per-row statistics of a batch of next-token distributions (host NumPy arrays).

    Attributes:
        top_ids: ``(batch, k)`` int64 vocabulary ids, most likely first (-1 in non-finite rows).
        top_logprobs: ``(batch, k)`` float64 log-probs of those ids, nats (NaN in non-finite rows).
        entropy: ``(batch,)`` float64 Shannon entropy, nats (NaN in non-finite rows).
        margin: ``(batch,)`` float64 top-1 minus top-2 log-prob, nats (NaN if k < 2 or non-finite).
        nonfinite: ``(batch,)`` bool, True where the row had NaN or +inf, or no finite value.
    """

    top_ids: np.ndarray
    top_logprobs: np.ndarray
    entropy: np.ndarray
    margin: np.ndarray
    nonfinite: np.ndarray


def logit_stats(x: Any, k: int = 5, *, is_logprobs: bool = False) -> LogitStats:
    """Top-k, entropy and margin for each row of ``x``.

    Args:
        x: ``(batch, vocab)`` float logits (or log-probs when ``is_logprobs``) as ``numpy.ndarray``,
            ``torch.Tensor`` (CPU or CUDA) or ``cupy.ndarray``. A 1-D array is one row.
        k: number of top entries kept per row, clipped to the vocabulary size.
        is_logprobs: ``x`` already holds log-probs; they are renormalised all the same.

    Returns:
        :class:`LogitStats` of host NumPy arrays. One device-to-host transfer of ``(batch, 2k+2)``
        numbers; the ``(batch, vocab)`` input never leaves its device.

    Raises:
        TypeError: ``x`` is not an array of one of the supported libraries.
        ValueError: ``x`` is not 1-D or 2-D, or ``k`` < 1.
    """
    del is_logprobs  # log-softmax is idempotent on log-probs; kept for call-site clarity
    if k < 1:
        raise ValueError("k must be >= 1")
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return _torch_stats(x, k)
    if mod in ("numpy", "cupy"):
        return _xp_stats(x, k)
    raise TypeError(f"unsupported array type {type(x).__module__}.{type(x).__name__}")


def _check_shape(ndim: int) -> None:
    if ndim not in (1, 2):
        raise ValueError(f"expected a (batch, vocab) array, got {ndim} dimensions")


def _xp_stats(x: Any, k: int) -> LogitStats:
    xp = np if type(x).__module__.startswith("numpy") else __import__("cupy")
    _check_shape(x.ndim)
    if x.ndim == 1:
        x = x[None, :]
    x = x.astype(xp.float64 if x.dtype == xp.float64 else xp.float32, copy=False)
    k = min(k, x.shape[1])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # bad rows are flagged below
        bad = xp.isnan(x) | xp.isposinf(x)
        nonfinite = bad.any(axis=1) | xp.isneginf(x).all(axis=1)
        safe = xp.where(bad, -xp.inf, x)
        row_max = safe.max(axis=1, keepdims=True)
        row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
        shifted = safe - row_max
        lse = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        logp = shifted - lse
        p = xp.exp(logp)
        entropy = -xp.where(p > 0, p * logp, 0.0).sum(axis=1)
    part = xp.argpartition(-logp, k - 1, axis=1)[:, :k]
    part_lp = xp.take_along_axis(logp, part, axis=1)
    order = xp.argsort(-part_lp, axis=1)
    top_ids = xp.take_along_axis(part, order, axis=1)
    top_lp = xp.take_along_axis(part_lp, order, axis=1)
    packed = xp.concatenate(
        [
            top_ids.astype(xp.float64),
            top_lp.astype(xp.float64),
            entropy[:, None].astype(xp.float64),
            nonfinite[:, None].astype(xp.float64),
        ],
        axis=1,
    )
    host = packed if xp is np else packed.get()
    return _unpack(host, k)


def _torch_stats(x: Any, k: int) -> LogitStats:
    return TorchLogitStats(x, k).to_host()[0]


class TorchLogitStats:
    """Statistics of a torch ``(rows, vocab)`` logits tensor, computed on its device at construction
    (before the engine's sampler may modify the logits in place); :meth:`to_host` gathers the
    sampled tokens' log-probs and moves everything to host in one ``(rows, 2k+3)`` transfer.

    Raises ValueError for a tensor that is not 1-D or 2-D.
    """

    def __init__(self, x: Any, k: int) -> None:
        import torch

        _check_shape(x.dim())
        with torch.no_grad():
            if x.dim() == 1:
                x = x.unsqueeze(0)
            self.k = k = min(k, x.shape[1])
            # a NaN or +inf anywhere in a row, or a row of -inf only, makes its maximum non-finite
            # (amax propagates NaN); such rows are reported as non-finite and their statistics
            # discarded (_unpack), so nothing needs masking: five passes over the logits in all.
            # bf16/fp16 logits are read in their own dtype (no float32 copy of the rows):
            # log_softmax upcasts while it reads, and writes float32
            self.nonfinite = ~torch.isfinite(x.amax(dim=1))
            work = torch.float64 if x.dtype == torch.float64 else torch.float32
            self.logp = torch.log_softmax(x, dim=1, dtype=work)  # log-sum-exp inside
            # -inf logits (masked tokens) have p = 0 and log p = -inf: clamping log p to the
            # dtype's lowest finite value makes their term 0 * finite = 0 (the limit), with no
            # data-dependent branch (a branch would synchronise the engine's CUDA stream)
            floor = torch.finfo(self.logp.dtype).min
            self.entropy = -(self.logp.exp() * self.logp.clamp(min=floor)).sum(dim=1)
            self.top_lp, self.top_ids = torch.topk(self.logp, k, dim=1)

    def pack(self, sampled_ids: Any = None) -> Any:
        """The statistics as one ``(rows, 2k+2)`` float64 tensor on the logits' device, nothing
        moved to host: top ids, top log-probs, entropy, non-finite flag; with ``sampled_ids``
        (``(rows,)`` token ids, -1 or >= vocab for none) two more columns: the sampled token's
        log-prob (NaN for none) and the token id itself (-1 for none). Launches work only, never
        waits for the device (no data-dependent branch)."""
        import torch

        with torch.no_grad():
            parts = [
                self.top_ids.double(),
                self.top_lp.double(),
                self.entropy[:, None].double(),
                self.nonfinite[:, None].double(),
            ]
            if sampled_ids is not None:
                ids = sampled_ids.reshape(-1, 1).long().to(self.logp.device)
                vocab = self.logp.shape[1]
                valid = (ids >= 0) & (ids < vocab)
                lp = self.logp.gather(1, ids.clamp(0, vocab - 1)).double()
                parts.append(torch.where(valid, lp, torch.full_like(lp, float("nan"))))
                parts.append(torch.where(valid, ids, torch.full_like(ids, -1)).double())
            return torch.cat(parts, dim=1)

    def to_host(self, sampled_ids: Any = None) -> tuple[LogitStats, np.ndarray | None]:
        """``(LogitStats, sampled log-probs (rows,) or None)``; ``sampled_ids``: ``(rows,)`` token ids.
        One synchronous ``(rows, 2k+4)`` transfer (:meth:`pack`)."""
        stats, sampled_lp, _ = unpack_packed(self.pack(sampled_ids).cpu().numpy(), self.k, sampled_ids is not None)
        return stats, sampled_lp


def unpack_packed(
    host: np.ndarray, k: int, with_sampled: bool
) -> tuple[LogitStats, np.ndarray | None, np.ndarray | None]:
    """A host copy of :meth:`TorchLogitStats.pack` as ``(LogitStats, sampled log-probs (rows,),
    sampled token ids (rows,) int64, -1 for none)``; the last two None without sampled columns."""
    stats = _unpack(host[:, : 2 * k + 2], k)
    if not with_sampled:
        return stats, None, None
    return stats, host[:, 2 * k + 2].copy(), host[:, 2 * k + 3].astype(np.int64)


def _unpack(host: np.ndarray, k: int) -> LogitStats:
    nonfinite = host[:, 2 * k + 1] > 0.5
    top_ids = host[:, :k].astype(np.int64)
    top_lp = host[:, k : 2 * k].copy()
    entropy = host[:, 2 * k].copy()
    top_ids[nonfinite] = -1
    top_lp[nonfinite] = np.nan
    entropy[nonfinite] = np.nan
    margin = top_lp[:, 0] - top_lp[:, 1] if k >= 2 else np.full(len(host), np.nan)
    return LogitStats(top_ids, top_lp, entropy, margin, nonfinite)


def topk_logprob_stats(
    top_logprobs: np.ndarray, vocab_size: int | None = None
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.bool_]]:
    """Entropy estimate, margin and non-finite flag from engine-returned top-k log-probs.

    Args:
        top_logprobs: ``(steps, k)`` log-probs (nats) of each step's k most likely tokens, in any
            order (vLLM ``LogprobsLists.logprobs[:, 1:]``).
        vocab_size: size of the vocabulary (vLLM ``ModelConfig.get_vocab_size()``).

    Returns:
        ``(entropy, margin, nonfinite)``, each ``(steps,)``. With r = 1 - sum p_i the mass the
        engine did not return, ``entropy`` = -sum p_i log p_i - r log(r / (vocab_size - k)): the
        tail spread uniformly over the other tokens, which is the largest entropy consistent with
        the top-k (exact when r = 0; close to the truth both for peaked distributions, where r is
        small, and for flat ones). Without ``vocab_size`` the tail counts as one token (the
        smallest consistent entropy). ``margin`` = top-1 minus top-2 log-prob (NaN when k < 2);
        ``nonfinite`` flags rows with NaN or +inf (their statistics are NaN); ``-inf`` entries are
        tokens of probability 0.
    """
    lp = np.asarray(top_logprobs, dtype=np.float64)
    if lp.ndim == 1:
        lp = lp[None, :]
    nonfinite = np.isnan(lp).any(axis=1) | np.isposinf(lp).any(axis=1) | np.isneginf(lp).all(axis=1)
    safe = np.where(np.isfinite(lp), lp, -np.inf)
    others = max(1, (vocab_size or 0) - lp.shape[1])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        p = np.exp(safe)
        head = -np.where(p > 0, p * safe, 0.0).sum(axis=1)
        rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
        tail = -np.where(rest > 0, rest * np.log(np.where(rest > 0, rest, 1.0) / others), 0.0)
    entropy: NDArray[np.float64] = head + tail
    srt = -np.sort(-safe, axis=1)
    margin = srt[:, 0] - srt[:, 1] if lp.shape[1] >= 2 else np.full(len(lp), np.nan)
    entropy[nonfinite] = np.nan
    margin = np.where(nonfinite, np.nan, margin)
    return entropy, margin, cast("NDArray[np.bool_]", nonfinite)  # any(axis=1) of a 2-d array: an array


def perplexity(sampled_logprobs: np.ndarray) -> float:
    """exp(-mean log-prob) of the sampled tokens (finite entries only); NaN when none."""
    lp = np.asarray(sampled_logprobs, dtype=np.float64)
    lp = lp[np.isfinite(lp)]
    if lp.size == 0:
        return math.nan
    return float(math.exp(min(-lp.mean(), 700.0)))
