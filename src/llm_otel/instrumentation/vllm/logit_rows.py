"""Which logit rows belong to which request in the vLLM worker, and each chosen request's
statistics until its ``llm.logit_dist`` span is built (:mod:`~.worker`): the requests chosen for
logit statistics (per MRv2 request-state slot, matched to a step's batch with one NumPy gather),
one step's chosen rows (:class:`Plan`), and :class:`Streams` - the per-request statistics and the
queue of steps whose statistics are still on their way to host.

Deferred collection (no device sync on the step path): a step's statistics are staged with a
non-blocking copy and a CUDA event (:meth:`~llm_otel.telemetry.logit_capture.StepLogits.stage`);
each later hook call (and the idle flusher) polls the queue's oldest events and collects every
step whose copy has completed, in step order. The queue is bounded (:data:`MAX_PENDING` steps:
past it the oldest is waited for). A request's span is built only when none of its steps is
still pending, so a request that finishes before its last rows are collected is emitted when
they are - with every row attributed to the step (time) and request it was reduced for.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.spans import emit_logit_dist_for

MAX_STEPS_PER_REQUEST = 1 << 16
MAX_PENDING = 32  # staged steps awaiting their device copy; past it the oldest is waited for
HELD_IDLE_S = 120.0  # a request vLLM still holds is emitted by the idle flush only after this long


class Stream:
    """One request's logit statistics so far: ``(step, row)`` pairs into the per-step arrays
    (stacked once, when the span is built). ``pending``: its steps still on their way to host;
    ``n_tokens``: output tokens reported so far; ``done``: its last token was seen (``max_tokens``
    or a stop token); ``ended``: vLLM no longer holds it; ``live``: vLLM's request map at its last
    step (read by the idle flush); ``mrv2``: made by the MRv2 sampler hooks."""

    __slots__ = (
        "live",
        "parent",
        "k",
        "max_tokens",
        "stops",
        "rows",
        "last_mono",
        "pending",
        "n_tokens",
        "done",
        "ended",
        "mrv2",
    )

    def __init__(self, parent, k: int, max_tokens: int | None, stops: frozenset[int] = frozenset()) -> None:
        self.parent = parent
        self.k = k
        self.max_tokens = max_tokens
        self.stops = stops
        self.rows: list[tuple[tuple, int]] = []  # (step, row); step = (time_ns, stats, sampled_lp)
        self.last_mono = time.monotonic()
        self.pending = 0
        self.n_tokens = 0
        self.done = False
        self.ended = False
        self.mrv2 = False
        self.live: Any = None


class Plan:
    """One step's chosen rows, reduced before the sampler ran.

    ``members[m]`` = ``(req_id, extra_args, max_tokens, output tokens before this step or None,
    stop token ids)``; per reduced row r (row r of ``captured``'s statistics): ``owner[r]`` its
    member, ``pos[r]`` its position among the member's rows this step (0: the step's first new
    token; under speculative decoding the draft positions, then the bonus row), ``sample_rows[r]``
    its row in the sampler's ``sampled_token_ids`` (column ``pos[r]``)."""

    __slots__ = ("members", "owner", "pos", "sample_rows", "captured")

    def __init__(self, members: list[tuple], owner: list[int], pos: list[int], sample_rows: list[int]) -> None:
        self.members = members
        self.owner = owner
        self.pos = pos
        self.sample_rows = sample_rows
        self.captured: Any = None  # StepLogits


class _Pending:
    __slots__ = ("time_ns", "plan", "streams", "staged")

    def __init__(self, time_ns: int, plan: Plan, streams: list[Stream | None], staged: Any) -> None:
        self.time_ns = time_ns
        self.plan = plan
        self.streams = streams
        self.staged = staged


