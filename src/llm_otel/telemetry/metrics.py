"""GenAI server metrics, recorded for every finished request - sampled or not.

Exemplars: latency observations are recorded in the request span's context when the span is
sampled, so the SDK's default ``trace_based`` exemplar filter keeps the trace id of sampled
requests on the latency histograms (one exemplar per bucket, the SDK's aligned-bucket reservoir);
for inter-token latency only the request's largest gap carries it. Other observations use an empty
context, so a span that happens to be current when the engine finishes a request never lends its
trace id.

Cardinality: attributes are model, provider, operation, finish reason and ``error.type`` only -
never request ids or text. ``error.type`` values are capped at :data:`MAX_ERROR_TYPES` distinct
values per process; later new values are recorded as ``_OTHER`` (logged once).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

from llm_otel.errors import process_errors
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.telemetry.outlets import MetricInstrument, MetricsOutlet
from llm_otel.telemetry.record import RequestRecord

logger = logging.getLogger("llm_otel")

MAX_ERROR_TYPES = 32
OTHER = "_OTHER"  # OpenTelemetry's fallback value for error.type
MAX_ATTRIBUTE_SETS = 256  # distinct per-request metric attribute sets kept (Instruments._attribute_sets)
# Context for observations that must not pick up an exemplar from whatever span is current when
# the engine finishes a request (the SDK falls back to the current context for None - and for an
# empty Context, which is falsy): the invalid span is never sampled. The exporter process records
# observations without an exemplar with it too.
NO_TRACE = trace.set_span_in_context(trace.INVALID_SPAN)

# (request attributes, ``llm.server.requests`` attributes without ``error.type``, input and output
# ``llm.server.token.usage`` attributes): see Instruments._attribute_sets
AttributeSets = tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]
# one finished request's observations: see Instruments.observations
Observations = tuple[
    AttributeSets,
    bool,
    float,
    float | None,
    float | None,
    Sequence[float],
    float | None,
    float | None,
    int,
    int | None,  # output tokens; None for a pooling request (none recorded)
    str | None,
]


class Instruments:
    """The instruments llm-otel records per request, created once per meter with the semconv bucket advisories.

    * ``gen_ai.server.time_to_first_token`` (s): arrival -> first token, successful requests.
    * ``gen_ai.server.time_per_output_token`` (s): (last - first token) / (tokens - 1), successful
      requests with at least 2 output tokens.
    * ``gen_ai.server.request.duration`` (s): arrival -> finish, every request; ``error.type`` on failures.
    * ``llm.server.token.usage`` ({token}): input and output tokens (``gen_ai.token.type``).
    * ``llm.server.request.queue_time`` (s): scheduler queue wait, when the engine reports it.
    * ``llm.server.inter_token_latency`` (s): per engine step after the first that produced tokens
      for the request: gap to the previous such step / tokens produced (engine step timestamps);
      one gap in every ``itl_every`` of each request (systematic sample from a random offset:
      every gap is kept with probability ``1/itl_every``, so quantiles are unbiased and the count
      is ``1/itl_every`` of the gaps).
    * ``llm.server.output_token_rate`` ({token}/s): output tokens / request duration.
    * ``llm.server.requests`` ({request}): every finished or rejected request, with
      ``llm.response.finish_reason`` and ``error.type``.

    ``n > 1`` (several choices of one prompt, a record each): the request duration, the request
    count and the input tokens are recorded once per request, by the choice that finishes last
    (with its finish reason / error); output tokens, TTFT, TPOT, ITL, output token rate and queue
    time once per choice. So the counts add up to what the engine served (one prompt, n outputs).
    """

    def __init__(self, meter: Meter, itl_every: int = 1, outlet: MetricsOutlet | None = None) -> None:
        if itl_every < 1:
            raise ValueError(f"itl_every must be >= 1, got {itl_every}")
        self.itl_every = int(itl_every)
        self._rng = random.Random()  # own generator: engines seed the global one identically everywhere
        # ``sink(observations, span context or None)``: with an outlet (the exporter process records
        # the per-request metrics) a finished request's observations go there as one record
        self.sink = outlet.push_request if outlet is not None else None

        def hist(
            attr: str, name: str, unit: str, buckets: tuple[float, ...], description: str
        ) -> Histogram | MetricInstrument:
            if outlet is not None:  # recorded elsewhere: the outlet's stand-in for this attribute
                return outlet.instrument(attr)
            return meter.create_histogram(
                name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
            )

        self.meter = meter
        self.ttft = hist(
            "ttft",
            M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
            M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN_UNIT,
            M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN_BUCKETS,
            "Time to generate first token for successful responses.",
        )
        self.tpot = hist(
            "tpot",
            M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
            M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN_UNIT,
            M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN_BUCKETS,
            "Time per output token generated after the first token for successful responses.",
        )
        self.duration = hist(
            "duration",
            M.GEN_AI_SERVER_REQUEST_DURATION,
            M.GEN_AI_SERVER_REQUEST_DURATION_UNIT,
            M.GEN_AI_SERVER_REQUEST_DURATION_BUCKETS,
            "Generative AI server request duration.",
        )
        self.tokens = hist(
            "tokens",
            M.LLM_SERVER_TOKEN_USAGE,
            M.LLM_SERVER_TOKEN_USAGE_UNIT,
            M.LLM_SERVER_TOKEN_USAGE_BUCKETS,
            "Input and output tokens per request.",
        )
        self.queue = hist(
            "queue",
            M.LLM_SERVER_REQUEST_QUEUE_TIME,
            M.LLM_SERVER_REQUEST_QUEUE_TIME_UNIT,
            M.LLM_SERVER_REQUEST_QUEUE_TIME_BUCKETS,
            "Seconds requests waited in the scheduler queue.",
        )
        self.itl = hist(
            "itl",
            M.LLM_SERVER_INTER_TOKEN_LATENCY,
            M.LLM_SERVER_INTER_TOKEN_LATENCY_UNIT,
            M.LLM_SERVER_INTER_TOKEN_LATENCY_BUCKETS,
            "Seconds between token-producing engine steps of a request, per token.",
        )
        self.token_rate = hist(
            "token_rate",
            M.LLM_SERVER_OUTPUT_TOKEN_RATE,
            M.LLM_SERVER_OUTPUT_TOKEN_RATE_UNIT,
            M.LLM_SERVER_OUTPUT_TOKEN_RATE_BUCKETS,
            "Output tokens per second of request duration.",
        )
        self.requests: Counter | MetricInstrument = (
            outlet.instrument("requests")
            if outlet is not None
            else meter.create_counter(
                M.LLM_SERVER_REQUESTS,
                unit=M.LLM_SERVER_REQUESTS_UNIT,
                description="Finished and rejected requests by finish reason and error.type.",
            )
        )
        self._error_types: set[str] = set()
        self._attr_sets: dict[tuple[Any, ...], AttributeSets] = {}  # see _attribute_sets
        self._error_lock = threading.Lock()
        self._warned_error_types = False

    def error_type(self, value: str) -> str:
        """``value`` if it is one of the first :data:`MAX_ERROR_TYPES` seen, else ``_OTHER``."""
        if value in self._error_types:
            return value
        with self._error_lock:
            if len(self._error_types) < MAX_ERROR_TYPES:
                self._error_types.add(value)
                return value
            if not self._warned_error_types:
                self._warned_error_types = True
                logger.warning(
                    "llm-otel: more than %d distinct error.type values; further ones are recorded as %s",
                    MAX_ERROR_TYPES,
                    OTHER,
                )
        return OTHER

    def record(self, rec: RequestRecord, duration_s: float) -> None:
        """Record one finished request; ``duration_s`` is arrival -> finish in seconds.

        Observations carry the request span's context when it is sampled (exemplars). With a
        metrics outlet (:class:`~llm_otel.telemetry.outlets.MetricsOutlet`, e.g. the exporter
        process records them) the request's observations go there as one record
        (:meth:`observations`) with the request span's context, and :meth:`apply` records them there."""
        obs = self.observations(rec, duration_s)
        sink = self.sink
        span = rec.span  # not None when recording
        if sink is not None:
            sink(obs, span.get_span_context() if rec.recording and span is not None else None)
        else:
            self.apply(obs, trace.set_span_in_context(span) if rec.recording and span is not None else NO_TRACE)

    def observations(self, rec: RequestRecord, duration_s: float) -> Observations:
        """One finished request's GenAI observations as one compact tuple of plain values (what
        :meth:`apply` records; pickles cheaply for the exporter process)::

            (attribute sets, whole, duration s, TTFT s or None, TPOT s or None, ITL gaps (s, a list),
             output token rate or None, queue s or None, input tokens, output tokens, error.type or None)

        ``attribute sets`` are :meth:`_attribute_sets`' four dicts (shared, never mutated);
        ``whole``: the request-level observations (duration, count, input tokens) are recorded
        (False for a choice of an ``n > 1`` request that is not the last to finish); the ITL gaps
        are the sampled ones (:meth:`_itl_gaps`); ``error.type`` is already capped
        (:meth:`error_type`). Advances the request's :class:`ChoiceGroup` and the ITL sampler:
        call once per finished request."""
        sets = self._attribute_sets(rec)
        # n > 1: the request is one request with one prompt - counted once, by its last choice
        whole = rec.choice_group is None or rec.choice_group.finish_one()
        if rec.error_type is None:
            ttft = rec.time_to_first_token_s()
            tpot = rec.time_per_output_token_s()
            out = rec.num_output_tokens
            return (
                sets,
                whole,
                duration_s,
                None if ttft is None else max(0.0, ttft),
                None if tpot is None else max(0.0, tpot),
                self._itl_gaps(rec),
                out / duration_s if out and duration_s > 0 else None,
                rec.queue_time_s(),
                rec.input_tokens,
                None if rec.pooling else out,
                None,
            )
        return (
            sets,
            whole,
            duration_s,
            None,
            None,
            (),
            None,
            rec.queue_time_s(),
            rec.input_tokens,
            None if rec.pooling else rec.num_output_tokens,
            self.error_type(rec.error_type),
        )

    def apply(self, obs: Observations, ctx: Context) -> None:
        """Record one request's :meth:`observations` with ``ctx`` (the request span's context for
        exemplars, or :data:`NO_TRACE`): the same instruments, values, attributes and order in the
        serving process and in the exporter process. Token counts never carry the exemplar; of
        the ITL gaps only the largest does (the bucket's exemplar then leads to a request that
        stalled there)."""
        (
            (attrs, count_attrs, input_attrs, output_attrs),
            whole,
            duration_s,
            ttft,
            tpot,
            gaps,
            token_rate,
            queue,
            input_tokens,
            output_tokens,
            error_type,
        ) = obs
        if error_type is None:
            if whole:
                self.duration.record(duration_s, attrs, ctx)
            if ttft is not None:
                self.ttft.record(ttft, attrs, ctx)
            if tpot is not None:
                self.tpot.record(tpot, attrs, ctx)
            if gaps:
                worst = max(range(len(gaps)), key=gaps.__getitem__)
                record = self.itl.record
                for i, gap in enumerate(gaps):
                    record(gap, attrs, ctx if i == worst else NO_TRACE)
            if token_rate is not None:
                self.token_rate.record(token_rate, attrs, ctx)
        else:
            if whole:
                self.duration.record(duration_s, {**attrs, A.ERROR_TYPE: error_type}, ctx)
            count_attrs = {**count_attrs, A.ERROR_TYPE: error_type}
        if whole:
            self.requests.add(1, count_attrs, ctx)
        if queue is not None:
            self.queue.record(queue, attrs, ctx)
        if whole:
            self.tokens.record(input_tokens, input_attrs, NO_TRACE)
        if output_tokens is not None:  # None: a pooling request, which has no output tokens
            self.tokens.record(output_tokens, output_attrs, NO_TRACE)

    @staticmethod
    def points(obs: Observations) -> int:
        """How many metric points :meth:`apply` records for ``obs`` (for drop counts)."""
        whole = obs[1]
        if obs[10] is not None:
            return 3 * whole + (obs[7] is not None) + (obs[9] is not None)
        return (
            3 * whole
            + (obs[3] is not None)
            + (obs[4] is not None)
            + len(obs[5])
            + (obs[6] is not None)
            + (obs[7] is not None)
            + (obs[9] is not None)
        )

    def _attribute_sets(self, rec: RequestRecord) -> AttributeSets:
        """(request attributes, ``llm.server.requests`` attributes without ``error.type``, input
        and output ``llm.server.token.usage`` attributes) of ``rec``: built once per distinct
        (operation, provider, model, response model, class labels, finish reason) and reused,
        never mutated (at most :data:`MAX_ATTRIBUTE_SETS` kept; the cache restarts when full)."""
        labels = rec.metric_attributes  # request class and tier labels, bounded by llm_otel.signals
        key: tuple[Any, ...] | None  # None: not cached
        key = (
            rec.operation,
            rec.provider,
            rec.model,
            rec.response_model,
            rec.finish_reason,
            tuple(labels.items()) if labels else (),
        )
        try:
            sets = self._attr_sets.get(key)
        except TypeError:  # an unhashable label value: built for this request alone
            key, sets = None, None
        if sets is not None:
            return sets
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: rec.operation,
            A.GEN_AI_PROVIDER_NAME: rec.provider,
            A.GEN_AI_REQUEST_MODEL: rec.model,
            A.GEN_AI_RESPONSE_MODEL: rec.response_model,
        }
        if labels:
            attrs.update(labels)
        count_attrs = {k: v for k, v in attrs.items() if k != A.GEN_AI_RESPONSE_MODEL}
        token_attrs = dict(count_attrs)
        if rec.finish_reason is not None:
            count_attrs[A.LLM_RESPONSE_FINISH_REASON] = rec.finish_reason
        sets = (
            attrs,
            count_attrs,
            {**token_attrs, A.GEN_AI_TOKEN_TYPE: "input"},
            {**token_attrs, A.GEN_AI_TOKEN_TYPE: "output"},
        )
        if key is not None:
            if len(self._attr_sets) >= MAX_ATTRIBUTE_SETS:
                self._attr_sets.clear()
            self._attr_sets[key] = sets
        return sets

    def _itl_gaps(self, rec: RequestRecord) -> list[float] | tuple[()]:
        """The sampled ITL observations (s per token) of the token-producing steps after the
        first: every ``itl_every``-th gap from a random offset in ``[0, itl_every)``; one SDK
        ``record`` per kept gap is the cost of this metric (docs/operations.md)."""
        times = rec.step_times
        n = len(times)
        every = self.itl_every
        start = 1 + (self._rng.randrange(every) if every > 1 else 0)
        if n <= start:
            return ()
        counts = rec.step_token_counts
        return [max(0.0, times[i] - times[i - 1]) / max(1, counts[i]) for i in range(start, n, every)]

    def record_rejected(self, attrs: dict[str, Any], duration_s: float, ctx: Context | None = None) -> None:
        """A request the engine refused: ``attrs`` are operation, provider, model and ``error.type``;
        ``ctx`` the context of its (sampled) error span, for the exemplar."""
        attrs = {**attrs, A.ERROR_TYPE: self.error_type(str(attrs.get(A.ERROR_TYPE, OTHER)))}
        ctx = ctx if ctx is not None else NO_TRACE
        self.duration.record(duration_s, attrs, ctx)
        self.requests.add(1, attrs, ctx)

    def observe_sampling(self, tracer_provider: object) -> bool:
        """Register ``llm_otel.sampling.probability`` for ``tracer_provider``'s sampler; returns
        False (no gauge: absent, not zero) when the sampler's probability is unknown."""
        read = sampling_probability_reader(getattr(tracer_provider, "sampler", None))
        if read is None:
            return False

        def observe(_options: CallbackOptions) -> list[Observation]:
            try:
                return [Observation(read())]
            except Exception as exc:  # noqa: BLE001 - a sampler that cannot say: no point this time
                process_errors().report(
                    "telemetry.metrics.sampling_probability",
                    exc,
                    "the sampler's probability cannot be read; no gauge point",
                )
                return []

        self.meter.create_observable_gauge(
            M.LLM_OTEL_SAMPLING_PROBABILITY,
            callbacks=[observe],
            unit=M.LLM_OTEL_SAMPLING_PROBABILITY_UNIT,
            description="Head-sampling probability of new traces now.",
        )
        return True


