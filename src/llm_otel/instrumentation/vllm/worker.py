"""Worker side of the vLLM adapter: device timing of each step, and ``llm.logit_dist`` from the
engine's full-vocabulary logits.

Device timing (docs/gpu.md): ``GPUModelRunner.execute_model(scheduler_output)`` begins a step on
the core's :class:`~llm_otel.telemetry.steps.StepTracker` - NVTX range and ring-buffer record on
torch's current CUDA stream - and the step ends after ``sample_tokens`` (or at once when
``execute_model`` returned the output itself). The step span's ids come from the engine core on
the ``SchedulerOutput`` (``STEP_CARRIER_ATTR``); steps without a sampled request carry none and
cost one ``getattr``. ``scheduler_output.num_scheduled_tokens`` gives the batch's request ids,
``scheduled_new_reqs[i].sampling_params.extra_args`` the request span of a request's first step
(its NVTX process range), ``finished_req_ids`` the requests whose ranges end.

Engine fields read (vLLM 0.32): ``GPUModelRunner._sample(logits, spec_decode_metadata)`` gets the
step's ``(rows, vocab)`` logits, row i belonging to ``input_batch.req_ids[i]``;
``requests[req_id]`` (``CachedRequestState``) holds ``sampling_params.extra_args`` with the carrier
the frontend put there - present only for sampled requests chosen for logit statistics - and
``output_token_ids``; ``discard_request_mask`` marks rows of partial (chunked) prefills, whose
sample is thrown away; the sampler returns ``sampled_token_ids``.

Per step: the chosen rows are gathered and reduced on the logits' device *before* the sampler
runs (it may modify logits in place), and after it one ``(rows, 2k+3)`` transfer brings top-k,
entropy, non-finite flags and the sampled tokens' log-probs to host. Unchosen requests cost a
dict lookup. A request's span is emitted when its last token is sampled (``max_tokens`` reached),
when vLLM drops it from ``requests``, or after ``IDLE_FLUSH_S`` without a step for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from llm_otel.instrumentation.vllm.engine_core import (CARRIER_KEY, CARRIER_STATE_KEY, CARRIER_TOPK_KEY,
                                                       STEP_CARRIER_ATTR)
from llm_otel.propagation import context_from_carrier, parse_traceparent
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.spans import emit_logit_dist
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
    except Exception:  # noqa: BLE001 - no process groups: the only rank
        return True
    for name in ("get_pcp_group", "get_dcp_group"):  # newer context-parallel groups, when vLLM has them
        try:
            if getattr(ps, name)().rank_in_group != 0:
                return False
        except Exception:  # noqa: BLE001
            continue
    return True


class _Stream:
    """One request's logit statistics so far: ``(step, row)`` pairs into the per-step arrays
    (one tuple per step and request on the engine's thread; stacked once, when the span is built)."""

    __slots__ = ("parent", "k", "max_tokens", "rows", "last_mono")

    def __init__(self, parent, k: int, max_tokens: int | None) -> None:
        self.parent = parent
        self.k = k
        self.max_tokens = max_tokens
        self.rows: list[tuple[tuple, int]] = []  # (step, row); step = (time_ns, stats, sampled_lp)
        self.last_mono = time.monotonic()


class WorkerAdapter:
    """Wrapper factories for ``GPUModelRunner.execute_model`` / ``sample_tokens`` (device timing
    of steps) and ``GPUModelRunner._sample`` (logit statistics); vLLM's CPU model runner inherits
    all three."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._open_steps: dict[int, Any] = {}  # id(model runner) -> StepContext awaiting sample_tokens
        self._torch_cuda: Any = False  # torch.cuda once known to be usable, None when not
        self._owns_result: bool | None = None  # this rank returns the step's output (read once)

    # --- device timing of steps ---------------------------------------------------------------
    def execute_model(self, hook: str):
        """Wrapper for ``GPUModelRunner.execute_model(scheduler_output, intermediate_tensors=None)``."""
        def wrapper(wrapped, instance, args, kwargs):
            ctx = None
            try:
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
            except Exception:  # noqa: BLE001
                cuda = None
            self._torch_cuda = cuda
        if cuda is None or not cuda.is_initialized():
            return None
        if cuda.is_current_stream_capturing():
            return False  # a record launched now would be frozen into the graph
        return cuda.current_stream().cuda_stream

    def _begin_step(self, so: Any):
        carrier = getattr(so, STEP_CARRIER_ATTR, None)
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
        scheduled = so.num_scheduled_tokens
        new = so.scheduled_new_reqs
        prefill = sum(scheduled.get(r.req_id, 0) for r in new)
        cached = so.scheduled_cached_reqs
        for req_id, n_out in zip(cached.req_ids, cached.num_output_tokens):
            if n_out == 0:
                prefill += scheduled.get(req_id, 0)
        total = int(so.total_num_scheduled_tokens)
        phase = "decode" if prefill == 0 else "prefill" if prefill == total else "mixed"
        request_spans = None
        if steps.nvtx.active and new:
            request_spans = {}
            for r in new:
                extra = getattr(getattr(r, "sampling_params", None), "extra_args", None)
                sc = parse_traceparent(extra.get(CARRIER_KEY)) if extra else None
                if sc is not None:
                    request_spans[r.req_id] = (sc.trace_id, sc.span_id)
        return steps.begin(list(scheduled), parent=step_parent(trace_id, span_id, sampled), phase=phase,
                           stream=stream, request_spans=request_spans)

    def _end_step(self, ctx: Any, hook: str) -> None:
        try:
            stream = self._cuda_stream()
            self.telemetry.steps.end(ctx, stream=stream if stream is not False else None)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report(hook, exc)

    def sample(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            plan = None
            try:
                logits = args[0] if args else kwargs.get("logits")
                spec = args[1] if len(args) > 1 else kwargs.get("spec_decode_metadata")
                if self._owns_result is None:
                    self._owns_result = owns_sampling_result()
                # with speculative decoding rows != requests; with TP every rank samples the same
                # rows, and only the rank whose output vLLM returns computes the statistics
                if logits is not None and spec is None and self._owns_result:
                    plan = self._prepare(instance, logits)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            output = wrapped(*args, **kwargs)
            if plan is not None:
                try:
                    self._collect(instance, plan, output)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return output

        return wrapper

    def _prepare(self, runner: Any, logits: Any):
        import torch

        from llm_otel.telemetry.logits import TorchLogitStats

        req_ids = runner.input_batch.req_ids
        requests = runner.requests
        n = min(int(logits.shape[0]), len(req_ids))
        discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        rows, members, k = [], [], 0
        for i in range(n):
            state = requests.get(req_ids[i])
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) if state else None
            if not extra or CARRIER_TOPK_KEY not in extra:
                continue
            if discard is not None and i < len(discard) and discard[i]:
                continue
            rows.append(i)
            members.append((req_ids[i], extra, state))
            k = max(k, int(extra[CARRIER_TOPK_KEY]))
        if not rows:
            return None
        index = torch.tensor(rows, device=logits.device)
        return rows, members, index, TorchLogitStats(logits.index_select(0, index), k)

    def _collect(self, runner: Any, plan, output: Any) -> None:
        rows, members, index, device_stats = plan
        sampled = getattr(output, "sampled_token_ids", None)
        sampled_rows = sampled.index_select(0, index.to(sampled.device))[:, 0] if sampled is not None else None
        stats, sampled_lp = device_stats.to_host(sampled_rows)
        step = (time.time_ns(), stats, sampled_lp)
        now_mono = time.monotonic()
        done = []
        with self._lock:
            streams = self._streams
            for j, (req_id, extra, state) in enumerate(members):
                stream = streams.get(req_id)
                if stream is None:
                    parent = context_from_carrier({"traceparent": extra.get(CARRIER_KEY),
                                                   "tracestate": extra.get(CARRIER_STATE_KEY)})
                    if parent is None:
                        continue
                    stream = streams[req_id] = _Stream(parent, int(extra[CARRIER_TOPK_KEY]),
                                                       getattr(state.sampling_params, "max_tokens", None))
                if len(stream.rows) >= MAX_STEPS_PER_REQUEST:
                    continue
                stream.rows.append((step, j))
                stream.last_mono = now_mono
                if stream.max_tokens is not None and len(getattr(state, "output_token_ids", ())) + 1 >= stream.max_tokens:
                    done.append(req_id)
            # requests vLLM no longer holds have finished (EOS, stop, abort)
            live = runner.requests
            done.extend(r for r in streams if r not in live and r not in done)
            finished = [(r, streams.pop(r)) for r in done if r in streams]
        for req_id, stream in finished:
            self._emit(stream)
        self._ensure_flusher()

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
        emit_logit_dist(
            self.telemetry.tracer, self.telemetry.settings, stream.parent, source="full_vocab_logits",
            start_ns=times_ns[0], end_ns=times_ns[-1], times_ns=times_ns, top_ids=top_ids, top_logprobs=top_lp,
            sampled_logprobs=sampled_lp, entropy=entropy, margin=margin, nonfinite=nonfinite)

    def flush(self, idle_s: float = 0.0) -> int:
        """Emit streams that saw no step for ``idle_s`` seconds (all with 0); returns how many."""
        cutoff = time.monotonic() - idle_s
        with self._lock:
            stale = [r for r, s in self._streams.items() if s.last_mono <= cutoff]
            streams = [self._streams.pop(r) for r in stale]
        for stream in streams:
            try:
                self._emit(stream)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report("worker.flush", exc)
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
