"""SGLang's scheduler process (``Scheduler``, one per TP/DP rank): ``llm.engine.step`` per
``run_batch`` through the core's step API (:mod:`llm_otel.telemetry.steps`), linked to the sampled
request spans in the batch.

The request spans live in the HTTP process. Their ``SpanContext`` arrives here with the request on
SGLang's own per-request carrier (the pickled ``APIServerReqTimeStats``, see hooks.py) and goes
into :attr:`SchedulerAdapter.table`, keyed by request id: an entry leaves when its request finishes
(``process_batch_result`` marked it finished) or is aborted, and the table is capped at ``MAX_LIVE``.
Unsampled requests never enter it, so a batch without a sampled request costs one dict lookup per
request and no span.

Engine fields read (sgl-project/sglang 0.5.23, python/sglang/srt/managers/scheduler.py,
schedule_batch.py): ``handle_generate_request(recv_req)``: ``TokenizedGenerateReqInput.rid``,
``.time_stats`` (unpickled ``APIServerReqTimeStats``); ``run_batch(batch)``: ``ScheduleBatch.reqs``
(``Req.rid``, ``Req.finished()``), ``.forward_mode.is_extend()``, ``.extend_num_tokens``;
``abort_request(recv_req)``: ``AbortReq.rid`` (a prefix: SGLang aborts every rid starting with it),
``.abort_all``; ``process_batch_result(batch, result)``.
"""

from __future__ import annotations

import time

from opentelemetry.trace import SpanContext

from llm_otel.instrumentation.sglang.logits import LogitCapture
from llm_otel.instrumentation.sglang.tokenizer import CARRIER_ATTR, MAX_LIVE
from llm_otel.propagation import TRACEPARENT, parse_traceparent
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.steps import EngineSteps


class SchedulerAdapter:
    """Wrapper factories for the scheduler hooks (``scheduler.*`` in hooks.py)."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.table: dict[str, SpanContext] = {}  # rid -> the sampled request span's context
        self.step_spans = EngineSteps(telemetry)  # LLM_OTEL_STEP_SPANS_PER_S budget
        self.logits = LogitCapture(telemetry)  # llm.logit_dist of the chosen requests

    def init(self, hook: str):
        """``Scheduler.__init__(server_args, port_args)`` in the ``sglang::scheduler`` process: this
        process is an ``engine_core`` with the scheduler's ``tp_rank``/``pp_rank``/``dp_rank`` (the
        SGLang scheduler runs the model itself, so it is also its rank's worker)."""

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            try:
                from llm_otel.process.identity import relabel

                ranks = {k: getattr(instance, k, None) for k in ("tp_rank", "pp_rank", "dp_rank")}
                relabel(
                    "engine_core",
                    process_name="sglang::scheduler",
                    **{k: v for k, v in ranks.items() if isinstance(v, int)},
                )
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def handle_generate_request(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            try:  # per request: inline
                recv = args[0] if args else kwargs.get("recv_req")
                carrier = getattr(getattr(recv, "time_stats", None), CARRIER_ATTR, None)
                if isinstance(carrier, dict) and len(self.table) < MAX_LIVE:
                    sc = parse_traceparent(carrier.get(TRACEPARENT))
                    rid = getattr(recv, "rid", None)
                    if sc is not None and sc.trace_flags.sampled and isinstance(rid, str):
                        self.table[rid] = sc
                        self.logits.admit(rid, carrier)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper

    def run_batch(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            table = self.table
            if not table:
                return wrapped(*args, **kwargs)
            span = None
            reqs: list = []
            try:  # per step: inline, not errors.guard
                batch = args[0] if args else kwargs.get("batch")
                reqs = list(getattr(batch, "reqs", None) or ())
                if self.step_spans.ready():
                    links = [sc for sc in (table.get(getattr(r, "rid", None)) for r in reqs) if sc is not None]
                    prefill = decode = None
                    mode = getattr(batch, "forward_mode", None)
                    if mode is not None and mode.is_extend():
                        prefill = int(getattr(batch, "extend_num_tokens", 0) or 0)
                    elif mode is not None and mode.is_decode():
                        decode = len(reqs)
                    span = self.step_spans.start(
                        links,
                        start_ns=time.time_ns(),
                        batch_size=len(reqs),
                        prefill_tokens=prefill,
                        decode_tokens=decode,
                    )
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            cpu0 = time.thread_time()
            if self.logits.chosen:
                self.logits.batch = reqs  # the sampler's rows, in this order
            try:
                return wrapped(*args, **kwargs)
            finally:
                self.logits.batch = []
                try:
                    if span is not None:
                        self.step_spans.finish(span, cpu_time_s=time.thread_time() - cpu0)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)

        return wrapper

    def batch_result(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            if self.table:
                try:  # per step: inline, not errors.guard
                    batch = args[0] if args else kwargs.get("batch")
                    table = self.table
                    for req in getattr(batch, "reqs", None) or ():
                        rid = getattr(req, "rid", None)
                        if rid in table and req.finished():
                            del table[rid]
                            if rid in self.logits.chosen:
                                self.logits.finish(req)
                except Exception as exc:  # noqa: BLE001
                    self.telemetry.errors.report(hook, exc)
            return result

        return wrapper

    def abort_output(self, hook: str):
        """``Scheduler.send_abort_output(abort_req, req)``: the request ends without a batch result
        (SGLang rejected it in ``_add_request_to_queue``, or ended it while queued or retracted)."""

        def wrapper(wrapped, instance, args, kwargs):
            try:
                req = args[1] if len(args) > 1 else kwargs.get("req")
                rid = getattr(req, "rid", None)
                if isinstance(rid, str):
                    self.table.pop(rid, None)
                    if rid in self.logits.chosen:
                        self.logits.finish(req, aborted=True)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper

    def abort(self, hook: str):
        def wrapper(wrapped, instance, args, kwargs):
            try:
                recv = args[0] if args else kwargs.get("recv_req")
                if getattr(recv, "abort_all", False):
                    self.table.clear()
                    gone = list(self.logits.chosen)
                else:
                    prefix = getattr(recv, "rid", None)
                    gone = []
                    if isinstance(prefix, str) and prefix:
                        for rid in [r for r in self.table if r.startswith(prefix)]:
                            del self.table[rid]
                        gone = [r for r in self.logits.chosen if r.startswith(prefix)]
                for rid in gone:
                    self.logits.finish(rid, aborted=True)
            except Exception as exc:  # noqa: BLE001
                self.telemetry.errors.report(hook, exc)
            return wrapped(*args, **kwargs)

        return wrapper
