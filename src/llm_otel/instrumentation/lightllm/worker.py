"""LightLLM's model-infer worker (``InferenceContext``, ``InferReq``; master rank of its DP group
only): ``llm.infer.request`` per sampled sub-request (admitted -> released, per-token timing,
sampled-token log-probs) and, for requests chosen for logit statistics, ``llm.logit_dist`` from the
full-vocabulary logits around LightLLM's sampler; both built by the core from one
:class:`~llm_otel.telemetry.stages.StageRecord` per sub-request.

Engine fields read (ModelTC/lightllm main @ fc72ffab unless noted): ``InferenceContext.add_reqs(
requests, ...)`` tuples ``(request_id, shm_index, multimodal_params, dp_index)``;
``InferReq.set_next_gen_token_id(next_token_id, logprob[, output_len])``, ``InferReq.{req_id,
shm_req, finish_status}``; ``InferenceContext.filter(finished_request_ids)`` and
``requests_mapping``; ``sample(logits, reqs, eos_id)`` -> ``(next_token_ids, next_token_probs)``.
"""

from __future__ import annotations

import time
from typing import cast

from opentelemetry.context import Context

from llm_otel.instrumentation.lightllm import carrier as C
from llm_otel.instrumentation.lightllm.requests import (
    MAX_LIVE,
    bind,
    end_stage,
    finish_info,
    read_then_call,
    request_id,
)
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.logit_capture import capture_rows, stage_row, wrap_sampler
from llm_otel.telemetry.stages import INFER, StageRecord

MAX_LOGIT_STEPS = 4096


def _master_rank() -> bool | None:
    """Whether this worker is the master rank of its DP group - the one whose results LightLLM
    writes to shared memory; None if unknown yet (then it reports). main / v1.0.1:
    ``lightllm.utils.dist_utils.get_current_rank_in_dp() == 0``; v1.0.0 has no such function (its
    ``dist_utils`` only wraps ``torch.distributed``) and every rank samples and sets tokens: the
    rank from the process's ``_init_env`` arguments (``process.is_master_worker``: ``tp_rank <
    dp_size``, as v1.0.0's ``post_handel`` writes shared memory)."""
    try:
        from lightllm.utils.dist_utils import get_current_rank_in_dp
    except ImportError:
        from llm_otel.instrumentation.lightllm.process import is_master_worker

        return is_master_worker()
    try:
        return get_current_rank_in_dp() == 0
    except Exception:  # noqa: BLE001 - silent: not initialised: treat as master
        return None


class WorkerAdapter:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.reqs: dict[int, StageRecord] = {}  # llm.infer.request records by sub-request id
        self._master: bool | None = None

    def add_reqs(self, hook: str):
        return read_then_call(self.telemetry, hook, self._admitted)

    def _admitted(self, wrapped, args, kwargs) -> None:
        if self._master is None:
            self._master = _master_rank()
        if self._master is False:
            return
        now = time.time_ns()
        for item in bind(wrapped, args, kwargs).get("requests") or ():
            rid, mm = request_id(item[0]), item[2]
            if rid is None or rid < 0:
                continue
            st = self.reqs.get(rid)
            if st is not None:  # paused and resumed
                st.resumed += 1
                continue
            gid = C.group_of(rid)
            carrier = C.carrier_for(mm, gid)
            if carrier is None or len(self.reqs) >= MAX_LIVE:
                continue
            parent, sampled = C.parent_for(carrier, rid)
            if sampled:
                top_k = carrier.get(C.TOPK_KEY)
                top_k = top_k if isinstance(top_k, int) and 0 < top_k <= 64 else 0
                # the worker counts the tokens it produces (one set_next_gen_token_id call each)
                self.reqs[rid] = self.telemetry.start_stage(
                    INFER,
                    rid,
                    cast(Context, parent),  # sampled: the carrier's traceparent is valid
                    group_id=gid,
                    choice_index=rid - gid,
                    start_ns=now,
                    output_tokens=0,
                    logit_top_k=top_k,
                )

    def token(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if self.reqs:
                try:  # per token: inline, not errors.guard (0.3-0.7 us more)
                    st = self.reqs.get(request_id(instance.req_id))
                    if st is not None:
                        now = time.time_ns()
                        token_id = args[0] if args else kwargs.get("next_token_id")
                        logprob = args[1] if len(args) > 1 else kwargs.get("logprob", 0.0)
                        if not st.token_times:
                            shm = getattr(instance, "shm_req", None)
                            st.input_tokens = getattr(shm, "input_len", None)
                        st.on_token(token_id, logprob, now)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper

    def sample(self, hook: str):
        """``sample(logits, reqs, eos_id)``: statistics of the chosen rows are taken on the logits'
        device before LightLLM's sampler runs (it modifies the logits in place); one transfer after
        it (:mod:`llm_otel.telemetry.logit_capture`)."""
        return wrap_sampler(self.telemetry.errors, hook, self._prepare, self._collect)

    def _prepare(self, instance, args, kwargs):
        """Row i of the logits is ``reqs[i]``; the rows of requests that asked for logit statistics."""
        if not self.reqs:
            return None
        logits = args[0] if args else kwargs.get("logits")
        reqs = args[1] if len(args) > 1 else kwargs.get("reqs")
        rows, members, k = [], [], 0
        for i, req in enumerate(reqs or ()):
            st = self.reqs.get(request_id(getattr(req, "req_id", None)))
            if st is not None and st.logit_top_k and len(st.logit_rows) < MAX_LOGIT_STEPS:
                rows.append(i)
                members.append(st)
                k = max(k, st.logit_top_k)
        if not rows or logits is None:
            return None
        captured = capture_rows(logits, rows, k)
        return None if captured is None else (members, captured)

    def _collect(self, instance, plan, output) -> None:
        """The sampler returns ``(next_token_ids, next_token_probs)``; ids of row i are request i's."""
        members, captured = plan
        ids = output[0] if isinstance(output, tuple) else None
        if ids is not None:
            import torch

            ids = (ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)).reshape(-1)
        stats, sampled_lp = captured.to_host(ids)
        now = time.time_ns()
        for j, st in enumerate(members):
            st.logit_rows.append(stage_row(stats, sampled_lp, j, st.logit_top_k, now))

    def filter(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            ended = []
            if self.reqs:
                try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                    ids = bind(wrapped, args, kwargs).get("finished_request_ids") or ()
                    mapping = getattr(instance, "requests_mapping", None) or {}
                    for rid in map(request_id, ids):
                        if rid in self.reqs:
                            ended.append((rid, self._read(mapping.get(rid))))
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            for rid, facts in ended:
                try:
                    end_stage(self.telemetry, self.reqs, rid, facts)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    @staticmethod
    def _read(req) -> dict:
        """The facts :func:`~.requests.end_stage` takes, off an ``InferReq`` as it leaves."""
        shm = getattr(req, "shm_req", None)
        _finished, aborted, reason = finish_info(getattr(req, "finish_status", None))
        return {
            "reason": reason,
            "input": getattr(shm, "input_len", None),
            "cache": getattr(shm, "prompt_cache_len", None),
            "aborted": aborted or bool(getattr(shm, "router_aborted", False) or getattr(shm, "is_aborted", False)),
        }
