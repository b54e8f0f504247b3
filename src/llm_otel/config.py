"""One frozen settings object, read once from the ``OTEL_*`` / ``LLM_OTEL_*`` environment.

Every knob of llm-otel is listed in :class:`Settings` with its variable and default; the README's
configuration table mirrors it. Invalid values raise :class:`ConfigError` naming the variable, at
``instrument()`` time - never later on the engine's hot path.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from llm_otel.signals.config import SignalsConfig

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A configuration variable holds a value llm-otel cannot use. The message names the variable."""


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
            TTFT / end-to-end seconds exceed these (with llm-otel's adaptive sampler).
        adaptive_sampling: ``LLM_OTEL_ADAPTIVE_SAMPLING`` (auto). Providers llm-otel creates use the
            adaptive sampler (``auto`` and ``on``; never with ``off``), following NVML GPU
            utilisation, or engine occupancy (:class:`llm_otel.sampling.EngineOccupancy`) where NVML
            sees no GPU; ``OTEL_TRACES_SAMPLER``, when set, wins.
        traces_per_s: ``LLM_OTEL_TRACES_PER_S`` (10). Budget of the adaptive sampler in kept root
            traces per second and process (:class:`llm_otel.sampling.TraceBudget`): the root
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
        signals: the serving-signal settings (:class:`llm_otel.signals.config.SignalsConfig`:
            request classes, tier table, VRAM pressure, health score; variables and defaults in
            :mod:`llm_otel.signals`), read by :func:`signals_settings`.
        console: ``LLM_OTEL_CONSOLE`` (auto). ``tree`` / ``json`` / ``off``: console output used when
            no ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set; ``auto`` = ``tree``.
    """

    capture_content: bool = False
    content_max_chars: int = 4096
    token_events: int = 4
    itl_sample_every: int = 16
    step_spans_per_s: float = 10.0
    max_stall_events: int = 16
    stall_factor: float = 4.0
    logprobs_top_k: int = 5
    logit_dist_ratio: float = 0.05
    logit_events: int = 8
    vllm_worker_logits: bool = True
    outlier_ttft_s: float | None = None
    outlier_e2e_s: float | None = None
    adaptive_sampling: str = "auto"
    traces_per_s: float = 10.0
    vllm_engine_events: bool = True
    console: str = "auto"
    gpu_steps: str = "auto"
    gpu_ring_capacity: int = 4096
    nvtx: bool = True
    flush_deadline_s: float = 2.0
    otlp_max_request_bytes: int = 3 * 1024 * 1024
    export_process: bool = True
    export_process_buffer: int = 8192
    signals: "SignalsConfig" = dataclasses.field(default_factory=lambda: _default_signals())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Read and validate the environment. Raises ConfigError on an invalid value."""
        env = os.environ if env is None else env
        return cls(
            capture_content=_capture(env),
            content_max_chars=_int(env, "LLM_OTEL_CONTENT_MAX_CHARS", 4096, lo=1),
            token_events=_int(env, "LLM_OTEL_TOKEN_EVENTS", 4, lo=0, hi=10_000),
            itl_sample_every=_int(env, "LLM_OTEL_ITL_SAMPLE_EVERY", 16, lo=1, hi=1 << 20),
            step_spans_per_s=_float(env, "LLM_OTEL_STEP_SPANS_PER_S", 10.0, lo=0.0),
            max_stall_events=_int(env, "LLM_OTEL_MAX_STALL_EVENTS", 16, lo=0, hi=10_000),
            stall_factor=_float(env, "LLM_OTEL_STALL_FACTOR", 4.0, lo=1.0),
            logprobs_top_k=_int(env, "LLM_OTEL_LOGPROBS_TOP_K", 5, lo=0, hi=20),
            logit_dist_ratio=_float(env, "LLM_OTEL_LOGIT_DIST_RATIO", 0.05, lo=0.0, hi=1.0),
            logit_events=_int(env, "LLM_OTEL_LOGIT_EVENTS", 8, lo=0, hi=10_000),
            vllm_engine_events=_bool(env, "LLM_OTEL_VLLM_ENGINE_EVENTS", True),
            vllm_worker_logits=_bool(env, "LLM_OTEL_VLLM_WORKER_LOGITS", True),
            outlier_ttft_s=_optional_float(env, "LLM_OTEL_OUTLIER_TTFT_S"),
            outlier_e2e_s=_optional_float(env, "LLM_OTEL_OUTLIER_E2E_S"),
            adaptive_sampling=_choice(env, "LLM_OTEL_ADAPTIVE_SAMPLING", "auto", {"auto", "on", "off"}),
            traces_per_s=traces_per_s(env),
            console=_choice(env, "LLM_OTEL_CONSOLE", "auto", {"auto", "tree", "json", "off"}),
            gpu_steps=_choice(env, "LLM_OTEL_GPU_STEPS", "auto", {"auto", "cupy", "numpy", "off"}),
            gpu_ring_capacity=_int(env, "LLM_OTEL_GPU_RING_CAPACITY", 4096, lo=16, hi=1 << 24),
            nvtx=_bool(env, "LLM_OTEL_NVTX", True),
            flush_deadline_s=_float(env, "LLM_OTEL_FLUSH_DEADLINE_S", 2.0, lo=0.0, hi=300.0),
            otlp_max_request_bytes=otlp_max_request_bytes(env),
            export_process=_bool(env, "LLM_OTEL_EXPORT_PROCESS", True),
            export_process_buffer=_int(env, "LLM_OTEL_EXPORT_PROCESS_BUFFER", 8192, lo=1, hi=1 << 24),
            signals=signals_settings(env),
        )


def _default_signals():
    from llm_otel.signals.config import SignalsConfig  # (llm_otel.signals imports this module)

    return SignalsConfig()


def _capture(env: Mapping[str, str]) -> bool:
    name = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
    raw = env.get(name, "").strip()
    if raw.upper() in {"SPAN_ONLY", "SPAN_AND_EVENT"}:
        return True
    if raw.upper() in {"NO_CONTENT", "EVENT_ONLY"}:
        return False
    return _bool(env, name, False)


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected true or false")


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{name}={raw!r}: expected an integer in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float | None = None) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None
    if not value >= lo or (hi is not None and not value <= hi):
        raise ConfigError(f"{name}={raw!r}: expected a number in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def _optional_float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return _float(env, name, 0.0, lo=0.0)


def _choice(env: Mapping[str, str], name: str, default: str | None, choices: set[str]) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r}: expected one of {sorted(choices)}")
    return value


