"""One frozen settings object, read once from the ``OTEL_*`` / ``LLM_OTEL_*`` environment.

Every knob of llm-otel is a field of :class:`Settings` (the serving signals' in
:class:`~llm_otel.config.signals.SignalsConfig`) declaring its variable, parser and its one
default; the README's configuration table mirrors them (``tests/test_config_docs.py`` checks it).
Invalid values raise :class:`ConfigError` naming the variable, at ``instrument()`` time - never
later on the engine's hot path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import cast

from llm_otel.config.parse import (
    read_bool,
    read_choice,
    read_field,
    read_fields,
    read_float,
    read_int,
    read_optional_float,
    setting,
)
from llm_otel.config.signals import SignalsConfig, signals_settings

__all__ = ["Settings", "traces_per_s", "otlp_max_request_bytes"]


def _read_capture(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``: a boolean or the GenAI content modes
    (``SPAN_ONLY``/``SPAN_AND_EVENT`` capture, ``NO_CONTENT``/``EVENT_ONLY`` do not)."""
    raw = env.get(name, "").strip()
    if raw.upper() in {"SPAN_ONLY", "SPAN_AND_EVENT"}:
        return True
    if raw.upper() in {"NO_CONTENT", "EVENT_ONLY"}:
        return False
    return read_bool(env, name, default)


