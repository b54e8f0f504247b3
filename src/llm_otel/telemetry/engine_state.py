"""Engine-state metrics: what the engine's scheduler reports about itself each step.

Recorded in the process that runs the scheduler (vLLM: the engine-core process), from plain
values the engine adapter reads off the engine's own statistics (:class:`SchedulerState`; vLLM:
``SchedulerStats`` from ``Scheduler.make_stats()``, read by
:func:`llm_otel.instrumentation.vllm.engine_core.scheduler_state`):

* ``llm.server.kv_cache.usage`` (1): KV-cache blocks in use, last step's value;
* ``llm.server.prefix_cache.queries`` / ``.hits`` ({token}): per-step deltas of prompt tokens
  looked up / found in the prefix cache (hit ratio = rate(hits) / rate(queries));
* ``llm.server.requests.running`` / ``.waiting`` ({request});
* ``llm.server.spec_decode.draft_tokens`` / ``.accepted_tokens`` ({token}): draft tokens verified
  / accepted under speculative decoding, every step (vLLM: counted from the step's
  ``SchedulerOutput`` and ``ModelRunnerOutput`` as ``Scheduler.update_from_output`` counts them).

A value the installed engine does not report leaves its metric absent (never zero), logged once.
:class:`PhaseClock` tells which phase (prefill / decode / idle) the engine spent most of the
last second on, for the GPU metrics (:mod:`llm_otel.gpu.metrics`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from llm_otel.gpu.metrics import GpuMetrics, register_gpu_metrics
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")

PREFILL, DECODE, IDLE = "prefill", "decode", "idle"


class PhaseClock:
    """Records each engine step's wall interval (``time.monotonic()`` s) and whether it scheduled
    prompt tokens; :meth:`phase` returns the phase that covered most of the last ``window_s``
    seconds, ``idle`` counting the time no step ran. Bounded: the last ``maxlen`` steps."""

    def __init__(self, window_s: float = 1.0, maxlen: int = 8192) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float, bool]] = deque(maxlen=maxlen)

    def on_step(self, start_mono: float, end_mono: float, prefill: bool) -> None:
        """One engine step from ``start_mono`` to ``end_mono``; O(1), called on the engine loop."""
        self._steps.append((start_mono, end_mono, prefill))

    def phase(self, now: float | None = None) -> str:
        """``prefill``, ``decode`` or ``idle``: the largest share of ``[now - window_s, now]``."""
        now = time.monotonic() if now is None else now
        lo = now - self.window_s
        busy = {PREFILL: 0.0, DECODE: 0.0}
        for start, end, prefill in reversed(list(self._steps)):  # list(): one atomic copy
            if end <= lo:
                break
            overlap = min(end, now) - max(start, lo)
            if overlap > 0:
                busy[PREFILL if prefill else DECODE] += overlap
        idle = max(0.0, self.window_s - busy[PREFILL] - busy[DECODE])
        return max((busy[PREFILL], PREFILL), (busy[DECODE], DECODE), (idle, IDLE))[1]


class SchedulerState(NamedTuple):
    """One step's scheduler statistics as plain values; None = the engine does not report it.

    Attributes:
        kv_cache_usage: fraction (0-1) of the KV-cache blocks in use.
        running / waiting: requests in the running batch / waiting to be scheduled.
        prefix_queries / prefix_hits: prompt tokens looked up in / found in the prefix cache
            during this step (deltas; both None when the engine reports no prefix-cache statistics).
    """

    kv_cache_usage: float | None
    running: int | None
    waiting: int | None
    prefix_queries: int | None
    prefix_hits: int | None


def engine_state_instruments(
    telemetry: Any, phase: Callable[[], str], dp_rank: int | None = None
) -> tuple[EngineStateMetrics, GpuMetrics | None]:
    """The engine-state instruments and the per-GPU gauges (by ``phase()``, see
    :class:`PhaseClock`) on the telemetry's meter, for the process that runs the scheduler."""
    meter = telemetry.instruments.meter
    return EngineStateMetrics(meter, dp_rank=dp_rank), register_gpu_metrics(meter, phase)


