"""Worker side of the vLLM adapter: device timing of each step, and ``llm.logit_dist`` from the
engine's full-vocabulary logits.

Device timing (docs/gpu.md): ``GPUModelRunner.execute_model(scheduler_output)`` begins a step on
the core's :class:`~llm_otel.telemetry.steps.StepTracker` - NVTX range and ring-buffer record on
torch's current CUDA stream - and the step ends after ``sample_tokens`` (or at once when
``execute_model`` returned the output itself); the tracker emits ``llm.engine.step.device`` under
the engine core's step span. The step span's ids come from the engine core on the
``SchedulerOutput`` (:mod:`~llm_otel.instrumentation.vllm.carrier`); steps without a sampled
request carry none and cost one ``getattr``. ``scheduler_output.num_scheduled_tokens`` gives the batch's request ids,
``scheduled_new_reqs[i].sampling_params.extra_args`` the request span of a request's first step
(its NVTX process range), ``finished_req_ids`` the requests whose ranges end.

Engine fields read (vLLM 0.32): ``GPUModelRunner._sample(logits, spec_decode_metadata)`` gets the
step's ``(rows, vocab)`` logits, row i belonging to ``input_batch.req_ids[i]``;
``requests[req_id]`` (``CachedRequestState``) holds ``sampling_params.extra_args`` with the carrier
the frontend put there - present only for sampled requests chosen for logit statistics - and
``output_token_ids``; ``discard_request_mask`` marks rows of partial (chunked) prefills, whose
sample is thrown away; the sampler returns ``sampled_token_ids``.

Model Runner V2 (``vllm/v1/worker/gpu``, the default on GPUs with Triton in vLLM 0.32/0.33): the
runner computes logits inside ``GPUModelRunner.sample(hidden_states, input_batch, grammar_output)``
and hands them to ``Sampler.__call__(logits, input_batch)`` or, under speculative decoding, to
``RejectionSampler.__call__(logits, input_batch, draft_logits, invalid_drafts)``; both are hooked.
MRv2 keeps no per-request ``sampling_params`` in the runner: ``Sampler.add_request(req_idx,
sampling_params)`` is hooked to remember, per request-state slot, the carrier of chosen requests
(with ``req_states.index_to_req_id[req_idx]`` to detect a reused slot). Rows: request i of
``input_batch.req_ids`` owns logit rows ``cu_num_logits_np[i]:cu_num_logits_np[i+1]`` (one row
without speculative decoding) and state slot ``idx_mapping_np[i]``; a chunk of a prefill that does
not finish it (``num_computed_tokens_np + num_scheduled_tokens < prefill_len_np``, the rule of
``get_num_sampled_and_rejected``) samples nothing and is skipped; requests vLLM still holds are
``req_states.req_id_to_index``.

Speculative decoding (V1 and MRv2 alike): a request's rows are its draft positions' target rows
and the bonus row (V1: ``SpecDecodeMetadata.num_draft_tokens[i] + 1`` consecutive rows,
vllm/v1/spec_decode/metadata.py; MRv2: ``cu_num_logits_np``). All are reduced before sampling;
the rejection sampler's ``(num_reqs, drafts + 1)`` ``sampled_token_ids`` (V1: -1,
``PLACEHOLDER_TOKEN_ID``, for rejected positions; MRv2: ``num_sampled[i]`` valid) says which were
emitted: position p is kept when it holds a token - the accepted drafts and the recovered or
bonus token, never a rejected draft - and its log-prob is the target distribution's at that row.
So a request's span has one ``llm.logit.step`` per output token, as without speculative decoding;
tokens after ``max_tokens`` or a stop token within a step (vLLM's scheduler drops them) are not
reported. The target logits are read before the rejection sampler (which may process them in place).

Per step: the chosen rows are gathered and reduced on the logits' device *before* the sampler
runs (the capture is the core's, :mod:`llm_otel.telemetry.logit_capture`, the same as
LightLLM's); after it the statistics, the sampled tokens and their log-probs are packed into one
``(rows, 2k+4)`` tensor and copied with ``non_blocking=True`` into pinned host memory, with a CUDA
event recorded after the copy. Nothing waits for the device on the step path: the copy is
collected at a later hook call (or by the idle flusher) once its event has completed
(:class:`~.logit_rows.Streams`; at most ``MAX_PENDING`` steps pending, past which the oldest is
waited for). On CPU the copy is the data itself, collected at once. Unchosen requests cost a
dict lookup (MRv2: one NumPy gather over the batch while any chosen request is live). While a
CUDA graph is captured nothing is reduced. A request's span is emitted, once none of its steps is
pending, when its last token is collected (``max_tokens`` reached or a stop token), when vLLM
drops it from ``requests``, or after ``IDLE_FLUSH_S`` without a step for it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, cast

import numpy as np

from llm_otel.errors import guard
from llm_otel.gpu.capture import capture_gate
from llm_otel.instrumentation.vllm.carrier import (
    CARRIER_KEY,
    CARRIER_STATE_KEY,
    CARRIER_TOPK_KEY,
    request_span_context,
    step_ids,
    step_phase,
    step_tokens,
)
from llm_otel.instrumentation.vllm.kv_transfer import WorkerKV
from llm_otel.instrumentation.vllm.logit_rows import Chosen as _Chosen
from llm_otel.instrumentation.vllm.logit_rows import Plan as _Plan
from llm_otel.instrumentation.vllm.logit_rows import Slots as _Slots
from llm_otel.instrumentation.vllm.logit_rows import Stream as _Stream
from llm_otel.instrumentation.vllm.logit_rows import Streams as _Streams
from llm_otel.instrumentation.vllm.logit_rows import emit_stream
from llm_otel.instrumentation.vllm.logit_rows import stops_of as _stops
from llm_otel.propagation import context_from_carrier
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.logit_capture import capture_rows, wrap_sampler
from llm_otel.telemetry.steps import step_parent

IDLE_FLUSH_S = 2.0


def _parent_of(extra: dict[str, Any]) -> Any:
    """The request span's context from the carrier the frontend put in ``extra_args``."""
    carrier = {"traceparent": extra.get(CARRIER_KEY), "tracestate": extra.get(CARRIER_STATE_KEY)}
    return context_from_carrier(cast(dict[str, str], carrier))