@dataclasses.dataclass(frozen=True)
class Settings:
    """llm-otel configuration.

    Attributes (environment variable, default):
        capture_content: ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (false). Prompt and
            completion text go on spans only when true (or ``SPAN_ONLY``/``SPAN_AND_EVENT``).
        content_max_chars: ``LLM_OTEL_CONTENT_MAX_CHARS`` (4096). Captured text is truncated to this.
        token_events: ``LLM_OTEL_TOKEN_EVENTS`` (4). ``llm.token`` events for the first N tokens
            (each costs about 20 us to build and export; stalls get their own events anyway).
        itl_sample_every: ``LLM_OTEL_ITL_SAMPLE_EVERY`` (16). ``llm.server.inter_token_latency``
            records one token gap in every N of each request (systematic sampling from a random
            offset, so each gap is kept with probability 1/N and quantiles stay unbiased; the
            histogram's count is 1/N of the gaps). 1 records every gap: one SDK ``Histogram.record``
            per token step (about 10 us each), which is most of what metrics cost per request.
        step_spans_per_s: ``LLM_OTEL_STEP_SPANS_PER_S`` (10). At most this many ``llm.engine.step``
            spans per second and engine core (a token bucket, burst of one second), for steps that
            serve a sampled request; 0 turns step spans off. Engine steps come every few
            milliseconds: a span for each costs more than the requests' own trees.
        max_stall_events: ``LLM_OTEL_MAX_STALL_EVENTS`` (16). Cap on ``llm.token.stall`` events per span.
        stall_factor: ``LLM_OTEL_STALL_FACTOR`` (4.0). A token is a stall when its inter-token
            latency exceeds this many times the request's median ITL.
        logprobs_top_k: ``LLM_OTEL_LOGPROBS_TOP_K`` (5). Top-k log-probs per step for ``llm.logit_dist``;
            0 disables the span. For sampled requests that did not ask for log-probs, the
            instrumentation asks the engine for k of them and strips them from the user's output.
        logit_dist_ratio: ``LLM_OTEL_LOGIT_DIST_RATIO`` (0.05). Fraction of sampled requests, chosen
            by trace id (the random low 56 bits, so every process of a trace chooses alike), that
            get ``llm.logit_dist`` without having asked for log-probs (requests that asked always
            get it); vLLM and LightLLM read it, the Triton client has no logit path. How 0.05 was
            derived (benchmarks/overhead.py offline, 5 rounds, 2026-12-01, configuration c = 100 %
            sampling + ratio 1 against g = 100 % sampling + ratio 0, CPU per 1,000 output tokens):
            a chosen 64-token request costs the engine processes 6.6 ms of CPU (the worker reduces
            its 2,048-wide logit row every step, about 0.1 ms a row) and the frontend 0.43 ms,
            i.e. +13 % of what the engine spends on that request (c read 946 vs g 842 engine CPU
            ms per 1k tokens; throughput 0.90-0.95 of g). Part of it is per step: a step with any
            chosen row pays about 0.17 ms for the reduction's dispatch at this vocabulary
            (``benchmarks/micro.py --only logits``: one row of 256, vocab 2,048; one row costs
            0.36 ms at 32k and 1.1 ms at 128k on one CPU thread), and on a GPU it waits for one
            small device-to-host copy; the rest grows with the chosen rows (ratio 0.1 and the
            default read within their runs' noise of g). So the default costs about
            ``0.13 x traced fraction x ratio`` of engine work: with the trace budget an offline
            256-prompt batch traces about 11 requests (0.13 x 0.045 x 0.05 = 0.03 %), and even a
            host below the budget, where every request is traced, pays 0.13 x 0.05 = 0.65 % -
            leaving defaults (b >= 0.99) and 100 % sampling (g >= 0.98) within issue 19's
            targets, while a process at its trace budget (10/s) still emits one ``llm.logit_dist``
            every 2 s (1,800 an hour). Measured with the new defaults (same benchmark, 5 rounds,
            a noisy shared machine): b (trace budget + 0.05) read 0.990 of uninstrumented (ratio of
            medians; 1.025 median paired), and g with 0.05 read 0.99 of g with 0 (noise ±10 %
            per round). 1 is configuration c: every step's statistics, about 13 %
            of engine CPU on this model (sampling dominates its step). With
            ``LLM_OTEL_VLLM_WORKER_LOGITS=false`` a chosen request makes vLLM compute log-probs for
            its whole batch (4.5 % throughput at ratio 0.1 in an earlier run): lower the ratio
            there. LightLLM's path was not measured on this machine (no LightLLM engine on CPU).
        vllm_worker_logits: ``LLM_OTEL_VLLM_WORKER_LOGITS`` (true). ``llm.logit_dist`` is computed
            by vLLM's worker from the full-vocabulary logits of the chosen requests' rows only
            (needs llm-otel in the worker process: ``instrument()`` arranges it through the
            ``vllm.general_plugins`` entry point). Off: from log-probs vLLM returns, as above.
        logit_events: ``LLM_OTEL_LOGIT_EVENTS`` (8). ``llm.logit.step`` events for the first N steps
            (the span's aggregates cover every step).
        vllm_engine_events: ``LLM_OTEL_VLLM_ENGINE_EVENTS`` (true). Ask vLLM's engine core to record
            per-request QUEUED/SCHEDULED/PREEMPTED timestamps even when the frontend runs with
            ``disable_log_stats=True`` (the offline default), so queue and prefill are separable.
        outlier_ttft_s / outlier_e2e_s: ``LLM_OTEL_OUTLIER_TTFT_S`` / ``LLM_OTEL_OUTLIER_E2E_S``
            (unset). A request the head sampler dropped is still recorded, as its own root with a
            link to its trace and ``llm.sampling.reason=outlier``, when it ended in error or its
            TTFT / end-to-end seconds exceed these (with llm-otel's adaptive sampler), within a
            bound of their own: a token bucket at ``traces_per_s`` (capacity ``max(1, traces_per_s)``),
            apart from the root decisions' (none when ``traces_per_s`` is 0).
        adaptive_sampling: ``LLM_OTEL_ADAPTIVE_SAMPLING`` (auto). Providers llm-otel creates use the
            adaptive sampler (``auto`` and ``on``; never with ``off``), following NVML GPU
            utilisation, or engine occupancy (:class:`llm_otel.sampling.EngineOccupancy`) where NVML
            sees no GPU; ``OTEL_TRACES_SAMPLER``, when set, wins.
        traces_per_s: ``LLM_OTEL_TRACES_PER_S`` (10). Budget of the adaptive sampler in kept root
            traces per second and server (:class:`llm_otel.sampling.SharedTraceBudget`: the API
            servers of one ``vllm serve --api-server-count N`` share it; other processes keep their
            own :class:`llm_otel.sampling.TraceBudget`): the root
            probability is the lower of the utilisation policy's and the budget's, per decision, so
            a burst or an offline batch reaching an idle engine is not traced at 100 % (expected
            kept roots over any W seconds <= max(1, budget) + budget x W). The probability used is
            recorded in ``ot=th`` (adjusted counts stay unbiased) and a root it lowered carries
            ``llm.sampling.reason=budget``. Children of a sampled parent (a router that traced the
            request) are not subject to it. 0 (or ``inf``) = no budget, the policy alone decides;
            ``OTEL_TRACES_SAMPLER=always_on`` has none either. Why 10: with a traced request
            costing the frontend about 1.3 ms of CPU (docs/performance.md), 10 a second is about
            1.3 % of one core at any request rate, and 36,000 traces an hour per process is plenty
            to debug from.
        gpu_steps: ``LLM_OTEL_GPU_STEPS`` (auto). Device timing of engine steps (docs/gpu.md): a ring
            buffer written on the engine's CUDA stream (``cupy``), the host clock (``numpy``), the
            first that works (``auto``: CuPy with a GPU, else NumPy) or ``off``.
        gpu_ring_capacity: ``LLM_OTEL_GPU_RING_CAPACITY`` (4096). Ring slots (two per step);
            overflow overwrites the oldest and is counted in ``llm_otel.gpu.ring.overwritten``.
        nvtx: ``LLM_OTEL_NVTX`` (true). NVTX ranges carrying step/request span ids (domain
            ``llm_otel``), active only when an NVTX tool such as Nsight Systems is attached.
        flush_deadline_s: ``LLM_OTEL_FLUSH_DEADLINE_S`` (2.0). Seconds each process's final flush
            of traces and metrics may take on an orderly exit (SIGTERM of the API server, engine
            shutdown, interpreter exit), counted from when the process learned it is shutting
            down; what is not delivered by then is dropped with one warning
            (:mod:`llm_otel.process.lifecycle`). The vLLM frontend gives its engine processes this
            long, plus one second, to exit before vLLM kills them.
        otlp_max_request_bytes: ``LLM_OTEL_OTLP_MAX_REQUEST_BYTES`` (3145728, 3 MiB). Upper bound
            of one OTLP span export request from exporters llm-otel builds; larger batches are
            split and a larger span has its longest attributes shortened (captured messages stay
            valid JSON). Collectors reject gRPC requests over 4 MiB by default.
        export_process: ``LLM_OTEL_EXPORT_PROCESS`` (true). Spans of the process whose providers
            llm-otel builds (the vLLM frontend, an application) are exported over OTLP by a
            separate exporter process fed with compact records (:mod:`llm_otel.export.offload`);
            ``false``: the SDK's in-process batch span processor. Only with an OTLP span exporter;
            vLLM's engine-core and worker processes always export in process.
        export_process_buffer: ``LLM_OTEL_EXPORT_PROCESS_BUFFER`` (8192). Ended spans that may wait
            for the exporter process; beyond it new spans are dropped and counted in
            ``llm_otel.spans.dropped`` (``error.type=export_process_backlog``). Four times as many
            metric observations may wait (a finished request's record weighs the observations it
            may record); beyond that they are counted in ``llm_otel.metric_points.dropped``.
        signals: the serving-signal settings (:class:`llm_otel.config.signals.SignalsConfig`:
            request classes, tier table, VRAM pressure, health score; variables and defaults
            there), read by :func:`llm_otel.config.signals.signals_settings`.
        console: ``LLM_OTEL_CONSOLE`` (auto). ``tree`` / ``json`` / ``off``: console output used when
            no ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set; ``auto`` = ``tree``.
    """

    capture_content: bool = setting("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", False, _read_capture)
    content_max_chars: int = setting("LLM_OTEL_CONTENT_MAX_CHARS", 4096, read_int, lo=1)
    token_events: int = setting("LLM_OTEL_TOKEN_EVENTS", 4, read_int, lo=0, hi=10_000)
    itl_sample_every: int = setting("LLM_OTEL_ITL_SAMPLE_EVERY", 16, read_int, lo=1, hi=1 << 20)
    step_spans_per_s: float = setting("LLM_OTEL_STEP_SPANS_PER_S", 10.0, read_float, lo=0.0)
    max_stall_events: int = setting("LLM_OTEL_MAX_STALL_EVENTS", 16, read_int, lo=0, hi=10_000)
    stall_factor: float = setting("LLM_OTEL_STALL_FACTOR", 4.0, read_float, lo=1.0)
    logprobs_top_k: int = setting("LLM_OTEL_LOGPROBS_TOP_K", 5, read_int, lo=0, hi=20)
    logit_dist_ratio: float = setting("LLM_OTEL_LOGIT_DIST_RATIO", 0.05, read_float, lo=0.0, hi=1.0)
    logit_events: int = setting("LLM_OTEL_LOGIT_EVENTS", 8, read_int, lo=0, hi=10_000)
    vllm_worker_logits: bool = setting("LLM_OTEL_VLLM_WORKER_LOGITS", True, read_bool)
    outlier_ttft_s: float | None = setting("LLM_OTEL_OUTLIER_TTFT_S", None, read_optional_float)
    outlier_e2e_s: float | None = setting("LLM_OTEL_OUTLIER_E2E_S", None, read_optional_float)
    adaptive_sampling: str = setting(
        "LLM_OTEL_ADAPTIVE_SAMPLING", "auto", read_choice, choices=frozenset({"auto", "on", "off"})
    )
    traces_per_s: float = setting("LLM_OTEL_TRACES_PER_S", 10.0, read_float, lo=0.0)
    vllm_engine_events: bool = setting("LLM_OTEL_VLLM_ENGINE_EVENTS", True, read_bool)
    console: str = setting("LLM_OTEL_CONSOLE", "auto", read_choice, choices=frozenset({"auto", "tree", "json", "off"}))
    gpu_steps: str = setting(
        "LLM_OTEL_GPU_STEPS", "auto", read_choice, choices=frozenset({"auto", "cupy", "numpy", "off"})
    )
    gpu_ring_capacity: int = setting("LLM_OTEL_GPU_RING_CAPACITY", 4096, read_int, lo=16, hi=1 << 24)
    nvtx: bool = setting("LLM_OTEL_NVTX", True, read_bool)
    flush_deadline_s: float = setting("LLM_OTEL_FLUSH_DEADLINE_S", 2.0, read_float, lo=0.0, hi=300.0)
    otlp_max_request_bytes: int = setting(
        "LLM_OTEL_OTLP_MAX_REQUEST_BYTES", 3 * 1024 * 1024, read_int, lo=64 * 1024, hi=1 << 30
    )
    export_process: bool = setting("LLM_OTEL_EXPORT_PROCESS", True, read_bool)
    export_process_buffer: int = setting("LLM_OTEL_EXPORT_PROCESS_BUFFER", 8192, read_int, lo=1, hi=1 << 24)
    signals: SignalsConfig = dataclasses.field(default_factory=SignalsConfig)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and validate the environment. Raises ConfigError on an invalid value."""
        env = os.environ if env is None else env
        return cls(**read_fields(cls, env), signals=signals_settings(env))


def traces_per_s(env: Mapping[str, str] | None = None) -> float:
    """``LLM_OTEL_TRACES_PER_S`` alone (the SDK configurator's sampler factory needs only it)."""
    return cast(float, read_field(Settings, "traces_per_s", os.environ if env is None else env))  # read_float


def otlp_max_request_bytes(env: Mapping[str, str]) -> int:
    """``LLM_OTEL_OTLP_MAX_REQUEST_BYTES`` (3 MiB), in [64 KiB, 1 GiB]."""
    return cast(int, read_field(Settings, "otlp_max_request_bytes", env))  # read_int
