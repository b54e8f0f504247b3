"""``llm.logit_dist`` for SGLang requests chosen for logit statistics, from the full-vocabulary logits
around SGLang's sampler in the scheduler process (it runs the model on TP rank 0 here), through the
core's capture (:mod:`llm_otel.telemetry.logit_capture`) and stage records
(:mod:`llm_otel.telemetry.stages`: an ``llm.infer.request`` span per chosen request, with
``llm.logit_dist`` under the request span).

The choice is made in the HTTP process (``logit_top_k``: ``LLM_OTEL_LOGIT_DIST_RATIO`` of the sampled
requests, by trace id) and travels in the carrier (``TOPK_KEY``). Row ``i`` of the sampler's logits
is request ``i`` of the batch ``run_batch`` is running (:attr:`LogitCapture.batch`, set by the
scheduler adapter around ``run_batch``): SGLang's ``LogitsProcessorOutput.next_token_logits`` has one
row per request of ``ScheduleBatch.reqs``, in that order.

Engine fields read (sglang 0.5.23, python/sglang/srt/layers/sampler.py, schedule_batch.py):
``Sampler.forward(logits_output, sampling_info, ...)`` -> next token ids ``(batch,)``;
``LogitsProcessorOutput.next_token_logits`` ``(batch, vocab)``; ``Req.{rid, origin_input_ids,
output_ids, finished_reason}``.
"""

from __future__ import annotations

import time
from typing import Any

from llm_otel.instrumentation.sglang.tokenizer import CHOICE_KEY, TOPK_KEY
from llm_otel.propagation import context_from_carrier
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.logit_capture import capture_rows, stage_row, wrap_sampler
from llm_otel.telemetry.stages import INFER, StageRecord

MAX_LOGIT_STEPS = 4096  # per request
MAX_CHOSEN = 10_000  # requests with logit statistics live in one scheduler


class LogitCapture:
    """The chosen requests' stage records in this scheduler and the sampler hook."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.chosen: dict[str, StageRecord] = {}  # rid -> its llm.infer.request record
        self.batch: list = []  # ScheduleBatch.reqs of the step run_batch is running

    def admit(self, rid: str, carrier: dict) -> None:
        """A request arrives in the scheduler with ``carrier``: a record when it was chosen."""
        k = carrier.get(TOPK_KEY)
        if not isinstance(k, int) or not 0 < k <= 64 or len(self.chosen) >= MAX_CHOSEN:
            return
        parent = context_from_carrier(carrier)
        if parent is None:
            return
        choice = carrier.get(CHOICE_KEY)
        self.chosen[rid] = self.telemetry.start_stage(
            INFER,
            rid,  # type: ignore[arg-type]  # the core prints it (str(request_id)); SGLang's ids are hex strings
            parent,
            group_id=0,
            choice_index=choice if isinstance(choice, int) else 0,
            start_ns=time.time_ns(),
            output_tokens=0,
            logit_top_k=k,
        )

    def finish(self, req: Any, aborted: bool = False) -> None:
        """The request left the scheduler (finished, or aborted): its spans, built by the core."""
        rid = req if isinstance(req, str) else getattr(req, "rid", None)
        st = self.chosen.pop(rid, None) if isinstance(rid, str) else None
        if st is None:
            return
        if not isinstance(req, str):
            st.input_tokens = len(getattr(req, "origin_input_ids", None) or ())
            st.output_tokens = len(getattr(req, "output_ids", None) or ())
            reason = getattr(req, "finished_reason", None)
            kind = type(reason).__name__ if reason is not None else None
            st.finish_reason = {
                "FINISH_LENGTH": "length",
                "FINISH_MATCHED_TOKEN": "stop",
                "FINISH_MATCHED_STR": "stop",
            }.get(kind or "", None)
            aborted = aborted or kind == "FINISH_ABORT"
        st.aborted = aborted
        self.telemetry.end_stage(st)

    def sampler(self, hook: str):
        return wrap_sampler(self.telemetry.errors, hook, self._before, self._after)

    def _before(self, instance, args, kwargs):
        chosen = self.chosen
        if not chosen:
            return None
        reqs = self.batch
        rows = [
            i
            for i, r in enumerate(reqs)
            if (st := chosen.get(r.rid)) is not None and len(st.logit_rows) < MAX_LOGIT_STEPS
        ]
        if not rows:
            return None
        output = args[0] if args else kwargs.get("logits_output")
        logits = getattr(output, "next_token_logits", None)
        if logits is None or logits.dim() != 2 or logits.shape[0] != len(reqs):
            return None  # not one row per request (a layout this does not know): no statistics
        k = max(chosen[reqs[i].rid].logit_top_k for i in rows)
        captured = capture_rows(logits, rows, k)
        return None if captured is None else (captured, [reqs[i].rid for i in rows])

    def _after(self, instance, plan, output) -> None:
        captured, rids = plan
        stats, sampled_lp = captured.to_host(output)
        now = time.time_ns()
        for j, rid in enumerate(rids):
            st = self.chosen.get(rid)
            if st is not None:
                st.logit_rows.append(stage_row(stats, sampled_lp, j, st.logit_top_k, now))