EXPORTERS = {"TRACES": ("otlp", "console", "none"), "METRICS": ("otlp", "prometheus", "console", "none")}
OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def exporter_setting(env: Mapping[str, str], signal: str) -> str:
    """``OTEL_<signal>_EXPORTER`` (``signal``: ``TRACES``/``METRICS``): ``otlp`` when unset, else
    one of :data:`EXPORTERS`. A comma list (the OpenTelemetry form) is accepted when it names one
    exporter (``otlp,`` or ``otlp,otlp``): llm-otel configures one per signal.

    Raises ConfigError naming the variable and the accepted values for any other value."""
    name = f"OTEL_{signal}_EXPORTER"
    raw = env.get(name)
    accepted = EXPORTERS[signal]
    names = {part.strip().lower() for part in (raw or "").split(",")} - {""}
    if not names:
        return "otlp"
    unknown = sorted(names - set(accepted))
    if unknown:
        raise ConfigError(f"{name}={raw!r}: unknown exporter {', '.join(unknown)}; "
                          f"expected one of {', '.join(accepted)}")
    if len(names) > 1:
        raise ConfigError(f"{name}={raw!r}: llm-otel configures one exporter per signal; "
                          f"expected one of {', '.join(accepted)}")
    return names.pop()


def otlp_protocol(env: Mapping[str, str], signal: str) -> str:
    """The OTLP protocol for ``signal``: ``OTEL_EXPORTER_OTLP_<signal>_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc`` (the Python SDK's default).

    Raises ConfigError for a value other than ``grpc`` / ``http/protobuf`` in either variable,
    whether or not an endpoint is set."""
    general = _choice(env, "OTEL_EXPORTER_OTLP_PROTOCOL", None, set(OTLP_PROTOCOLS))
    specific = _choice(env, f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", None, set(OTLP_PROTOCOLS))
    return specific or general or "grpc"


def validate_exporter_env(env: Mapping[str, str]) -> None:
    """Check the exporter variables llm-otel reads when it builds providers itself:
    ``OTEL_{TRACES,METRICS}_EXPORTER`` and ``OTEL_EXPORTER_OTLP{,_TRACES,_METRICS}_PROTOCOL``.
    Raises ConfigError naming the first invalid variable."""
    for signal in ("TRACES", "METRICS"):
        exporter_setting(env, signal)
        otlp_protocol(env, signal)


# --- serving signals (llm_otel.signals) -------------------------------------------------------
def signals_settings(env: Mapping[str, str] | None = None):
    """The serving-signal settings (:class:`llm_otel.signals.config.SignalsConfig`) from ``env``
    (``os.environ``): request classes, tier table, VRAM pressure, health score. Variables and
    defaults: :mod:`llm_otel.signals`. Raises ConfigError naming the variable (or the tier table
    line)."""
    from llm_otel.signals.classes import _VALID, parse_class_sources
    from llm_otel.signals.config import SignalsConfig

    env = os.environ if env is None else env
    warn = _float(env, "LLM_OTEL_VRAM_WARN", 0.80, lo=0.01, hi=1.0)
    critical = _float(env, "LLM_OTEL_VRAM_CRITICAL", 0.90, lo=0.01, hi=1.0)
    if warn > critical:
        raise ConfigError(f"LLM_OTEL_VRAM_WARN={warn} is above LLM_OTEL_VRAM_CRITICAL={critical}")
    revision = (env.get("LLM_OTEL_MODEL_REVISION") or "").strip() or None
    if revision is not None:
        if len(revision) > 64 or not _VALID.fullmatch(revision):
            raise ConfigError(f"LLM_OTEL_MODEL_REVISION={revision!r}: 1-64 of A-Z a-z 0-9 . _ : / @ + -")
    port_raw = (env.get("LLM_OTEL_HEALTH_PORT") or "").strip()
    return SignalsConfig(
        class_sources=parse_class_sources(env.get("LLM_OTEL_CLASS_HEADERS")),
        class_max_values=_int(env, "LLM_OTEL_CLASS_MAX_VALUES", 20, lo=1, hi=10_000),
        class_max_len=_int(env, "LLM_OTEL_CLASS_MAX_LEN", 64, lo=1, hi=1024),
        tiers=tier_table(env),
        model_revision=revision,
        vram_warn=warn,
        vram_warn_hold_s=_float(env, "LLM_OTEL_VRAM_WARN_HOLD_S", 30.0, lo=0.0),
        vram_critical=critical,
        vram_critical_hold_s=_float(env, "LLM_OTEL_VRAM_CRITICAL_HOLD_S", 10.0, lo=0.0),
        vram_clear_margin=_float(env, "LLM_OTEL_VRAM_CLEAR_MARGIN", 0.05, lo=0.0, hi=0.5),
        vram_clear_hold_s=_float(env, "LLM_OTEL_VRAM_CLEAR_HOLD_S", 30.0, lo=0.0),
        vram_source=_choice(env, "LLM_OTEL_VRAM_SOURCE", "auto", {"auto", "nvml", "kv_cache"}),
        efficiency_window_s=_float(env, "LLM_OTEL_EFFICIENCY_WINDOW_S", 10.0, lo=0.1, hi=3600.0),
        health_weights=_health_weights(env.get("LLM_OTEL_HEALTH_WEIGHTS")),
        health_ttft_target_s=_float(env, "LLM_OTEL_HEALTH_TTFT_TARGET_S", 1.0, lo=1e-6),
        health_max_error_rate=_float(env, "LLM_OTEL_HEALTH_MAX_ERROR_RATE", 0.05, lo=1e-6, hi=1.0),
        health_gpu_knee=_float(env, "LLM_OTEL_HEALTH_GPU_KNEE", 0.85, lo=0.0, hi=0.999),
        health_warmup_s=_float(env, "LLM_OTEL_HEALTH_WARMUP_S", 60.0, lo=0.0),
        health_window_s=_float(env, "LLM_OTEL_HEALTH_WINDOW_S", 300.0, lo=1.0),
        health_port=_int(env, "LLM_OTEL_HEALTH_PORT", 0, lo=0, hi=65535) if port_raw else None,
        health_host=(env.get("LLM_OTEL_HEALTH_HOST") or "127.0.0.1").strip(),
        health_min_score=_float(env, "LLM_OTEL_HEALTH_MIN_SCORE", 0.5, lo=0.0, hi=1.0),
        exporter_endpoint=_health_exporter_endpoint(env),
    )


def _health_weights(raw: str | None) -> dict[str, float]:
    from llm_otel.signals.health import DEFAULT_WEIGHTS, FACTORS

    name = "LLM_OTEL_HEALTH_WEIGHTS"
    if raw is None or not raw.strip():
        return dict(DEFAULT_WEIGHTS)
    out = {f: 0.0 for f in FACTORS}
    for entry in raw.split(","):
        key, sep, value = entry.strip().partition("=")
        if not sep or key not in FACTORS:
            raise ConfigError(f"{name}={raw!r}: entry {entry.strip()!r}: expected factor=weight, factor one of "
                              f"{list(FACTORS)}")
        try:
            weight = float(value)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: weight {value!r} is not a number") from None
        if not weight >= 0:
            raise ConfigError(f"{name}={raw!r}: weights must be >= 0")
        out[key] = weight
    if sum(out.values()) <= 0:
        raise ConfigError(f"{name}={raw!r}: at least one weight must be > 0")
    return out


def _health_exporter_endpoint(env: Mapping[str, str]) -> str | None:
    """The OTLP traces endpoint the health score probes, or None when spans do not go over OTLP
    (an invalid exporter variable is reported by ``instrument()``/``doctor``, not here)."""
    try:
        if exporter_setting(env, "TRACES") != "otlp":
            return None
    except ConfigError:
        return None
    return otlp_endpoint(env, "TRACES")


def tier_table(env: Mapping[str, str] | None = None):
    """The :class:`llm_otel.signals.tiers.TierTable` ``LLM_OTEL_TIERS_FILE`` or ``LLM_OTEL_TIERS``
    defines, None when neither is set. Raises ConfigError for both set, an unreadable file or a
    bad line."""
    from llm_otel.signals.tiers import TierTable

    env = os.environ if env is None else env
    path = (env.get("LLM_OTEL_TIERS_FILE") or "").strip()
    inline = (env.get("LLM_OTEL_TIERS") or "").strip()
    if path and inline:
        raise ConfigError("LLM_OTEL_TIERS and LLM_OTEL_TIERS_FILE are both set; use one")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"LLM_OTEL_TIERS_FILE={path!r}: cannot read it ({exc})") from None
        return TierTable.parse(text, f"LLM_OTEL_TIERS_FILE {path}")
    if inline:
        return TierTable.parse(inline, "LLM_OTEL_TIERS", separator=";")
    return None


