"""Which logit rows belong to which request in the vLLM worker: the requests chosen for logit
statistics (per MRv2 request-state slot, matched to a step's batch with one NumPy gather) and
each chosen request's statistics so far, until its ``llm.logit_dist`` span is built
(:mod:`~.worker`).
"""

from __future__ import annotations

import time

import numpy as np


class Stream:
    """One request's logit statistics so far: ``(step, row)`` pairs into the per-step arrays
    (one tuple per step and request on the engine's thread; stacked once, when the span is built)."""

    __slots__ = ("parent", "k", "max_tokens", "rows", "last_mono")

    def __init__(self, parent, k: int, max_tokens: int | None) -> None:
        self.parent = parent
        self.k = k
        self.max_tokens = max_tokens
        self.rows: list[tuple[tuple, int]] = []  # (step, row); step = (time_ns, stats, sampled_lp)
        self.last_mono = time.monotonic()


class Chosen:
    """A request chosen for logit statistics, remembered per MRv2 request-state slot."""

    __slots__ = ("req_id", "extra", "max_tokens")

    def __init__(self, req_id: str | None, extra: dict, max_tokens: int | None) -> None:
        self.req_id = req_id
        self.extra = extra
        self.max_tokens = max_tokens


class Slots(dict[int, "Chosen"]):
    """MRv2 request-state slot -> :class:`Chosen` of one Sampler, with ``mask[slot]`` True for the
    chosen slots so a step's batch is matched with one NumPy gather (``mask[idx_mapping_np]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = np.zeros(64, dtype=bool)

    def choose(self, slot: int, chosen: Chosen) -> None:
        if slot >= len(self.mask):
            self.mask = np.concatenate([self.mask, np.zeros(max(slot + 1, 2 * len(self.mask)) - len(self.mask), bool)])
        self.mask[slot] = True
        self[slot] = chosen

    def forget(self, slot: int) -> None:
        if self.pop(slot, None) is not None:
            self.mask[slot] = False

    def matches(self, idx_mapping: np.ndarray) -> np.ndarray:
        """Bool per batch row: its slot holds a chosen request."""
        if len(idx_mapping) and int(idx_mapping.max()) >= len(self.mask):
            self.mask = np.concatenate([self.mask, np.zeros(int(idx_mapping.max()) + 1 - len(self.mask), bool)])
        return self.mask[idx_mapping]