def sampling_probability_reader(sampler: object) -> Callable[[], float] | None:
    """A zero-argument callable returning the probability (0-1) that ``sampler`` keeps a new root
    trace, or None when it cannot be known: llm-otel's adaptive sampler (current probability),
    ``TraceIdRatioBased`` (its rate), ``ParentBased`` (its root), ``ALWAYS_ON``/``ALWAYS_OFF``."""
    from opentelemetry.sdk.trace import sampling

    root = getattr(sampler, "root", None)
    if root is not None and hasattr(root, "current_probability"):
        current: Callable[[], float] = root.current_probability  # AdaptiveRootSampler.current_probability
        return current
    if isinstance(sampler, sampling.ParentBased):
        sampler = getattr(sampler, "_root", None)
    if isinstance(sampler, sampling.TraceIdRatioBased):
        rate = float(sampler.rate)
        return lambda: rate
    if isinstance(sampler, sampling.StaticSampler):
        kept = sampler._decision is not sampling.Decision.DROP  # noqa: SLF001 - no public accessor
        return (lambda: 1.0) if kept else (lambda: 0.0)
    return None


class BoundedValues:
    """A metric dimension whose values are chosen at run time (LoRA adapters loaded while serving,
    the models an application calls): the first ``limit`` distinct values keep their own series,
    later ones are recorded as ``_OTHER``, with one warning (``what``: the values' name in it, "LoRA
    adapters served"). Safe from several threads (a seen value costs one set lookup)."""

    OTHER = "_OTHER"

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self._seen: set[str] = set()
        self._warned = False
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        """``value`` if it is one of the first ``limit`` seen here, else ``_OTHER``."""
        seen = self._seen
        if value in seen:
            return value
        with self._lock:
            if value in seen or len(seen) < self.limit:
                seen.add(value)
                return value
            first, self._warned = not self._warned, True
        if first:
            logging.getLogger("llm_otel").warning(
                "llm-otel: more than %d %s; metrics of further ones are recorded as model _OTHER "
                "(spans keep their names)",
                self.limit,
                self.what,
            )
        return self.OTHER
