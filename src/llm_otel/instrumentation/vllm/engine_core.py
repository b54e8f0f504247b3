"""Engine-core side of the vLLM adapter: one ``llm.engine.step`` span per scheduler step.

Engine fields read (vLLM 0.32): ``Scheduler.schedule()`` returns the step's ``SchedulerOutput``
(``num_scheduled_tokens`` {req_id: tokens}, ``scheduled_new_reqs``, ``scheduled_cached_reqs``
with ``req_ids``/``num_output_tokens`` (0 = still prefilling), ``preempted_req_ids``,
``finished_req_ids``); ``Scheduler.requests[req_id].sampling_params.extra_args`` holds the carrier
the frontend put there (the request span's ``traceparent``).

``Scheduler.make_stats()`` returns the step's ``SchedulerStats`` (KV-cache usage, prefix-cache
hits/queries, running/waiting requests) for :class:`~llm_otel.telemetry.engine_state.EngineStateMetrics`;
each step's interval and whether it scheduled prompt tokens feed the GPU metrics' phase.

The step span is the root of its own trace (batching is fan-in) and **links** to the request
spans it served; it is emitted only when at least one of them is sampled, so unsampled traffic
costs a dict lookup per request per step, and at most ``LLM_OTEL_STEP_SPANS_PER_S`` times a
second (:class:`StepSpanBudget`): an engine steps every few milliseconds, and a span for every
step would cost more than the requests' own trees. It starts at the step's start (explicit time) once
``schedule()`` has chosen the batch, and its ids ride on the ``SchedulerOutput`` to the worker,
which records the step on the device timeline (docs/gpu.md).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from opentelemetry.trace import Link, SpanKind

from llm_otel.propagation import parse_traceparent
from llm_otel.semconv import attributes as A
from llm_otel.semconv import spans as S
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.engine_state import EngineStateMetrics, PhaseClock, step_has_prefill

CARRIER_KEY = "llm_otel.traceparent"  # key in vLLM SamplingParams.extra_args
CARRIER_STATE_KEY = "llm_otel.tracestate"  # the request span's tracestate (ot=th:, vendors), if any
CARRIER_TOPK_KEY = "llm_otel.logit_top_k"  # present: the worker computes llm.logit_dist (k)
STEP_CARRIER_ATTR = "llm_otel_step"  # on vLLM's SchedulerOutput: (trace_id, span_id, sampled) of the step span
MAX_CACHED_LINKS = 100_000


class StepSpanBudget:
    """Token bucket for step spans: ``rate`` per second, burst of ``max(1, rate)`` (one second's
    worth). ``rate`` 0 allows none, ``inf`` every step. Called on the engine loop only (one
    thread); :meth:`ready` is a float comparison when spans are allowed."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.capacity = max(1.0, self.rate) if self.rate > 0.0 else 0.0
        self.tokens = self.capacity
        self.clock = clock
        self._last = clock()

    def ready(self) -> bool:
        """Whether a step span may start now (does not take it)."""
        if self.tokens >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = now
        return self.tokens >= 1.0

    def take(self) -> None:
        if self.rate != float("inf"):
            self.tokens -= 1.0
            if self.tokens < 1.0:
                self._last = self.clock()


