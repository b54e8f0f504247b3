"""Engine-core side of the vLLM adapter: reads each scheduler step and calls the core's step API
(:class:`~llm_otel.telemetry.steps.EngineSteps`), which builds the ``llm.engine.step`` span.

Engine fields read (vLLM 0.32): ``Scheduler.schedule()`` returns the step's ``SchedulerOutput``
(``num_scheduled_tokens`` {req_id: tokens}, ``total_num_scheduled_tokens``, ``preempted_req_ids``,
``finished_req_ids``; prefill/decode token counts in :mod:`~llm_otel.instrumentation.vllm.carrier`);
``Scheduler.requests[req_id].sampling_params.extra_args`` holds the carrier the frontend put
there (the request span's ``traceparent``), which becomes the step span's link to that request.

``Scheduler.make_stats()`` returns the step's ``SchedulerStats`` (``kv_cache_usage``,
``prefix_cache_stats.queries``/``.hits``, ``num_running_reqs``/``num_waiting_reqs``), read into a
:class:`~llm_otel.telemetry.engine_state.SchedulerState` for the engine-state metrics; each
step's interval and whether it scheduled prompt tokens feed the GPU metrics' phase.

A step gets a span only when at least one request in its batch is sampled (unsampled traffic
costs a dict lookup per request per step) and the step-span budget allows it. The span starts at
the step's start (explicit time) once ``schedule()`` has chosen the batch, its ids ride on the
``SchedulerOutput`` to the worker, which records the step on the device timeline (docs/gpu.md),
and this adapter ends it with the step - whether the worker runs in this process or another.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from llm_otel.instrumentation.vllm.carrier import request_span_context, set_step_ids, step_has_prefill, step_tokens
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.engine_state import EngineStateMetrics, PhaseClock, SchedulerState, engine_state_instruments
from llm_otel.telemetry.steps import EngineSteps

if TYPE_CHECKING:
    from llm_otel.gpu.metrics import GpuMetrics

MAX_CACHED_LINKS = 100_000


class EngineCoreAdapter:
    """Wrapper factories for ``Scheduler.schedule``, ``Scheduler.make_stats`` and ``EngineCore.step``.

    The step span starts when ``schedule()`` has chosen the batch - before the model runs - so its
    ids can travel with the ``SchedulerOutput`` to the worker (:func:`~llm_otel.instrumentation.vllm.carrier.set_step_ids`),
    whose device records and NVTX range carry them; it ends with ``EngineCore.step``. The device
    timing is the worker's child span ``llm.engine.step.device``, in this process or another.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._request_spans: dict[str, Any] = {}  # req id -> sampled request SpanContext | None
        self._last_output: Any = None
        self._step_start_ns: int | None = None
        self._span: Any = None
        self.step_spans = EngineSteps(telemetry)
        self.phase_clock = PhaseClock()
        self.state_metrics: EngineStateMetrics | None = None
        self.gpu_metrics: GpuMetrics | None = None
        self._model: str | None = None

    def engine_metrics(self) -> EngineStateMetrics:
        """Engine-state and GPU instruments, created on first use: only in the process that runs
        the scheduler (vLLM's engine core, or the frontend when the core runs in-process)."""
        if self.state_metrics is None:
            from llm_otel.instrumentation.vllm.process import vllm_dp_rank

            self.state_metrics, self.gpu_metrics = engine_state_instruments(
                self.telemetry, self.phase_clock.phase, dp_rank=vllm_dp_rank()
            )
        return self.state_metrics

    def make_stats(self, hook: str):
        """Scheduler.make_stats: read the statistics vLLM builds for its own loggers."""

        def wrapper(wrapped, instance, args, kwargs):
            stats = wrapped(*args, **kwargs)
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if self._model is None:
                    self._model = _served_model(instance)
                self.engine_metrics().on_step_state(scheduler_state(stats), self._model)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return stats

        return wrapper

    def schedule(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            output = wrapped(*args, **kwargs)
            self._last_output = output  # the engine core's busy loop is one thread
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if self._span is None and getattr(output, "total_num_scheduled_tokens", 0):
                    self._start(instance, output)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return output

        return wrapper

    def step(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            self._last_output = None
            self._span = None
            self._step_start_ns = time.time_ns()
            start_mono = time.monotonic()
            cpu0 = time.thread_time_ns()
            try:
                result = wrapped(*args, **kwargs)
            finally:
                span, self._span, self._step_start_ns = self._span, None, None
                output = self._last_output
                # engine phase and engine-state metrics: every step, sampled or not; per step:
                # inline try, not errors.guard (0.3-0.7 us more)
                try:
                    if output is not None and getattr(output, "total_num_scheduled_tokens", 0):
                        if self.state_metrics is None:
                            self.engine_metrics()
                        self.phase_clock.on_step(start_mono, time.monotonic(), step_has_prefill(output))
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
                if span is not None:
                    try:
                        self.step_spans.finish(
                            span, end_ns=time.time_ns(), cpu_time_s=(time.thread_time_ns() - cpu0) / 1e9
                        )
                    except Exception as exc:  # noqa: BLE001
                        self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def _request_span(self, requests: dict, req_id: str) -> Any:
        """The sampled request span's SpanContext of ``req_id`` (None: unsampled), read once per request."""
        if req_id in self._request_spans:
            return self._request_spans[req_id]
        req = requests.get(req_id)
        sc = request_span_context(getattr(req, "sampling_params", None))
        if sc is not None and not sc.trace_flags.sampled:
            sc = None
        if len(self._request_spans) < MAX_CACHED_LINKS:
            self._request_spans[req_id] = sc
        return sc

    def _start(self, scheduler: Any, output: Any) -> None:
        """Start the step span for the batch ``schedule()`` returned (only if a request in it is
        sampled) and attach its ids to the SchedulerOutput for the worker."""
        requests = scheduler.requests
        scheduled: dict[str, int] = output.num_scheduled_tokens
        for req_id in output.finished_req_ids or ():
            self._request_spans.pop(req_id, None)
        if not self.step_spans.ready():
            return
        linked = []
        for req_id in scheduled:
            sc = self._request_span(requests, req_id)
            if sc is not None:
                linked.append(sc)
        if not linked:
            return
        prefill, decode = step_tokens(output)
        start_ns = self._step_start_ns if self._step_start_ns is not None else time.time_ns()
        span = self.step_spans.start(
            linked,
            start_ns=start_ns,
            batch_size=len(scheduled),
            prefill_tokens=prefill,
            decode_tokens=decode,
            preempted=len(output.preempted_req_ids or ()),
        )
        if TYPE_CHECKING:  # for the checker only (no check per step): ``linked`` is not empty
            assert span is not None
        if self._step_start_ns is None:  # schedule() outside a hooked step: nothing would end it
            self.step_spans.finish(span)
            return
        self._span = span
        set_step_ids(output, self.step_spans.ids(span))


def scheduler_state(stats: Any) -> SchedulerState | None:
    """vLLM's ``SchedulerStats`` as plain values (None: no statistics this step): ``kv_cache_usage``,
    ``num_running_reqs``, ``num_waiting_reqs``, ``prefix_cache_stats.queries`` / ``.hits``; a field
    the installed vLLM lacks is None."""
    if stats is None:
        return None
    prefix = getattr(stats, "prefix_cache_stats", None)
    return SchedulerState(
        kv_cache_usage=getattr(stats, "kv_cache_usage", None),
        running=getattr(stats, "num_running_reqs", None),
        waiting=getattr(stats, "num_waiting_reqs", None),
        prefix_queries=None if prefix is None else int(getattr(prefix, "queries", 0) or 0),
        prefix_hits=None if prefix is None else int(getattr(prefix, "hits", 0) or 0),
    )


def _served_model(scheduler: Any) -> str:
    """The served model name from the scheduler's ``vllm_config.model_config`` ("unknown" if absent)."""
    model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name) if name else "unknown"