class Streams:
    """The chosen requests' statistics (by request id) and the steps pending collection.

    Called from the engine's thread (:meth:`add`, :meth:`poll`) and the idle flusher
    (:meth:`flush`); a lock guards both maps, and the device is never waited for under it except
    for the oldest step once :data:`MAX_PENDING` is exceeded (engine thread) or at the final flush.
    ``emit(stream)`` builds a span (called outside the lock)."""

    def __init__(self, emit: Callable[[Stream], None], make_parent: Callable[[dict], Any]) -> None:
        self.streams: dict[str, Stream] = {}
        self.pending: collections.deque[_Pending] = collections.deque()
        self.gone_mrv2: set[str] = set()  # emitted MRv2 requests whose slots the sampler hook forgets
        self._emit = emit
        self._parent = make_parent
        self._lock = threading.Lock()

    def add(self, plan: Plan, staged: Any, live: Any, *, mrv2: bool = False) -> None:
        """Queue one step's ``staged`` statistics (:class:`~llm_otel.telemetry.logit_capture.StagedLogits`)
        for ``plan``'s members, collect what is ready, and emit the streams that are complete;
        streams of requests absent from ``live`` (vLLM's own request map) are complete once their
        pending steps are collected."""
        from llm_otel.instrumentation.vllm.carrier import CARRIER_TOPK_KEY

        now_ns, now_mono = time.time_ns(), time.monotonic()
        with self._lock:
            streams = self.streams
            mine: list[Stream | None] = []
            for req_id, extra, max_tokens, _, stops in plan.members:
                stream = streams.get(req_id)
                if stream is None:
                    parent = self._parent(extra)
                    if parent is not None:
                        stream = streams[req_id] = Stream(parent, int(extra[CARRIER_TOPK_KEY]), max_tokens, stops)
                        stream.mrv2 = mrv2
                if stream is not None:
                    stream.pending += 1
                    stream.last_mono = now_mono
                    stream.live = live
                mine.append(stream)
            self.pending.append(_Pending(now_ns, plan, mine, staged))
            while len(self.pending) > MAX_PENDING:
                self._collect(self.pending.popleft())  # waits for the oldest copy: the bound
            self._drain()
            for req_id, stream in streams.items():
                if req_id not in live:
                    stream.ended = True
            finished = self._take_complete()
        self._emit_all(finished)

    def poll(self, *, wait: bool = False) -> None:
        """Collect the pending steps whose copies completed (all of them, waiting, with ``wait``)
        and emit the streams that are complete. Cheap when nothing is pending."""
        if not self.pending:
            return
        with self._lock:
            if wait:
                while self.pending:
                    self._collect(self.pending.popleft())
            else:
                self._drain()
            finished = self._take_complete()
        self._emit_all(finished)

    def flush(self, idle_s: float) -> int:
        """Emit streams that saw no step for ``idle_s`` seconds once their pending steps are
        collected and vLLM no longer holds their request (or it saw no step for
        :data:`HELD_IDLE_S`: a request that waits between steps - vLLM's first ngram proposal
        compiles for seconds, a preempted request waits for KV blocks - keeps one span); with
        ``idle_s`` 0: wait for every pending step and emit every stream."""
        self.poll(wait=idle_s <= 0)
        now = time.monotonic()
        cutoff, held_cutoff = now - idle_s, now - max(idle_s, HELD_IDLE_S)
        with self._lock:
            stale = [
                r
                for r, s in self.streams.items()
                if s.pending == 0
                and s.last_mono <= cutoff
                and (idle_s <= 0 or s.last_mono <= held_cutoff or s.live is None or r not in s.live)
            ]
            finished = [(r, self.streams.pop(r)) for r in stale]
            self.gone_mrv2.update(r for r, s in finished if s.mrv2)
        self._emit_all(finished)
        return len(finished)

    # --- under the lock -----------------------------------------------------------------------
    def _drain(self) -> None:
        pending = self.pending
        while pending and pending[0].staged.ready():
            self._collect(pending.popleft())

    def _collect(self, entry: _Pending) -> None:
        """One step's host statistics into its members' streams: per member the rows with an
        emitted token (token id >= 0), in position order, up to its last token (``max_tokens``
        reached, or a stop token: vLLM's scheduler drops a step's tokens after it)."""
        stats, sampled_lp, tokens = entry.staged.result()
        step = (entry.time_ns, stats, sampled_lp)
        plan = entry.plan
        base: dict[int, int] = {}
        for r, m in enumerate(plan.owner):
            stream = entry.streams[m]
            if stream is None or stream.done:
                continue
            token = int(tokens[r]) if tokens is not None else None
            if token is not None and token < 0:
                continue  # a rejected draft, or a position past the step's emitted tokens
            if m not in base:
                before = plan.members[m][3]
                base[m] = before if before is not None else stream.n_tokens
            if len(stream.rows) < MAX_STEPS_PER_REQUEST:
                stream.rows.append((step, r))
            stream.n_tokens += 1
            n_out = base[m] + plan.pos[r] + 1
            if (stream.max_tokens is not None and n_out >= stream.max_tokens) or (
                token is not None and token in stream.stops
            ):
                stream.done = True
        for stream in entry.streams:
            if stream is not None:
                stream.pending -= 1

    def _take_complete(self) -> list[tuple[str, Stream]]:
        done = [r for r, s in self.streams.items() if (s.done or s.ended) and s.pending == 0]
        finished = [(r, self.streams.pop(r)) for r in done]
        self.gone_mrv2.update(r for r, s in finished if s.mrv2)
        return finished

    def take_gone_mrv2(self) -> set[str]:
        """The MRv2 requests emitted since the last call (their slots can be forgotten)."""
        with self._lock:
            gone, self.gone_mrv2 = self.gone_mrv2, set()
        return gone

    def _emit_all(self, finished: list[tuple[str, Stream]]) -> None:
        for _req_id, stream in finished:
            self._emit(stream)


