"""GenAI server metrics, recorded for every finished request - sampled or not."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M
from llm_otel.telemetry.record import RequestRecord


class Instruments:
    """The histograms llm-otel records, created once per meter with the GenAI bucket advisories.

    * ``gen_ai.server.time_to_first_token`` (s): arrival -> first token, successful requests.
    * ``gen_ai.server.time_per_output_token`` (s): (last - first token) / (tokens - 1), successful
      requests with at least 2 output tokens.
    * ``gen_ai.server.request.duration`` (s): arrival -> finish, every request; ``error.type`` on failures.
    * ``llm.server.token.usage`` ({token}): input and output tokens (``gen_ai.token.type``).
    * ``llm.server.request.queue_time`` (s): scheduler queue wait, when the engine reports it.
    """

    def __init__(self, meter: Meter) -> None:
        def hist(name: str, unit: str, buckets: tuple[float, ...], description: str):
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(buckets))

        self.ttft = hist(M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN_UNIT,
                         M.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN_BUCKETS, "Time to generate first token for successful responses.")
        self.tpot = hist(M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN_UNIT,
                         M.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN_BUCKETS, "Time per output token generated after the first token for successful responses.")
        self.duration = hist(M.GEN_AI_SERVER_REQUEST_DURATION, M.GEN_AI_SERVER_REQUEST_DURATION_UNIT,
                             M.GEN_AI_SERVER_REQUEST_DURATION_BUCKETS, "Generative AI server request duration.")
        self.tokens = hist(M.LLM_SERVER_TOKEN_USAGE, M.LLM_SERVER_TOKEN_USAGE_UNIT,
                           M.LLM_SERVER_TOKEN_USAGE_BUCKETS, "Input and output tokens per request.")
        self.queue = hist(M.LLM_SERVER_REQUEST_QUEUE_TIME, M.LLM_SERVER_REQUEST_QUEUE_TIME_UNIT,
                          M.LLM_SERVER_REQUEST_QUEUE_TIME_BUCKETS, "Seconds requests waited in the scheduler queue.")

    def record(self, rec: RequestRecord, duration_s: float) -> None:
        """Record one finished request; ``duration_s`` is arrival -> finish in seconds."""
        attrs = {
            A.GEN_AI_OPERATION_NAME: rec.operation,
            A.GEN_AI_PROVIDER_NAME: rec.provider,
            A.GEN_AI_REQUEST_MODEL: rec.model,
            A.GEN_AI_RESPONSE_MODEL: rec.response_model,
        }
        if rec.metric_attributes:  # request class and tier labels, bounded by llm_otel.signals
            attrs.update(rec.metric_attributes)
        ok = rec.error_type is None
        if ok:
            self.duration.record(duration_s, attrs)
            ttft = rec.time_to_first_token_s()
            if ttft is not None:
                self.ttft.record(max(0.0, ttft), attrs)
            tpot = rec.time_per_output_token_s()
            if tpot is not None:
                self.tpot.record(max(0.0, tpot), attrs)
        else:
            self.duration.record(duration_s, {**attrs, A.ERROR_TYPE: rec.error_type})
        queue = rec.queue_time_s()
        if queue is not None:
            self.queue.record(queue, attrs)
        token_attrs = {k: v for k, v in attrs.items() if k != A.GEN_AI_RESPONSE_MODEL}
        self.tokens.record(rec.input_tokens, {**token_attrs, A.GEN_AI_TOKEN_TYPE: "input"})
        self.tokens.record(rec.num_output_tokens, {**token_attrs, A.GEN_AI_TOKEN_TYPE: "output"})