class EngineStateMetrics:
    """Instruments fed by the engine's per-step scheduler statistics.

    ``on_step_state(state, model)`` is called once per engine step with a :class:`SchedulerState`
    (or None when the engine does not collect statistics) - O(1), no I/O.
    """

    def __init__(self, meter: Meter, provider: str = "vllm", dp_rank: int | None = None) -> None:
        self.provider = provider
        self.dp_rank = dp_rank  # on every point, as vLLM's own engine=<dp rank> label
        self.attrs: dict[str, str | int] | None = None
        self._kv: float | None = None
        self._running: int | None = None
        self._waiting: int | None = None
        self._warned: set[str] = set()
        self._seen_prefix = False
        self.hits = meter.create_counter(
            M.LLM_SERVER_PREFIX_CACHE_HITS,
            unit=M.LLM_SERVER_PREFIX_CACHE_HITS_UNIT,
            description="Prompt tokens found in the engine's prefix cache.",
        )
        self.queries = meter.create_counter(
            M.LLM_SERVER_PREFIX_CACHE_QUERIES,
            unit=M.LLM_SERVER_PREFIX_CACHE_QUERIES_UNIT,
            description="Prompt tokens looked up in the engine's prefix cache.",
        )
        self.draft_tokens = meter.create_counter(
            M.LLM_SERVER_SPEC_DECODE_DRAFT_TOKENS,
            unit=M.LLM_SERVER_SPEC_DECODE_DRAFT_TOKENS_UNIT,
            description="Draft tokens the engine verified under speculative decoding.",
        )
        self.accepted_tokens = meter.create_counter(
            M.LLM_SERVER_SPEC_DECODE_ACCEPTED_TOKENS,
            unit=M.LLM_SERVER_SPEC_DECODE_ACCEPTED_TOKENS_UNIT,
            description="Draft tokens the engine accepted under speculative decoding.",
        )

        def gauge(name: str, unit: str, field: str, description: str) -> None:
            def observe(_options: CallbackOptions) -> list[Observation]:
                value = getattr(self, field)
                return [] if value is None or self.attrs is None else [Observation(value, self.attrs)]

            meter.create_observable_gauge(name, callbacks=[observe], unit=unit, description=description)

        gauge(
            M.LLM_SERVER_KV_CACHE_USAGE,
            M.LLM_SERVER_KV_CACHE_USAGE_UNIT,
            "_kv",
            "Fraction of the engine's KV-cache blocks in use.",
        )
        gauge(
            M.LLM_SERVER_REQUESTS_RUNNING,
            M.LLM_SERVER_REQUESTS_RUNNING_UNIT,
            "_running",
            "Requests in the engine's running batch.",
        )
        gauge(
            M.LLM_SERVER_REQUESTS_WAITING,
            M.LLM_SERVER_REQUESTS_WAITING_UNIT,
            "_waiting",
            "Requests waiting to be scheduled.",
        )

    def _missing(self, what: str, why: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.info("llm-otel: %s; the metrics from it are absent", why)

    def _attrs_for(self, model: str) -> dict[str, str | int]:
        if self.attrs is None or self.attrs[A.GEN_AI_REQUEST_MODEL] != model:
            self.attrs = {A.GEN_AI_PROVIDER_NAME: self.provider, A.GEN_AI_REQUEST_MODEL: model}
            if self.dp_rank is not None:
                self.attrs[A.LLM_PROCESS_DATA_PARALLEL_RANK] = self.dp_rank
        return self.attrs

    def on_spec_decode(self, draft_tokens: int, accepted_tokens: int, model: str) -> None:
        """One step's speculative-decoding counts (tokens): drafts verified, drafts accepted.
        O(1); called only for steps that verified drafts."""
        attrs = self._attrs_for(model)
        self.draft_tokens.add(draft_tokens, attrs)
        self.accepted_tokens.add(accepted_tokens, attrs)

    def on_step_state(self, state: SchedulerState | None, model: str) -> None:
        if state is None:
            self._missing(
                "stats",
                "the engine reports no scheduler statistics (vLLM log_stats is off, "
                "e.g. LLM_OTEL_VLLM_ENGINE_EVENTS=false)",
            )
            return
        attrs = self._attrs_for(model)
        if state.kv_cache_usage is None:
            self._missing("kv", "the engine's scheduler statistics carry no kv_cache_usage")
        else:
            self._kv = float(state.kv_cache_usage)
        running, waiting = state.running, state.waiting
        if running is None or waiting is None:
            self._missing("queue", "the engine's scheduler statistics carry no num_running_reqs/num_waiting_reqs")
        if running is not None:
            self._running = int(running)
        if waiting is not None:
            self._waiting = int(waiting)
        if state.prefix_queries is None:
            self._missing("prefix", "the engine's scheduler statistics carry no prefix_cache_stats")
            return
        queries = int(state.prefix_queries)
        if queries or not self._seen_prefix:
            # the counters exist (at 0) as soon as the engine reports prefix-cache statistics at all
            self._seen_prefix = True
            self.queries.add(queries, attrs)
            self.hits.add(int(state.prefix_hits or 0), attrs)