class EngineCoreAdapter:
    """Wrapper factories for ``Scheduler.schedule`` and ``EngineCore.step``.

    The step span starts when ``schedule()`` has chosen the batch - before the model runs - so its
    ids can travel with the ``SchedulerOutput`` to the worker (attribute :data:`STEP_CARRIER_ATTR`:
    ``(trace_id, span_id, sampled)``), whose device records and NVTX range carry them; it ends
    with the step. When the model runs in this process (vLLM's ``UniProcExecutor``: one GPU) the
    step tracker completes the span with its device times.

    ``step_listeners``: callables ``(span, scheduler_output, start_ns, end_ns)`` run before each
    step span ends.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._links: dict[str, Link | None] = {}
        self._last_output: Any = None
        self._step_start_ns: int | None = None
        self._span: Any = None
        self.step_listeners: list[Callable] = []
        self.phase_clock = PhaseClock()
        self.state_metrics: EngineStateMetrics | None = None
        self.gpu_metrics = None
        self._model: str | None = None
        self.budget = StepSpanBudget(telemetry.settings.step_spans_per_s)

    def engine_metrics(self) -> EngineStateMetrics:
        """Engine-state and GPU instruments, created on first use: only in the process that runs
        the scheduler (vLLM's engine core, or the frontend when the core runs in-process)."""
        if self.state_metrics is None:
            from llm_otel.export.identity import vllm_dp_rank
            from llm_otel.gpu.metrics import register_gpu_metrics

            meter = self.telemetry.instruments.meter
            self.state_metrics = EngineStateMetrics(meter, dp_rank=vllm_dp_rank())
            self.gpu_metrics = register_gpu_metrics(meter, self.phase_clock.phase)
        return self.state_metrics

    def make_stats(self, hook: str):
        """Scheduler.make_stats: read the statistics vLLM builds for its own loggers."""

        def wrapper(wrapped, instance, args, kwargs):
            stats = wrapped(*args, **kwargs)
            try:
                if self._model is None:
                    self._model = _served_model(instance)
                self.engine_metrics().on_scheduler_stats(stats, self._model)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return stats

        return wrapper

    def schedule(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            output = wrapped(*args, **kwargs)
            self._last_output = output  # the engine core's busy loop is one thread
            try:
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
            start_ns = self._step_start_ns = time.time_ns()
            start_mono = time.monotonic()
            cpu0 = time.thread_time_ns()
            try:
                result = wrapped(*args, **kwargs)
            finally:
                span, self._span, self._step_start_ns = self._span, None, None
                output = self._last_output
                try:  # engine phase and engine-state metrics: every step, sampled or not
                    if output is not None and getattr(output, "total_num_scheduled_tokens", 0):
                        if self.state_metrics is None:
                            self.engine_metrics()
                        self.phase_clock.on_step(start_mono, time.monotonic(), step_has_prefill(output))
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
                if span is not None:
                    try:
                        self._finish(span, output, start_ns, time.time_ns(), time.thread_time_ns() - cpu0)
                    except Exception as exc:  # noqa: BLE001
                        self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def _link(self, requests: dict, req_id: str) -> Link | None:
        if req_id in self._links:
            return self._links[req_id]
        link = None
        req = requests.get(req_id)
        extra = getattr(getattr(req, "sampling_params", None), "extra_args", None)
        if extra:
            sc = parse_traceparent(extra.get(CARRIER_KEY))
            if sc is not None and sc.trace_flags.sampled:
                link = Link(sc)
        if len(self._links) < MAX_CACHED_LINKS:
            self._links[req_id] = link
        return link

    def _start(self, scheduler: Any, output: Any) -> None:
        """Start the step span for the batch ``schedule()`` returned (only if a request in it is
        sampled) and attach its ids to the SchedulerOutput for the worker."""
        requests = scheduler.requests
        scheduled: dict[str, int] = output.num_scheduled_tokens
        for req_id in output.finished_req_ids or ():
            self._links.pop(req_id, None)
        if not self.budget.ready():
            return
        links = []
        for req_id in scheduled:
            link = self._link(requests, req_id)
            if link is not None:
                links.append(link)
        if not links:
            return
        self.budget.take()
        prefill = sum(scheduled.get(r.req_id, 0) for r in output.scheduled_new_reqs)
        cached = output.scheduled_cached_reqs
        for req_id, n_out in zip(cached.req_ids, cached.num_output_tokens):
            if n_out == 0:  # chunked prefill continuing
                prefill += scheduled.get(req_id, 0)
        attrs = {
            A.LLM_ENGINE_STEP_BATCH_SIZE: len(scheduled),
            A.LLM_ENGINE_STEP_PREFILL_TOKENS: prefill,
            A.LLM_ENGINE_STEP_DECODE_TOKENS: int(output.total_num_scheduled_tokens) - prefill,
            A.LLM_ENGINE_STEP_PREEMPTED: len(output.preempted_req_ids or ()),
        }
        start_ns = self._step_start_ns if self._step_start_ns is not None else time.time_ns()
        span = self.telemetry.tracer.start_span(S.LLM_ENGINE_STEP, kind=SpanKind.INTERNAL, links=links,
                                                attributes=attrs, start_time=start_ns)
        if self._step_start_ns is None:  # schedule() outside a hooked step: nothing would end it
            span.end()
            return
        self._span = span
        sc = span.get_span_context()
        try:
            setattr(output, STEP_CARRIER_ATTR, (sc.trace_id, sc.span_id, bool(sc.trace_flags.sampled)))
        except Exception:  # noqa: BLE001 - a SchedulerOutput that takes no attributes: no device timing
            pass
        steps = self.telemetry.steps_if_started
        if steps is not None:
            steps.register_span(span)

    def _finish(self, span: Any, output: Any, start_ns: int, end_ns: int, cpu_ns: int) -> None:
        span.set_attribute(A.LLM_ENGINE_STEP_CPU_TIME, cpu_ns / 1e9)
        for listener in self.step_listeners:
            listener(span, output, start_ns, end_ns)
        steps = self.telemetry.steps_if_started
        if steps is None or not steps.release_span(span, end_ns):
            span.end(end_time=end_ns)


def _served_model(scheduler: Any) -> str:
    """The served model name from the scheduler's ``vllm_config.model_config`` ("unknown" if absent)."""
    model_config = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name) if name else "unknown"
