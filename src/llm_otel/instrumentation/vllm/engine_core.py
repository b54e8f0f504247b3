"""Engine-core side of the vLLM adapter: reads each scheduler step and calls the core's step API
(:class:`~llm_otel.telemetry.steps.EngineSteps`), which builds the ``llm.engine.step`` span.

Engine fields read (vLLM 0.32): ``Scheduler.schedule()`` returns the step's ``SchedulerOutput``
(``num_scheduled_tokens`` {req_id: tokens}, ``total_num_scheduled_tokens``, ``preempted_req_ids``,
``finished_req_ids``; prefill/decode/recompute token counts in
:mod:`~llm_otel.instrumentation.vllm.carrier`, with the prompt lengths of
``Scheduler.requests[req_id].num_prompt_tokens``); ``Scheduler.requests[req_id].sampling_params.extra_args``
holds the carrier the frontend put there (the request span's ``traceparent``), which becomes the
step span's link to that request. ``Scheduler.update_from_output(scheduler_output,
model_runner_output)`` processes a batch's output: ``SchedulerOutput.scheduled_spec_decode_tokens``
{req_id: draft ids} and ``.num_invalid_spec_tokens``, ``ModelRunnerOutput.sampled_token_ids`` /
``.req_id_to_index`` and ``Scheduler.num_sampled_tokens_per_step`` give the drafts verified and
accepted (:func:`spec_decode_counts`, vLLM's own rule, ``vllm/v1/core/sched/scheduler.py``).

``Scheduler.make_stats()`` returns the step's ``SchedulerStats`` (``kv_cache_usage``,
``prefix_cache_stats.queries``/``.hits``, ``num_running_reqs``/``num_waiting_reqs``), read into a
:class:`~llm_otel.telemetry.engine_state.SchedulerState` for the engine-state metrics; each
step's interval and whether it scheduled prefill tokens feed the GPU metrics' phase; its
``spec_decoding_stats`` argument (vLLM's per-step ``SpecDecodingStats``) feeds the
speculative-decoding counters (every step, sampled or not; with vLLM's ``log_stats`` off, the
counters come from :func:`spec_decode_counts`).

A step gets a span only when at least one request in its batch is sampled (unsampled traffic
costs a dict lookup per request per step) and the step-span budget allows it. The span starts at
the engine step's start (explicit time) once ``schedule()`` has chosen the batch, its ids ride on
the ``SchedulerOutput`` to the worker, which records the step on the device timeline (docs/gpu.md,
the child span ``llm.engine.step.device``), and this adapter ends it when ``update_from_output``
has processed that same ``SchedulerOutput``'s model output - whether the worker runs in this
process or another. What the span covers therefore depends on how vLLM runs its steps:

* ``EngineCore.step`` (synchronous, vLLM's CPU default): schedule, execute, wait for the output,
  update - the span ends with the update, inside the engine step.
* ``EngineCore.step_with_batch_queue`` (async scheduling - vLLM's GPU default direction - and
  pipeline parallelism): the engine schedules batch N+1 while batch N runs and processes N's
  output in a later call; N's span runs from the start of the engine step that scheduled it to
  the processing of its output, so it contains its own device work and overlaps the next
  batch's span. Its CPU time is the engine loop's over that interval (shared with the overlapping
  batch). Model Runner V2's async output copy is the worker's side of the same pipeline: the
  span still ends when the engine core processes the output.
* A span still open when an engine step raises (or one ``schedule()`` started outside a hooked
  engine step) ends then; at most :data:`MAX_OPEN_STEPS` are open at once (the oldest ends first).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from llm_otel.instrumentation.vllm.carrier import request_span_context, set_step_ids, step_has_prefill, step_tokens
from llm_otel.instrumentation.vllm.kv_transfer import SchedulerKV
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.engine_state import EngineStateMetrics, PhaseClock, SchedulerState, engine_state_instruments
from llm_otel.telemetry.steps import EngineSteps

if TYPE_CHECKING:
    from llm_otel.gpu.metrics import GpuMetrics

MAX_CACHED_LINKS = 100_000
MAX_OPEN_STEPS = 16  # step spans waiting for their batch's output (vLLM keeps 2-3 batches in flight)


class _OpenStep(NamedTuple):
    output: Any  # the SchedulerOutput (kept so its id() cannot be reused while the span is open)
    span: Any
    cpu0_ns: int  # engine-loop thread CPU time when its engine step started
    first: int  # requests whose prompt prefill completes in the step (first tokens: prefill)


class EngineCoreAdapter:
    """Wrapper factories for ``Scheduler.schedule``, ``Scheduler.update_from_output``,
    ``Scheduler.make_stats`` and ``EngineCore.step`` / ``.step_with_batch_queue``.

    The step span starts when ``schedule()`` has chosen the batch - before the model runs - so its
    ids can travel with the ``SchedulerOutput`` to the worker (:func:`~llm_otel.instrumentation.vllm.carrier.set_step_ids`),
    whose device records and NVTX range carry them; it ends when ``update_from_output`` has
    processed that batch's output (module docstring: what that covers per engine mode). The device
    timing is the worker's child span ``llm.engine.step.device``, in this process or another.
    """

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._request_spans: dict[str, Any] = {}  # req id -> sampled request SpanContext | None
        self._last_output: Any = None
        self._step_start_ns: int | None = None
        self._cpu0_ns = 0
        self._open: dict[int, _OpenStep] = {}  # id(SchedulerOutput) -> its open step span
        self.step_spans = EngineSteps(telemetry)
        self.phase_clock = PhaseClock()
        self.state_metrics: EngineStateMetrics | None = None
        self.gpu_metrics: GpuMetrics | None = None
        self._model: str | None = None
        self.kv: SchedulerKV | None = None  # the scheduler's KV connector (prefill/decode disaggregation)
        self._kv_checked = False

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
        """Scheduler.make_stats(spec_decoding_stats, ...): read the statistics vLLM builds for its
        own loggers, the step's ``SpecDecodingStats`` (``num_draft_tokens``,
        ``num_accepted_tokens``) included - O(1) per step, sampled or not."""

        def wrapper(wrapped, instance, args, kwargs):
            stats = wrapped(*args, **kwargs)
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if self._model is None:
                    self._model = _served_model(instance)
                metrics = self.engine_metrics()
                metrics.on_step_state(scheduler_state(stats), self._model)
                spec = args[0] if args else kwargs.get("spec_decoding_stats")
                if spec is not None and stats is not None and spec.num_draft_tokens:
                    metrics.on_spec_decode(int(spec.num_draft_tokens), int(spec.num_accepted_tokens), self._model)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return stats

        return wrapper

    def schedule(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if not self._kv_checked:  # once: the connector's methods are wrapped before it is first asked
                self._kv_checked = True
                try:
                    if getattr(instance, "connector", None) is not None:
                        self.kv = SchedulerKV(self.telemetry, instance)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            output = wrapped(*args, **kwargs)
            self._last_output = output  # the engine core's busy loop is one thread
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if getattr(output, "total_num_scheduled_tokens", 0):
                    self._start(instance, output)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return output

        return wrapper

    def update_from_output(self, hook: str):
        """Scheduler.update_from_output(scheduler_output, model_runner_output): count the batch's
        speculative decoding (read before vLLM updates its requests) and end the batch's step
        span once its output is processed. The counting is O(requests with drafts): for steps
        with a span, and for the counters only when vLLM's ``log_stats`` is off (otherwise
        :meth:`make_stats` receives vLLM's own count)."""

        def wrapper(wrapped, instance, args, kwargs):
            spec = None
            so = args[0] if args else kwargs.get("scheduler_output")
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if getattr(so, "scheduled_spec_decode_tokens", None):
                    own = not getattr(instance, "log_stats", False)  # no SpecDecodingStats from vLLM
                    if own or id(so) in self._open:
                        mro = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
                        spec = spec_decode_counts(instance, so, mro)
                        if own and spec.draft:
                            if self._model is None:
                                self._model = _served_model(instance)
                            self.engine_metrics().on_spec_decode(spec.draft, spec.accepted, self._model)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            kv_step = None
            if self.kv is not None:
                try:
                    mro = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
                    kv_step = self.kv.on_output(instance, so, mro)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            if self._open:
                try:
                    step = self._open.get(id(so))
                    if step is not None and self.kv is not None:
                        self.kv.on_step_span(step.span, kv_step)
                    step = self._open.pop(id(so), None)
                    if step is not None and step.output is so:
                        self._finish(step, spec, result)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def step(self, hook: str):
        """EngineCore.step / .step_with_batch_queue: the step's start (span start, CPU clock) and
        the engine phase; a synchronous step's span that its update did not end ends here."""
        pipelined = hook.endswith("step_with_batch_queue")

        def wrapper(wrapped, instance, args, kwargs):
            self._last_output = None
            self._step_start_ns = time.time_ns()
            self._cpu0_ns = time.thread_time_ns()
            start_mono = time.monotonic()
            failed = True
            try:
                result = wrapped(*args, **kwargs)
                failed = False
            finally:
                self._step_start_ns = None
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
                if self._open and (failed or not pipelined):
                    try:
                        for key in list(self._open):
                            self._finish(self._open.pop(key), None)
                    except Exception as exc:  # noqa: BLE001
                        self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def _finish(self, step: _OpenStep, spec: SpecCounts | None, outputs: Any = None) -> None:
        """End an open step span now, with what the batch's output told (``spec``: None when
        the step had no drafts or its output was not processed): with drafts, the decode tokens
        become the tokens the step emitted (``EngineCoreOutputs.outputs[].new_token_ids`` of
        ``update_from_output``'s result, less the prompts' first tokens) - accepted drafts and
        each request's bonus or recovered token, not rejected drafts nor tokens vLLM dropped
        past a stop (``max_tokens``)."""
        span = step.span
        kwargs: dict[str, Any] = {}
        if spec is not None and spec.draft:
            if isinstance(outputs, dict):
                emitted = sum(len(o.new_token_ids) for eco in outputs.values() for o in eco.outputs)
                kwargs["decode_tokens"] = max(0, emitted - step.first)
            kwargs["draft_tokens"] = spec.draft
            kwargs["accepted_tokens"] = spec.accepted
        self.step_spans.finish(
            span, end_ns=time.time_ns(), cpu_time_s=(time.thread_time_ns() - step.cpu0_ns) / 1e9, **kwargs
        )

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
        tokens = step_tokens(output, requests)
        start_ns = self._step_start_ns if self._step_start_ns is not None else time.time_ns()
        span = self.step_spans.start(
            linked,
            start_ns=start_ns,
            batch_size=len(scheduled),
            prefill_tokens=tokens.prefill,
            decode_tokens=tokens.decode,
            preempted=len(output.preempted_req_ids or ()),
            recompute_tokens=tokens.recompute,
        )
        if TYPE_CHECKING:  # for the checker only (no check per step): ``linked`` is not empty
            assert span is not None
        if self._step_start_ns is None:  # schedule() outside a hooked step: nothing would end it
            self.step_spans.finish(span)
            return
        if len(self._open) >= MAX_OPEN_STEPS:  # outputs that never came back: end the oldest
            self._finish(self._open.pop(next(iter(self._open))), None)
        self._open[id(output)] = _OpenStep(output, span, self._cpu0_ns, tokens.first)
        set_step_ids(output, self.step_spans.ids(span))


