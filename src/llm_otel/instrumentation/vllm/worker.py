"""Worker side of the vLLM adapter: ``llm.logit_dist`` from the engine's full-vocabulary logits.

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

from llm_otel.instrumentation.vllm.engine_core import CARRIER_KEY, CARRIER_STATE_KEY, CARRIER_TOPK_KEY
from llm_otel.propagation import context_from_carrier
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.spans import emit_logit_dist

IDLE_FLUSH_S = 2.0
MAX_STEPS_PER_REQUEST = 1 << 16


class _Stream:
    __slots__ = ("parent", "times_ns", "top_ids", "top_lp", "entropy", "margin", "nonfinite", "sampled_lp",
                 "last_mono")

    def __init__(self, parent) -> None:
        self.parent = parent
        self.times_ns: list[int] = []
        self.top_ids: list[np.ndarray] = []
        self.top_lp: list[np.ndarray] = []
        self.entropy: list[float] = []
        self.margin: list[float] = []
        self.nonfinite: list[bool] = []
        self.sampled_lp: list[float] = []
        self.last_mono = time.monotonic()


class WorkerAdapter:
    """Wrapper factory for ``GPUModelRunner._sample`` (inherited by vLLM's CPU model runner)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._flusher: threading.Thread | None = None

    def sample(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            plan = None
            try:
                logits = args[0] if args else kwargs.get("logits")
                spec = args[1] if len(args) > 1 else kwargs.get("spec_decode_metadata")
                if logits is not None and spec is None:  # with speculative decoding rows != requests
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
        now_ns, now_mono = time.time_ns(), time.monotonic()
        done = []
        with self._lock:
            for j, (req_id, extra, state) in enumerate(members):
                stream = self._streams.get(req_id)
                if stream is None:
                    parent = context_from_carrier({"traceparent": extra.get(CARRIER_KEY),
                                                   "tracestate": extra.get(CARRIER_STATE_KEY)})
                    if parent is None:
                        continue
                    stream = self._streams[req_id] = _Stream(parent)
                if len(stream.times_ns) >= MAX_STEPS_PER_REQUEST:
                    continue
                k = int(extra[CARRIER_TOPK_KEY])
                stream.times_ns.append(now_ns)
                stream.top_ids.append(stats.top_ids[j, :k])
                stream.top_lp.append(stats.top_logprobs[j, :k])
                stream.entropy.append(float(stats.entropy[j]))
                stream.margin.append(float(stats.margin[j]))
                stream.nonfinite.append(bool(stats.nonfinite[j]))
                stream.sampled_lp.append(float(sampled_lp[j]) if sampled_lp is not None else np.nan)
                stream.last_mono = now_mono
                max_tokens = getattr(state.sampling_params, "max_tokens", None)
                if max_tokens is not None and len(getattr(state, "output_token_ids", ())) + 1 >= max_tokens:
                    done.append(req_id)
            # requests vLLM no longer holds have finished (EOS, stop, abort)
            live = runner.requests
            done.extend(r for r in self._streams if r not in live and r not in done)
            finished = [(r, self._streams.pop(r)) for r in done if r in self._streams]
        for req_id, stream in finished:
            self._emit(stream)
        self._ensure_flusher()

    def _emit(self, stream: _Stream) -> None:
        if not stream.times_ns:
            return
        emit_logit_dist(
            self.telemetry.tracer, self.telemetry.settings, stream.parent, source="full_vocab_logits",
            start_ns=stream.times_ns[0], end_ns=stream.times_ns[-1], times_ns=stream.times_ns,
            top_ids=np.stack(stream.top_ids), top_logprobs=np.stack(stream.top_lp),
            sampled_logprobs=np.asarray(stream.sampled_lp), entropy=np.asarray(stream.entropy),
            margin=np.asarray(stream.margin), nonfinite=np.asarray(stream.nonfinite))

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