# --- exporters (llm_otel.export) ---------------------------------------------------------------
def otlp_endpoint(env: Mapping[str, str], signal: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_<signal>_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``, else None."""
    return env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def signal_endpoint(env: Mapping[str, str], signal: str, proto: str) -> str:
    """The endpoint as the OTLP exporter specification derives it: the signal's own variable as
    given, else the general one (gRPC) or the general one plus ``/v1/traces`` / ``/v1/metrics``
    (HTTP). KeyError when neither is set (check :func:`otlp_endpoint` first)."""
    specific = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    if specific:
        return specific
    base = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if proto == "grpc":
        return base
    return base.rstrip("/") + ("/v1/traces" if signal == "TRACES" else "/v1/metrics")


def traces_sampler(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(OTEL_TRACES_SAMPLER lower-cased or None, OTEL_TRACES_SAMPLER_ARG or None)``."""
    name = (env.get("OTEL_TRACES_SAMPLER") or "").strip().lower() or None
    return name, env.get("OTEL_TRACES_SAMPLER_ARG")


def traces_per_s(env: Mapping[str, str] | None = None) -> float:
    """``LLM_OTEL_TRACES_PER_S`` alone (the SDK configurator's sampler factory needs only it)."""
    return _float(os.environ if env is None else env, "LLM_OTEL_TRACES_PER_S", 10.0, lo=0.0)


def otlp_max_request_bytes(env: Mapping[str, str]) -> int:
    """``LLM_OTEL_OTLP_MAX_REQUEST_BYTES`` (3 MiB), in [64 KiB, 1 GiB]."""
    return _int(env, "LLM_OTEL_OTLP_MAX_REQUEST_BYTES", 3 * 1024 * 1024, lo=64 * 1024, hi=1 << 30)


PROMETHEUS_PORT = 9464  # OpenTelemetry's default for OTEL_EXPORTER_PROMETHEUS_PORT
PROMETHEUS_HOST = "localhost"


def prometheus_base_port(env: Mapping[str, str]) -> int:
    """``OTEL_EXPORTER_PROMETHEUS_PORT`` (9464), the port of the first frontend. Raises
    ConfigError for anything but a port number in [1, 65534]."""
    raw = (env.get("OTEL_EXPORTER_PROMETHEUS_PORT") or "").strip()
    try:
        base = int(raw) if raw else PROMETHEUS_PORT
    except ValueError:
        raise ConfigError(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r}: expected a port number") from None
    if not 0 < base < 65535:
        raise ConfigError(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r}: expected a port number in [1, 65534]")
    return base


def prometheus_host(env: Mapping[str, str]) -> str:
    """``OTEL_EXPORTER_PROMETHEUS_HOST`` (``localhost``)."""
    return (env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or PROMETHEUS_HOST).strip()
