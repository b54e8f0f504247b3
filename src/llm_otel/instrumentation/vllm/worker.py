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
``req_states.req_id_to_index``. Under speculative decoding only request i's *first* row
(``cu_num_logits_np[i]``) is reduced: the target model's distribution for the step's first new
token, which is always an output token (the accepted first draft or the recovered/bonus token,
``sampled_token_ids[i, 0]``); draft rows after it are output tokens only when accepted, which is
known after sampling, so they are not reported - such a request's span has one entry per engine
step, not per token. The V1 runner (``_sample``) skips steps with speculative decoding.

Per step: the chosen rows are gathered and reduced on the logits' device *before* the sampler
runs (it may modify logits in place; the capture is the core's, :mod:`llm_otel.telemetry.logit_capture`,
the same as LightLLM's), and after it one ``(rows, 2k+3)`` transfer brings top-k,
entropy, non-finite flags and the sampled tokens' log-probs to host. That transfer is
synchronous: on a step with chosen rows the engine's thread waits for the sampler to finish on
the device. Unchosen requests cost a dict lookup (MRv2: one NumPy gather over the batch while
any chosen request is live). While a CUDA graph is captured nothing is reduced. A request's span is emitted when its last token is sampled (``max_tokens`` reached),
when vLLM drops it from ``requests``, or after ``IDLE_FLUSH_S`` without a step for it.
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
from llm_otel.instrumentation.vllm.logit_rows import Chosen as _Chosen
from llm_otel.instrumentation.vllm.logit_rows import Slots as _Slots
from llm_otel.instrumentation.vllm.logit_rows import Stream as _Stream
from llm_otel.propagation import context_from_carrier
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.logit_capture import capture_rows, wrap_sampler
from llm_otel.telemetry.spans import emit_logit_dist_for
from llm_otel.telemetry.steps import step_parent

IDLE_FLUSH_S = 2.0
MAX_STEPS_PER_REQUEST = 1 << 16


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
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._open_steps: dict[int, Any] = {}  # id(model runner) -> StepContext awaiting sample_tokens
        self._torch_cuda: Any = False  # torch.cuda once known to be usable, None when not
        self._owns_result: bool | None = None  # this rank returns the step's output (read once)
        # MRv2: Sampler -> {request-state slot: _Chosen}; weak, so a discarded runner takes its map
        self._chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sampler -> _Slots

    # --- device timing of steps ---------------------------------------------------------------
    def execute_model(self, hook: str):
        """Wrapper for ``GPUModelRunner.execute_model(scheduler_output, intermediate_tensors=None)``
        (V1) and MRv2's ``execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False,
        ...)``; MRv2 dummy runs (profiling, CUDA-graph capture, DP padding) are passed through."""

        def wrapper(wrapped, instance, args, kwargs):
            ctx = None
            if kwargs.get("dummy_run"):  # MRv2 passes it by keyword (_dummy_run); no step of a request
                return wrapped(*args, **kwargs)
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

        return wrapper

    def sample_tokens(self, hook: str):
        """Wrapper for ``GPUModelRunner.sample_tokens(grammar_output)``: ends the open step."""

        def wrapper(wrapped, instance, args, kwargs):
            try:
                return wrapped(*args, **kwargs)
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
        logits = args[0] if args else kwargs.get("logits")
        spec = args[1] if len(args) > 1 else kwargs.get("spec_decode_metadata")
        # with speculative decoding rows != requests; with TP every rank samples the same rows, and
        # only the rank whose output vLLM returns computes the statistics
        if logits is not None and spec is None and self._owns_sampling():
            return self._prepare(runner, logits)
        return None

    def _after_sample(self, runner: Any, plan, output: Any) -> None:
        self._collect(plan, getattr(output, "sampled_token_ids", None), plan[0], runner.requests)

    def _prepare(self, runner: Any, logits: Any):
        """V1: chosen rows of ``logits`` (row i <-> ``input_batch.req_ids[i]``), reduced."""
        req_ids = runner.input_batch.req_ids
        requests = runner.requests
        n = min(int(logits.shape[0]), len(req_ids))
        discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        rows, members = [], []
        for i in range(n):
            state = requests.get(req_ids[i])
            sp = getattr(state, "sampling_params", None) if state else None
            extra = getattr(sp, "extra_args", None)
            if not extra or CARRIER_TOPK_KEY not in extra:
                continue
            if discard is not None and i < len(discard) and discard[i]:
                continue
            rows.append(i)
            members.append(
                (req_ids[i], extra, getattr(sp, "max_tokens", None), len(getattr(state, "output_token_ids", ())))
            )
        return self._reduce(logits, rows, members)

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
                    slots.choose(int(req_idx), _Chosen(req_id, extra, getattr(sp, "max_tokens", None)))
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
        if self._chosen.get(sampler) and self._owns_sampling():  # TP: the output rank only
            logits = args[0] if args else kwargs.get("logits")
            batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
            if logits is not None and batch is not None:
                return self._prepare_mrv2(sampler, logits, batch)
        return None

    def _after_sampler_call(self, instance: Any, plan, output: Any) -> None:
        sampler = self._sampler_of(instance)
        rows, _, _, requests, n_logit_rows = plan
        sampled = getattr(output, "sampled_token_ids", None)
        # Sampler: one sampled row per logit row; RejectionSampler: (num_reqs, drafts + 1)
        by_row = sampled is not None and int(sampled.shape[0]) == n_logit_rows
        finished = self._collect(plan, sampled, rows if by_row else requests, sampler.req_states.req_id_to_index)
        if finished:  # forget their slots: a step without chosen requests costs one lookup
            slots = self._chosen.get(sampler) or _Slots()
            for slot in [k for k, c in slots.items() if c.req_id in finished]:
                slots.forget(slot)

    def _prepare_mrv2(self, sampler: Any, logits: Any, batch: Any):
        """MRv2: the first logit row of each chosen request of ``batch`` (an ``InputBatch``), reduced;
        the plan ends with each reduced request's index in the batch and the number of logit rows."""
        slots = cast(_Slots, self._chosen.get(sampler))  # the caller found chosen slots for sampler
        req_ids = batch.req_ids
        num_reqs = min(int(batch.num_reqs), len(req_ids))
        idx_mapping = np.asarray(batch.idx_mapping_np[:num_reqs])
        cu = batch.cu_num_logits_np
        # vectorised over the batch; the Python loop runs over the chosen requests only
        wanted = slots.matches(idx_mapping)
        wanted &= ~(
            batch.num_computed_tokens_np[:num_reqs] + batch.num_scheduled_tokens[:num_reqs]
            < batch.prefill_len_np[:num_reqs]
        )
        n_rows = int(logits.shape[0])
        rows, members, requests = [], [], []
        for i in np.flatnonzero(wanted).tolist():
            chosen = slots[int(idx_mapping[i])]
            req_id = req_ids[i]
            if chosen.req_id is not None and chosen.req_id != req_id:
                continue  # the slot was reused by a request added without our hook seeing it
            row = int(cu[i])
            if row >= n_rows:
                continue
            rows.append(row)
            requests.append(i)
            members.append((req_id, chosen.extra, chosen.max_tokens, None))
        plan = self._reduce(logits, rows, members)
        return None if plan is None else (*plan, requests, n_rows)

    # --- one step's statistics, both runners ------------------------------------------------------
    @staticmethod
    def _reduce(logits: Any, rows: list[int], members: list[tuple]):
        """A step's chosen ``rows`` of the ``(rows, vocab)`` ``logits``, reduced on their device
        (:func:`~llm_otel.telemetry.logit_capture.capture_rows`). ``members[j]`` = ``(req_id,
        extra_args, max_tokens, output tokens before this step or None)`` for ``rows[j]``.

        Returns ``(rows, members, StepLogits)`` or None (nothing chosen, or a CUDA graph is being
        captured)."""
        if not rows:
            return None
        k = max(int(extra[CARRIER_TOPK_KEY]) for _, extra, _, _ in members)
        captured = capture_rows(logits, rows, k)
        return None if captured is None else (rows, members, captured)

    def _collect(self, plan, sampled: Any, sampled_rows: list[int], live: Any) -> set[str]:
        """After the sampler: one ``(rows, 2k+3)`` transfer (statistics plus the log-probs of the
        tokens in column 0 of ``sampled[sampled_rows]``), then each member's stream is extended;
        streams of requests absent from ``live`` (vLLM's own request map) are emitted. Returns
        the request ids whose streams were emitted."""
        _, members, captured = plan[:3]
        stats, sampled_lp = captured.to_host(sampled, sampled_rows)
        step = (time.time_ns(), stats, sampled_lp)
        now_mono = time.monotonic()
        done = []
        with self._lock:
            streams = self._streams
            for j, (req_id, extra, max_tokens, tokens_before) in enumerate(members):
                stream = streams.get(req_id)
                if stream is None:
                    parent = context_from_carrier(
                        {"traceparent": extra.get(CARRIER_KEY), "tracestate": extra.get(CARRIER_STATE_KEY)}
                    )
                    if parent is None:
                        continue
                    stream = streams[req_id] = _Stream(parent, int(extra[CARRIER_TOPK_KEY]), max_tokens)
                if len(stream.rows) >= MAX_STEPS_PER_REQUEST:
                    continue
                before = tokens_before if tokens_before is not None else len(stream.rows)
                stream.rows.append((step, j))
                stream.last_mono = now_mono
                if stream.max_tokens is not None and before + 1 >= stream.max_tokens:
                    done.append(req_id)
            # requests vLLM no longer holds have finished (EOS, stop, abort)
            done.extend(r for r in streams if r not in live and r not in done)
            finished = [(r, streams.pop(r)) for r in done if r in streams]
        for _req_id, stream in finished:
            self._emit(stream)
        self._ensure_flusher()
        return {req_id for req_id, _ in finished}

    def _emit(self, stream: _Stream) -> None:
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
            self.telemetry,
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

    def flush(self, idle_s: float = 0.0) -> int:
        """Emit streams that saw no step for ``idle_s`` seconds (all with 0); returns how many."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            stale = [r for r, s in self._streams.items() if s.last_mono <= cutoff]
            streams = [self._streams.pop(r) for r in stale]
        for stream in streams:
            with guard("worker.flush", self.telemetry.errors):
                self._emit(stream)
        return len(streams)

    def _ensure_flusher(self) -> None:
        if self._flusher is not None:
            return

        def loop() -> None:
            while True:
                time.sleep(IDLE_FLUSH_S / 2)
                if self._streams:
                    self.flush(IDLE_FLUSH_S)

        self._flusher = threading.Thread(target=loop, name="llm-otel-logit-flush", daemon=True)
        self._flusher.start()