class SpecCounts(NamedTuple):
    """One step's speculative decoding as ``Scheduler.update_from_output`` counts it (tokens).

    Attributes:
        draft: drafts verified (scheduled drafts minus ``num_invalid_spec_tokens``).
        accepted: drafts accepted (``len(sampled_token_ids[i]) - num_sampled_tokens_per_step``).
    """

    draft: int
    accepted: int


def spec_decode_counts(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> SpecCounts:
    """The :class:`SpecCounts` of one batch, by vLLM 0.32's own rule in ``Scheduler.update_from_output``
    (``vllm/v1/core/sched/scheduler.py``), read before it runs: for each request with
    ``scheduled_spec_decode_tokens`` that is still live (in ``Scheduler.requests``, not finished,
    its output not dropped as stale) and got sampled tokens (``ModelRunnerOutput.sampled_token_ids``
    at ``req_id_to_index``), accepted = sampled - ``num_sampled_tokens_per_step`` (at least 0).
    O(requests with drafts)."""
    requests = scheduler.requests
    per_step = int(getattr(scheduler, "num_sampled_tokens_per_step", 1))
    sampled = getattr(model_runner_output, "sampled_token_ids", None)
    index = getattr(model_runner_output, "req_id_to_index", None) or {}
    invalid = scheduler_output.num_invalid_spec_tokens or {}
    draft = accepted = 0
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        if not drafts:
            continue
        req = requests.get(req_id)
        if req is None or req.is_finished():
            continue
        if getattr(req, "num_stale_output_tokens", 0) > 0 and getattr(req, "drop_stale_output", False):
            continue
        i = index.get(req_id)
        generated = sampled[i] if sampled and i is not None else []
        if not generated and per_step != 0:
            continue
        draft += len(drafts) - invalid.get(req_id, 0)
        accepted += max(len(generated) - per_step, 0)
    return SpecCounts(draft, accepted)


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