class Chosen:
    """A request chosen for logit statistics, remembered per MRv2 request-state slot."""

    __slots__ = ("req_id", "extra", "max_tokens", "stops")

    def __init__(
        self, req_id: str | None, extra: dict, max_tokens: int | None, stops: frozenset[int] = frozenset()
    ) -> None:
        self.req_id = req_id
        self.extra = extra
        self.max_tokens = max_tokens
        self.stops = stops


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


def emit_stream(telemetry: Telemetry, stream: Stream) -> None:
    """Build ``stream``'s ``llm.logit_dist`` span (nothing for a stream without rows)."""
    if not stream.rows:
        return
    k = stream.k
    steps = stream.rows
    times_ns = [st[0] for st, _ in steps]
    top_ids = np.stack([st[1].top_ids[j, :k] for st, j in steps])
    top_lp = np.stack([st[1].top_logprobs[j, :k] for st, j in steps])
    entropy = np.array([st[1].entropy[j] for st, j in steps], dtype=np.float64)
    margin = np.array([st[1].margin[j] for st, j in steps], dtype=np.float64)
    nonfinite = np.array([st[1].nonfinite[j] for st, j in steps], dtype=bool)
    sampled_lp = np.array([st[2][j] if st[2] is not None else np.nan for st, j in steps], dtype=np.float64)
    emit_logit_dist_for(
        telemetry,
        stream.parent,
        source="full_vocab_logits",
        start_ns=times_ns[0],
        end_ns=times_ns[-1],
        times_ns=times_ns,
        top_ids=top_ids,
        top_logprobs=top_lp,
        sampled_logprobs=sampled_lp,
        entropy=entropy,
        margin=margin,
        nonfinite=nonfinite,
    )


def stops_of(sp: Any) -> frozenset[int]:
    """The token ids that end a request (``SamplingParams.eos_token_id`` - None with
    ``ignore_eos`` - and ``stop_token_ids``): vLLM's scheduler (``check_stop``) drops a step's
    tokens after the first of them."""
    eos = getattr(sp, "eos_token_id", None)
    ids = getattr(sp, "stop_token_ids", None) or ()
    return frozenset(int(t) for t in (eos, *ids) if t is not None)