def owns_sampling_result() -> bool:
    """True in the worker whose sampler output vLLM returns: tensor-parallel rank 0 (and
    prefill/decode-context-parallel rank 0) of its group - ``MultiprocExecutor._get_output_rank``
    returns the first TP worker of the last PP stage, and only the last stage samples. Read from
    vLLM's process groups (``vllm.distributed.parallel_state``), initialised before the first step;
    True when they are not (a single-process engine) or cannot be read."""
    try:
        from vllm.distributed import parallel_state as ps

        if ps.get_tp_group().rank_in_group != 0:
            return False
    except Exception:  # noqa: BLE001 - silent: no process groups: the only rank
        return True
    for name in ("get_pcp_group", "get_dcp_group"):  # newer context-parallel groups, when vLLM has them
        try:
            if getattr(ps, name)().rank_in_group != 0:
                return False
        except Exception:  # noqa: BLE001 - silent: feature probe: no such process group
            continue
    return True


class WorkerAdapter:
    """Wrapper factories for ``GPUModelRunner.execute_model`` / ``sample_tokens`` (device timing
    of steps, V1 and Model Runner V2), ``GPUModelRunner._sample`` (V1 logit statistics; vLLM's CPU
    model runner inherits all three) and MRv2's ``Sampler.add_request`` / ``Sampler.__call__`` /
    ``RejectionSampler.__call__`` (MRv2 logit statistics)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._logits = _Streams(self._emit, _parent_of)
        self._flusher: threading.Thread | None = None
        self._open_steps: dict[int, Any] = {}  # id(model runner) -> StepContext awaiting sample_tokens
        self.kv = WorkerKV(telemetry)  # the KV connector's load/save time per step (disaggregation)
        self._torch_cuda: Any = False  # torch.cuda once known to be usable, None when not
        self._owns_result: bool | None = None  # this rank returns the step's output (read once)
        # MRv2: Sampler -> {request-state slot: _Chosen}; weak, so a discarded runner takes its map
        self._chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sampler -> _Slots

    # --- device timing of steps ---------------------------------------------------------------
    def execute_model(self, hook: str):
        """Wrapper for ``GPUModelRunner.execute_model(scheduler_output, intermediate_tensors=None)``
        (V1) and MRv2's ``execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False,
        ...)``; MRv2 dummy runs (profiling, CUDA-graph capture, DP padding) are passed through."""

        kv = self.kv

        def wrapper(wrapped, instance, args, kwargs):
            if kwargs.get("dummy_run"):  # MRv2 passes it by keyword (_dummy_run); no step of a request
                return wrapped(*args, **kwargs)
            if kv.active is False:  # no KV connector here
                return self._execute_step(wrapped, instance, args, kwargs, hook)
            kv.begin_step()  # guarded inside; times the connector's calls (disaggregation)
            output = self._execute_step(wrapped, instance, args, kwargs, hook)
            kv.stamp(output)
            return output

        return wrapper

    def _execute_step(self, wrapped, instance, args, kwargs, hook: str):
        """One ``execute_model`` call with its device timing (begin; end now or in sample_tokens)."""
        ctx = None
        try:  # per step: inline, not errors.guard (0.3-0.7 us more)
            stale = self._open_steps.pop(id(instance), None) if self._open_steps else None
            if stale is not None:  # sample_tokens never came (the step failed in between)
                self._end_step(stale, hook)
            so = args[0] if args else kwargs.get("scheduler_output")
            ctx = self._begin_step(so)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report(hook, exc)
        if ctx is None:
            return wrapped(*args, **kwargs)
        try:
            output = wrapped(*args, **kwargs)
        except BaseException:
            self._end_step(ctx, hook)
            raise
        if output is None:  # two-phase step: sample_tokens() follows and ends it
            self._open_steps[id(instance)] = ctx
        else:
            self._end_step(ctx, hook)
        return output

    def sample_tokens(self, hook: str):
        """Wrapper for ``GPUModelRunner.sample_tokens(grammar_output)``: ends the open step."""

        kv = self.kv

        def wrapper(wrapped, instance, args, kwargs):
            try:
                output = wrapped(*args, **kwargs)
                if kv.active:
                    kv.stamp(output)
                return output
            finally:
                ctx = self._open_steps.pop(id(instance), None) if self._open_steps else None
                if ctx is not None:
                    self._end_step(ctx, hook)

        return wrapper

    def _cuda_stream(self) -> Any:
        """torch's current CUDA stream handle; None on CPU; False while a CUDA graph is captured."""
        cuda = self._torch_cuda
        if cuda is False:
            try:
                import torch

                cuda = torch.cuda if torch.cuda.is_available() else None
            except Exception:  # noqa: BLE001 - silent: feature probe: no torch/CUDA
                cuda = None
            self._torch_cuda = cuda
        if cuda is None or not cuda.is_initialized():
            return None
        if capture_gate.capturing(cuda):
            return False  # a record launched now would be frozen into (or abort) the graph
        return cuda.current_stream().cuda_stream

    def _begin_step(self, so: Any):
        carrier = step_ids(so)
        steps = self.telemetry.steps if carrier is not None else self.telemetry.steps_if_started
        if steps is None:
            return None
        finished = getattr(so, "finished_req_ids", None)
        if finished:
            steps.end_requests(finished)
        if carrier is None:
            return None
        stream = self._cuda_stream()
        if stream is False:
            return None
        trace_id, span_id, sampled = carrier
        new = so.scheduled_new_reqs
        request_spans = None
        if steps.nvtx.active and new:
            request_spans = {}
            for r in new:
                sc = request_span_context(getattr(r, "sampling_params", None))
                if sc is not None:
                    request_spans[r.req_id] = (sc.trace_id, sc.span_id)
        return steps.begin(
            list(so.num_scheduled_tokens),
            parent=step_parent(trace_id, span_id, sampled),
            phase=step_phase(*step_tokens(so)[:2]),
            stream=stream,
            request_spans=request_spans,
        )

    def _end_step(self, ctx: Any, hook: str) -> None:
        try:  # per step: inline, not errors.guard (0.3-0.7 us more)
            stream = self._cuda_stream()
            # while a graph is captured the end record is not launched: the step completes
            # without device times instead of putting our kernel into the engine's graph
            self.telemetry.steps.end(ctx, stream=stream if stream is not False else None, record=stream is not False)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report(hook, exc)

    # --- logit statistics: V1 runner ----------------------------------------------------------
    def _owns_sampling(self) -> bool:
        """Whether this worker computes logit statistics (:func:`owns_sampling_result`, read once:
        vLLM's process groups exist by the first sampled step)."""
        owns = self._owns_result
        if owns is None:
            owns = self._owns_result = owns_sampling_result()
        return owns

    def sample(self, hook: str):
        """Wrapper for the V1 runner's ``GPUModelRunner._sample(logits, spec_decode_metadata)``."""
        return wrap_sampler(self.telemetry.errors, hook, self._before_sample, self._after_sample)

    def _before_sample(self, runner: Any, args: tuple, kwargs: dict):
        if self._logits.pending:  # earlier steps' statistics whose copies may have completed
            self._logits.poll()
        logits = args[0] if args else kwargs.get("logits")
        spec = args[1] if len(args) > 1 else kwargs.get("spec_decode_metadata")
        # with TP every rank samples the same rows; only the rank whose output vLLM returns
        # computes the statistics
        if logits is not None and self._owns_sampling():
            return self._prepare(runner, logits, spec)
        return None

    def _after_sample(self, runner: Any, plan: _Plan, output: Any) -> None:
        self._stage(plan, getattr(output, "sampled_token_ids", None), None, runner.requests, mrv2=False)

    def _prepare(self, runner: Any, logits: Any, spec: Any) -> _Plan | None:
        """V1: the rows of the chosen requests in ``logits``, reduced. Without speculative
        decoding row i belongs to ``input_batch.req_ids[i]``; with it (``SpecDecodeMetadata``,
        vllm/v1/spec_decode/metadata.py) request i owns ``num_draft_tokens[i] + 1`` consecutive
        rows (``_calc_spec_decode_metadata``: its drafts' target rows, then its bonus row), all
        reduced - which of them belong to emitted tokens is known after the rejection sampler."""
        req_ids = runner.input_batch.req_ids
        requests = runner.requests
        n_rows = int(logits.shape[0])
        n = min(n_rows, len(req_ids))
        drafts = getattr(spec, "num_draft_tokens", None) if spec is not None else None
        if drafts is not None:
            n = min(len(drafts), len(req_ids))
        discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        members: list[tuple] = []
        rows: list[int] = []
        owner: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        start = 0
        for i in range(n):
            width = int(drafts[i]) + 1 if drafts is not None else 1
            first, start = start, start + width
            state = requests.get(req_ids[i])
            sp = getattr(state, "sampling_params", None) if state else None
            extra = getattr(sp, "extra_args", None)
            if not extra or CARRIER_TOPK_KEY not in extra:
                continue
            if discard is not None and i < len(discard) and discard[i]:
                continue
            if first + width > n_rows:
                break
            m = len(members)
            members.append(
                (
                    req_ids[i],
                    extra,
                    getattr(sp, "max_tokens", None),
                    len(getattr(state, "output_token_ids", ())),
                    _stops(sp),
                )
            )
            for p in range(width):
                rows.append(first + p)
                owner.append(m)
                pos.append(p)
                sample_rows.append(i)
        return self._reduce(logits, rows, _Plan(members, owner, pos, sample_rows))

    # --- logit statistics: Model Runner V2 ----------------------------------------------------
    def sampler_add_request(self, hook: str):
        """Wrapper for MRv2 ``Sampler.add_request(req_idx, sampling_params)``: remembers the slot of
        a request chosen for logit statistics (and forgets a reused slot's previous request)."""

        def wrapper(wrapped, instance, args, kwargs):
            output = wrapped(*args, **kwargs)
            with guard(hook, self.telemetry.errors):
                req_idx = args[0] if args else kwargs["req_idx"]
                sp = args[1] if len(args) > 1 else kwargs["sampling_params"]
                extra = getattr(sp, "extra_args", None)
                slots = self._chosen.get(instance)
                if extra and CARRIER_TOPK_KEY in extra:
                    if slots is None:
                        slots = self._chosen[instance] = _Slots()
                    index_to_req_id = getattr(getattr(instance, "req_states", None), "index_to_req_id", None)
                    req_id = index_to_req_id.get(req_idx) if index_to_req_id is not None else None
                    slots.choose(int(req_idx), _Chosen(req_id, extra, getattr(sp, "max_tokens", None), _stops(sp)))
                elif slots:
                    slots.forget(int(req_idx))
            return output

        return wrapper

    def sampler_call(self, hook: str):
        """Wrapper for MRv2 ``Sampler.__call__(logits, input_batch)`` and
        ``RejectionSampler.__call__(logits, input_batch, draft_logits=None, invalid_drafts=None)``
        (whose ``sampler`` attribute is the Sampler holding the chosen slots)."""
        return wrap_sampler(self.telemetry.errors, hook, self._before_sampler_call, self._after_sampler_call)

    @staticmethod
    def _sampler_of(instance: Any) -> Any:
        return vars(instance).get("sampler", instance) if hasattr(instance, "__dict__") else instance

    def _before_sampler_call(self, instance: Any, args: tuple, kwargs: dict):
        sampler = self._sampler_of(instance)
        if self._logits.pending:
            self._logits.poll()
        if self._logits.gone_mrv2:
            self._forget(sampler)
        if self._chosen.get(sampler) and self._owns_sampling():  # TP: the output rank only
            logits = args[0] if args else kwargs.get("logits")
            batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
            if logits is not None and batch is not None:
                return self._prepare_mrv2(sampler, logits, batch)
        return None

    def _after_sampler_call(self, instance: Any, plan: _Plan, output: Any) -> None:
        sampler = self._sampler_of(instance)
        sampled = getattr(output, "sampled_token_ids", None)
        # Sampler: (num_reqs, 1); RejectionSampler: (num_reqs, drafts + 1); num_sampled: valid per row
        self._stage(plan, sampled, getattr(output, "num_sampled", None), sampler.req_states.req_id_to_index, mrv2=True)
        if self._logits.gone_mrv2:  # forget their slots: a step without chosen requests costs one lookup
            self._forget(sampler)

    def _forget(self, sampler: Any) -> None:
        gone = self._logits.take_gone_mrv2()
        slots = self._chosen.get(sampler)
        if slots:
            for slot in [k for k, c in slots.items() if c.req_id in gone]:
                slots.forget(slot)

    def _prepare_mrv2(self, sampler: Any, logits: Any, batch: Any) -> _Plan | None:
        """MRv2: every logit row of each chosen request of ``batch`` (an ``InputBatch``), reduced:
        request i owns rows ``cu_num_logits_np[i]:cu_num_logits_np[i+1]`` (one row without
        speculative decoding; with it the draft positions and the bonus row, in position order,
        matching column p of the sampler's ``(num_reqs, drafts + 1)`` output). A step whose
        logits do not span ``cu_num_logits_np`` (adaptive verification compacts the logits and
        keeps the pre-compaction sums) is not reduced."""
        slots = cast(_Slots, self._chosen.get(sampler))  # the caller found chosen slots for sampler
        req_ids = batch.req_ids
        num_reqs = min(int(batch.num_reqs), len(req_ids))
        idx_mapping = np.asarray(batch.idx_mapping_np[:num_reqs])
        cu = batch.cu_num_logits_np
        n_rows = int(logits.shape[0])
        if len(cu) <= num_reqs or int(cu[num_reqs]) != n_rows:
            return None
        # vectorised over the batch; the Python loop runs over the chosen requests only
        wanted = slots.matches(idx_mapping)
        wanted &= ~(
            batch.num_computed_tokens_np[:num_reqs] + batch.num_scheduled_tokens[:num_reqs]
            < batch.prefill_len_np[:num_reqs]
        )
        members: list[tuple] = []
        rows: list[int] = []
        owner: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        for i in np.flatnonzero(wanted).tolist():
            chosen = slots[int(idx_mapping[i])]
            req_id = req_ids[i]
            if chosen.req_id is not None and chosen.req_id != req_id:
                continue  # the slot was reused by a request added without our hook seeing it
            m = len(members)
            members.append((req_id, chosen.extra, chosen.max_tokens, None, chosen.stops))
            for p, row in enumerate(range(int(cu[i]), int(cu[i + 1]))):
                rows.append(row)
                owner.append(m)
                pos.append(p)
                sample_rows.append(i)
        return self._reduce(logits, rows, _Plan(members, owner, pos, sample_rows))

    # --- one step's statistics, both runners ------------------------------------------------------
    @staticmethod
    def _reduce(logits: Any, rows: list[int], plan: _Plan) -> _Plan | None:
        """A step's chosen ``rows`` of the ``(rows, vocab)`` ``logits``, reduced on their device
        (:func:`~llm_otel.telemetry.logit_capture.capture_rows`) into ``plan.captured``.

        Returns ``plan``, or None (nothing chosen, or a CUDA graph is being captured)."""
        if not rows:
            return None
        k = max(int(extra[CARRIER_TOPK_KEY]) for _, extra, _, _, _ in plan.members)
        plan.captured = capture_rows(logits, rows, k)
        return None if plan.captured is None else plan

    def _stage(self, plan: _Plan, sampled: Any, num_valid: Any, live: Any, *, mrv2: bool) -> None:
        """After the sampler: stage the statistics plus the sampled tokens (and their log-probs)
        of each reduced row - ``sampled[sample_rows[r], pos[r]]`` - with no wait for the device
        (:meth:`~llm_otel.telemetry.logit_capture.StepLogits.stage`), and hand them to the streams,
        which collect them at this or a later step (:class:`~.logit_rows.Streams`)."""
        staged = plan.captured.stage(sampled, plan.sample_rows, plan.pos, num_valid)
        self._logits.add(plan, staged, live, mrv2=mrv2)
        self._ensure_flusher()

    def _emit(self, stream: _Stream) -> None:
        with guard("worker.logit_dist", self.telemetry.errors):
            emit_stream(self.telemetry, stream)

    @property
    def _streams(self) -> dict[str, _Stream]:
        """The chosen requests' statistics so far, by request id (:class:`~.logit_rows.Streams`)."""
        return self._logits.streams

    def flush(self, idle_s: float = 0.0) -> int:
        """Emit streams that saw no step for ``idle_s`` seconds (all with 0, after waiting for every
        pending copy); returns how many."""
        return self._logits.flush(idle_s)

    def _ensure_flusher(self) -> None:
        if self._flusher is not None:
            return

        def loop() -> None:
            while True:
                time.sleep(IDLE_FLUSH_S / 2)
                if self._logits.streams or self._logits.pending:
                    with guard("worker.flush", self.telemetry.errors):
                        self._logits.flush(IDLE_FLUSH_S)

        self._flusher = threading.Thread(target=loop, name="llm-otel-logit-flush", daemon=True)
        self._flusher.start()
