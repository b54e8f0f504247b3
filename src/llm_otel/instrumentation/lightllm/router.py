"""LightLLM's router (``RouterManager``, request queues, ``Batch``): ``llm.router.request`` per
sampled sub-request (queued -> released, with queued/scheduled events) through the core's stage
records (:mod:`llm_otel.telemetry.stages`), and ``llm.engine.step`` per router-driven step (links
to the requests it served) through the core's step API (:mod:`llm_otel.telemetry.steps`).

Engine fields read (ModelTC/lightllm main @ fc72ffab unless noted): ``add_req(group_req_indexes)``
/ ``_add_req`` (#965) ``GroupReqIndexes.{group_req_id, multimodal_params, shm_req_indexes,
time_mark}`` (2024: ``add_req(prompt_ids, sampling_params, multimodal_params, group_req_id)``);
``<Queue>.generate_new_batch`` -> ``Batch.reqs``; ``Req.{request_id, input_len, shm_cur_output_len,
prompt_cache_len, is_aborted, finish_status}``; ``_decode_batch()`` / ``_decode_batch(batch)``
(v1.0) and ``running_batch``.
"""

from __future__ import annotations

import time
from typing import Any, cast

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
from llm_otel.telemetry.stages import ROUTER, StageRecord
from llm_otel.telemetry.steps import EngineSteps


class RouterAdapter:
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.reqs: dict[int, StageRecord] = {}  # llm.router.request records by sub-request id
        # llm.engine.step through the core's step API: LLM_OTEL_STEP_SPANS_PER_S, the same budget
        # as vLLM's engine core (one router = one engine loop); a step serving no sampled request
        # takes nothing from it
        self.step_spans = EngineSteps(telemetry)

    def add_req(self, hook: str):
        return read_then_call(self.telemetry, hook, self._queued)

    def _queued(self, wrapped, args, kwargs) -> None:
        now = time.time_ns()
        bound = bind(wrapped, args, kwargs)
        indexes = bound.get("group_req_indexes")
        if indexes is not None:
            gid, mm = indexes.group_req_id, indexes.multimodal_params
            n, time_mark = len(indexes.shm_req_indexes), getattr(indexes, "time_mark", None)
        else:  # 2024: add_req(prompt_ids, sampling_params, multimodal_params, group_req_id[, start_time])
            gid, mm = bound.get("group_req_id"), bound.get("multimodal_params")
            sp = bound.get("sampling_params")
            n = getattr(sp, "n", None) or getattr(sp, "best_of", None) or 1
            time_mark = bound.get("start_time")
        gid = request_id(gid)
        if gid is None or gid < 0 or len(self.reqs) >= MAX_LIVE:
            return
        carrier = C.carrier_for(mm, gid)
        if carrier is None:
            return
        for i in range(int(n)):
            parent, sampled = C.parent_for(carrier, gid + i)
            if not sampled:
                continue
            self.reqs[gid + i] = self.telemetry.start_stage(
                ROUTER,
                gid + i,
                cast(Context, parent),  # sampled: the carrier's traceparent is valid
                group_id=gid,
                choice_index=i,
                start_ns=now,
                queued_ns=now,
                frontend_arrival_s=time_mark,
            )

    def admit(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            batch = wrapped(*args, **kwargs)
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                if batch is not None and self.reqs:
                    now = time.time_ns()
                    for req in getattr(batch, "reqs", None) or ():
                        st = self.reqs.get(request_id(getattr(req, "request_id", None)))
                        if st is not None and st.scheduled_ns is None:
                            st.scheduled_ns = now
                            st.input_tokens = getattr(req, "input_len", None)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return batch

        return wrapper

    def decode_batch(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if not self.reqs or not self.step_spans.ready():
                return wrapped(*args, **kwargs)
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                batch = bind(wrapped, args, kwargs).get("batch") or getattr(instance, "running_batch", None)
                reqs = list(getattr(batch, "reqs", None) or ())
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
                return wrapped(*args, **kwargs)
            return self._step(hook, wrapped(*args, **kwargs), reqs)

        return wrapper

    async def _step(self, hook: str, coro, reqs: list):
        start_ns = time.time_ns()
        try:
            return await coro
        finally:
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                live: dict[Any, StageRecord] = self.reqs  # a request without an int id (None) finds nothing
                linked = [
                    st.span_context for st in (live.get(request_id(getattr(r, "request_id", None))) for r in reqs) if st
                ]
                span = self.step_spans.start(linked, start_ns=start_ns, batch_size=len(reqs))
                if span is not None:
                    self.step_spans.finish(span)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)

    def filter_finished(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            if not self.reqs:
                return wrapped(*args, **kwargs)
            snapshot = {}
            try:  # per step: inline, not errors.guard (0.3-0.7 us more)
                for req in list(getattr(instance, "reqs", None) or ()):
                    rid = request_id(getattr(req, "request_id", None))
                    if rid in self.reqs:
                        snapshot[rid] = self._read(req)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            result = wrapped(*args, **kwargs)
            try:
                if snapshot:
                    left = {request_id(getattr(r, "request_id", None)) for r in getattr(instance, "reqs", None) or ()}
                    for rid, facts in snapshot.items():
                        if rid not in left:
                            end_stage(self.telemetry, self.reqs, rid, facts)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    @staticmethod
    def _read(req) -> dict:
        """The facts :func:`~.requests.end_stage` takes, off a router ``Req`` as it leaves."""
        finished, aborted, reason = finish_info(getattr(req, "finish_status", None))
        output = getattr(req, "shm_cur_output_len", None)
        if output is None:  # 2024 layout: io_struct.Req
            output = getattr(req, "cur_output_len", None)
        return {
            "output": output,
            "cache": getattr(req, "prompt_cache_len", None),
            "input": getattr(req, "input_len", None),
            "reason": reason,
            "aborted": bool(getattr(req, "is_aborted", False)) or aborted,
        }
