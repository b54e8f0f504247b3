"""vLLM's offline beam search as one request per prompt (issue 28, item 5).

``LLM.beam_search(prompts, BeamSearchParams)`` (vLLM 0.32
``vllm/entrypoints/generate/beam_search/offline.py``) runs ``max_tokens`` steps; each step
(``_beam_search_step(instances_batch, base_sampling_params, ...)``) adds one internal one-token
engine request per live beam (``SamplingParams(max_tokens=1, logprobs=2 * beam_width)``), in the
order of the instances' ``beams``, and keeps the best ``beam_width`` extensions. Traced as plain
requests they were one unrelated trace and one counted request per beam and step, each forced to
compute logit statistics because it asks for log-probs.

Here each prompt (``BeamSearchInstance``) is one request record and span
(``text_completion <model>`` with ``llm.request.beam_width``), started at
the call and ended when ``beam_search`` returns: input tokens = the prompt's, one output token
per beam step that extended the prompt's beams (the best returned sequence's generated tokens
are its output tokens), counted once in the request metrics. The internal requests get no record
of their own (no span, no count, no logit statistics: their log-probs are vLLM's own search
input, left untouched); when the prompt's request is sampled they carry its trace context to the
engine core, so the step spans that served them link to it.

Fields read: ``BeamSearchParams.beam_width``, ``.max_tokens``; ``BeamSearchInstance.beams``;
``BeamSearchSequence.orig_prompt["prompt_token_ids"]``, ``.tokens`` (prompt + generated ids),
``.finish_reason``; ``BeamSearchOutput.sequences``; the internal ``EngineCoreRequest``'s
``sampling_params``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from opentelemetry.trace import SpanKind

from llm_otel.config import Settings
from llm_otel.errors import guard
from llm_otel.instrumentation.vllm.requests import EngineState, engine_params
from llm_otel.listeners import RequestFacts
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import RequestRecord, Telemetry
from llm_otel.telemetry.logit_capture import logit_top_k


class BeamCall:
    """One ``beam_search`` call: its prompts' records (by ``BeamSearchInstance``), and the records
    the internal requests of the running step belong to, in the order vLLM adds them."""

    __slots__ = ("arrival_s", "params", "records", "pending", "single", "top_k", "prompts")

    def __init__(self, arrival_s: float, params: Any) -> None:
        self.arrival_s = arrival_s
        self.params = params
        self.records: dict[int, tuple[Any, RequestRecord]] = {}  # id(instance) -> (instance, record)
        self.pending: list[RequestRecord] = []  # the running step's internal requests' records, reversed
        self.single: RequestRecord | None = None  # the OpenAI server's beam search: one prompt per call
        self.top_k: dict[int, int] = {}  # id(record) -> k of a prompt chosen for logit statistics
        self.prompts: dict[int, int] = {}  # id(instance) -> id of its prompt (its beams' orig_prompt)


# The beam_search call running on this thread (its internal requests are not requests of their own).
BEAM: contextvars.ContextVar[BeamCall | None] = contextvars.ContextVar("llm_otel_vllm_beam", default=None)


def _prompt_ids(beam: Any) -> list[int]:
    prompt = beam.orig_prompt
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    return list(ids) if ids is not None else []


class BeamSearch:
    """Mixin of :class:`~llm_otel.instrumentation.vllm.adapter.VLLMAdapter`: wrapper factories for
    ``BeamSearchOfflineMixin.beam_search`` and ``._beam_search_step``, and the hand-off of internal
    requests (:meth:`_beam_internal`, called by ``OutputProcessor.add_request``'s wrapper)."""

    telemetry: Telemetry
    settings: Settings  # VLLMAdapter's
    version: str

    _states: Any  # VLLMAdapter's: output processor -> EngineState

    _register_engine: Callable[[Any], None]  # VLLMAdapter's
    _state_for: Callable[[Any], EngineState]  # VLLMAdapter's

    def _state_of_llm(self, llm: Any) -> EngineState:
        """The engine state of an ``LLM`` (``llm.llm_engine``), registered on first sight."""
        engine = llm.llm_engine
        if engine.output_processor not in self._states:
            self._register_engine(engine)
        return self._state_for(engine.output_processor)

    def beam_search(self, hook: str):
        """``beam_search(prompts, params, ...)``: one :class:`BeamCall` while it runs; the records of
        its prompts end when it returns (an exception ends them with its class as ``error.type``)."""

        def wrapper(wrapped, instance, args, kwargs):
            call = None
            token = None
            with guard(hook, self.telemetry.errors):
                call = BeamCall(time.time(), args[1] if len(args) > 1 else kwargs.get("params"))
                token = BEAM.set(call)
            try:
                result = wrapped(*args, **kwargs)
            except Exception as error:
                if call is not None:
                    self._end_beams(hook, call, None, error)
                raise
            finally:
                if token is not None:
                    BEAM.reset(token)
            if call is not None:
                self._end_beams(hook, call, result, None)
            return result

        return wrapper

    def beam_step(self, hook: str):
        """``_beam_search_step(instances_batch, ...)``: before it, the prompts' records (started on
        their first step) in the order the step adds its internal requests (every beam of every
        instance; with structured outputs vLLM skips finished beams, so requests are matched by
        their prompt's token ids instead); after it, one output token for each prompt that still
        had beams."""

        def wrapper(wrapped, instance, args, kwargs):
            call = BEAM.get()
            live: list[tuple[Any, RequestRecord]] = []
            if call is not None:
                with guard(hook, self.telemetry.errors):
                    batch = args[0] if args else kwargs["instances_batch"]
                    order: list[RequestRecord] = []
                    for inst in batch:
                        if not inst.beams:
                            continue
                        entry = call.records.get(id(inst))
                        if entry is None:
                            entry = call.records[id(inst)] = (inst, self._beam_record(instance, call, inst))
                            call.prompts[id(inst)] = id(inst.beams[0].orig_prompt)
                        live.append(entry)
                        order.extend([entry[1]] * len(inst.beams))
                    order.reverse()
                    call.pending = order
            result = wrapped(*args, **kwargs)
            if call is not None:
                with guard(hook, self.telemetry.errors):
                    call.pending = []
                    now = time.monotonic()
                    for inst, rec in live:
                        # one step extended this prompt's beams by one token (the best beam's)
                        best = inst.beams[0].tokens[-1:] if inst.beams else [0]
                        rec.on_tokens(best or [0], now)
            return result

        return wrapper

    def _beam_record(self, llm: Any, call: BeamCall, inst: Any) -> RequestRecord:
        """The request record of one prompt of ``call``, started at the call's arrival."""
        state = self._state_of_llm(llm)
        params = call.params
        prompt_ids = _prompt_ids(inst.beams[0])
        attrs: dict[str, Any] = {A.LLM_REQUEST_BEAM_WIDTH: int(getattr(params, "beam_width", 0) or 0)}
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is not None:
            attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
        rec = self.telemetry.start_request(
            f"beam-{id(inst):x}",
            operation="text_completion",
            provider="vllm",
            model=state.model,
            kind=SpanKind.INTERNAL,
            arrival_s=call.arrival_s,
            input_tokens=len(prompt_ids),
            engine_version=self.version,
            request_attributes=attrs,
            facts=RequestFacts(None, {}, state.kv),
        )
        rec.vocab_size = state.vocab_size
        # logit statistics chosen like any other request's (LLM_OTEL_LOGIT_DIST_RATIO by trace id),
        # built at the end from the best sequence's log-probs (the 2 * beam_width top log-probs per
        # step vLLM computed for its own search): nothing more is asked of the engine
        k = logit_top_k(self.settings, rec.span, recording=rec.recording, limit=2 * int(params.beam_width or 1))
        if k:
            call.top_k[id(rec)] = k
        rec.logprob_cap = 0
        rec.on_handed()
        return rec

    def _beam_internal(self, call: BeamCall, request: Any) -> None:
        """An internal request of the running step (``OutputProcessor.add_request``): no record;
        when its prompt's record is sampled, its engine-bound ``SamplingParams`` carry that
        request span's trace context (step spans link to it)."""
        rec: RequestRecord | None = call.single
        if call.pending:
            rec = call.pending.pop()
            ids = request.prompt_token_ids
            expected = _prompt_ids_of(call, rec)
            if ids is not None and expected is not None and list(ids[: len(expected)]) != expected:
                rec = _match(call, ids)
        if rec is not None and rec.recording and request.sampling_params is not None:
            request.sampling_params = engine_params(request.sampling_params, rec, 0)

    def online_beam_search(self, hook: str):
        """OpenAI server: ``BeamSearchOnlineMixin.beam_search(prompt, request_id, params, ...)``, an
        async generator per prompt whose one ``RequestOutput`` (``request_id``, ``outputs``) comes
        at the end: one request record for the call (SERVER kind under the HTTP request's trace,
        ``gen_ai.response.id`` from the handler), ended with that output - the client gets every
        token then, so its first token time is the end. ``prompt["prompt_token_ids"]`` are the input
        tokens; the best sequence's ``token_ids`` the output tokens."""

        def wrapper(wrapped, instance, args, kwargs):
            stream = wrapped(*args, **kwargs)
            call = None
            with guard(hook, self.telemetry.errors):
                call = self._online_call(instance, args, kwargs)
            if call is None:
                return stream
            return self._online_stream(hook, stream, call)

        return wrapper

    def _online_call(self, serving: Any, args: tuple, kwargs: dict) -> BeamCall:
        from llm_otel.instrumentation.vllm.inbound import INBOUND
        from llm_otel.propagation import context_from_carrier

        prompt = args[0] if args else kwargs["prompt"]
        params = args[2] if len(args) > 2 else kwargs.get("params")
        decoder = prompt if prompt.get("type") != "enc_dec" else prompt["decoder_prompt"]
        engine = serving.engine_client
        if engine.output_processor not in self._states:
            self._register_engine(engine)
        state = self._state_for(engine.output_processor)
        inbound = INBOUND.get()
        call = BeamCall(time.time(), params)
        attrs: dict[str, Any] = {A.LLM_REQUEST_BEAM_WIDTH: int(getattr(params, "beam_width", 0) or 0)}
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is not None:
            attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
        if inbound is not None:
            inbound.started += 1
            attrs[A.GEN_AI_RESPONSE_ID] = inbound.response_id() or str(args[1] if len(args) > 1 else "")
        rec = self.telemetry.start_request(
            str(args[1] if len(args) > 1 else kwargs.get("request_id", "beam")),
            operation=inbound.operation if inbound is not None else "text_completion",
            provider="vllm",
            model=state.model,
            kind=SpanKind.SERVER if inbound is not None else SpanKind.INTERNAL,
            parent=context_from_carrier(inbound.carrier) if inbound is not None and inbound.carrier else None,
            arrival_s=call.arrival_s,
            input_tokens=len(decoder.get("prompt_token_ids") or ()),
            engine_version=self.version,
            request_attributes=attrs,
            facts=RequestFacts(inbound.headers if inbound is not None else None, {}, state.kv),
        )
        rec.logprob_cap = 0
        rec.on_handed()
        call.single = rec
        return call

    async def _online_stream(self, hook: str, stream: Any, call: BeamCall):
        token = BEAM.set(call)  # the tasks it creates for its internal requests copy this context
        rec = call.single
        error: BaseException | None = None
        try:
            async for out in stream:
                with guard(hook, self.telemetry.errors):
                    if rec is not None and out.outputs:
                        best = out.outputs[0]
                        rec.on_tokens(list(best.token_ids) or [], time.monotonic())
                        rec.finish_reason = str(best.finish_reason or "length")
                yield out
        except BaseException as exc:  # GeneratorExit (client gone) and errors end the record too
            error = exc
            raise
        finally:
            try:
                BEAM.reset(token)
            except ValueError:  # closed from another task's context: ours is gone with it
                pass
            if rec is not None:
                with guard(hook, self.telemetry.errors):
                    if error is not None and not rec.finish_reason:
                        rec.finish_reason = "abort" if isinstance(error, GeneratorExit) else "error"
                        rec.error_type = "aborted" if isinstance(error, GeneratorExit) else type(error).__qualname__
                    self.telemetry.finish(rec)

    def _end_beams(self, hook: str, call: BeamCall, result: Any, error: BaseException | None) -> None:
        with guard(hook, self.telemetry.errors):
            # an output belongs to the prompt whose beams share its sequences' orig_prompt object
            # (vLLM copies BeamSearchInstance's prompt into every beam it derives)
            best_of: dict[int, Any] = {}
            for out in list(result) if result is not None else []:
                seqs = getattr(out, "sequences", None)
                if seqs:
                    best_of[id(seqs[0].orig_prompt)] = seqs[0]
            for inst, rec in call.records.values():
                if error is not None:
                    rec.finish_reason = "error"
                    rec.error_type = type(error).__qualname__
                    rec.error_message = str(error)
                else:
                    best = best_of.get(call.prompts.get(id(inst), -1))
                    if best is not None:
                        k = call.top_k.get(id(rec))
                        if k:
                            rows = beam_logprob_rows(best, k)
                            if rows is not None:
                                rec.logprob_cap = 1
                                rec.on_logprobs(*rows)
                        generated = max(0, len(best.tokens) - len(_prompt_ids(best)))
                        rec.finish_reason = best.finish_reason or (
                            "length" if generated >= (getattr(call.params, "max_tokens", 0) or 0) else "stop"
                        )
                self.telemetry.finish(rec)


def beam_logprob_rows(seq: Any, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One ``(steps, k + 1)`` pair of token-id and log-prob arrays (vLLM ``LogprobsLists`` layout:
    column 0 the token the sequence took, columns 1.. its step's top-k by log-prob, nats) from a
    ``BeamSearchSequence``: ``.logprobs[j]`` is the ``{token id: Logprob}`` dict of generated token
    j (the internal request's ``2 * beam_width`` top log-probs plus the token taken), ``.tokens``
    its prompt + generated ids. Steps with fewer than k entries are padded (id -1, log-prob -inf).
    None when the sequence has no log-probs or they do not line up with its generated tokens."""
    steps = list(getattr(seq, "logprobs", None) or ())
    generated = list(seq.tokens)[len(_prompt_ids(seq)) :]
    if not steps or len(steps) > len(generated):
        return None
    ids = np.full((len(steps), k + 1), -1, dtype=np.int64)
    lps = np.full((len(steps), k + 1), -np.inf, dtype=np.float64)
    for j, step in enumerate(steps):
        token = generated[j]
        taken = step.get(token)
        ids[j, 0] = token
        lps[j, 0] = float(taken.logprob) if taken is not None else np.nan
        top = sorted(step.items(), key=lambda item: item[1].logprob, reverse=True)[:k]
        for c, (tid, lp) in enumerate(top, start=1):
            ids[j, c] = int(tid)
            lps[j, c] = float(lp.logprob)
    return ids, lps


def _prompt_ids_of(call: BeamCall, rec: RequestRecord) -> list[int] | None:
    for inst, r in call.records.values():
        if r is rec:
            return _prompt_ids(inst.beams[0]) if inst.beams else None
    return None


def _match(call: BeamCall, ids: Any) -> RequestRecord | None:
    """The record whose prompt starts ``ids`` (the longest such prompt), or None."""
    best: tuple[int, RequestRecord | None] = (-1, None)
    for inst, rec in call.records.values():
        if not inst.beams:
            continue
        prompt = _prompt_ids(inst.beams[0])
        if len(prompt) > best[0] and list(ids[: len(prompt)]) == prompt:
            best = (len(prompt), rec)
    return best[1]
