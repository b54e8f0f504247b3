"""The serving signals' settings (:class:`SignalsConfig`, ``Settings.signals``): request classes,
tier table, VRAM pressure, token efficiency and the health score, read from the environment by
:func:`signals_settings`. :mod:`llm_otel.signals` interprets them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from llm_otel.config.classes import CLASS_VALUE, read_class_sources
from llm_otel.config.exporters import exporter_setting, otlp_endpoint
from llm_otel.config.parse import (
    ConfigError,
    read_choice,
    read_fields,
    read_float,
    read_int,
    read_optional_int,
    read_str,
    setting,
)
from llm_otel.config.tiers import TIERS_VARIABLES, TierTable, tier_table

__all__ = ["SignalsConfig", "HEALTH_FACTORS", "signals_settings"]

#: the health score's factors (:mod:`llm_otel.signals.health`), the keys of ``LLM_OTEL_HEALTH_WEIGHTS``
HEALTH_FACTORS = ("latency", "errors", "gpu", "uptime")


def _read_revision(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    revision = (env.get(name) or "").strip() or default
    if revision is not None and (len(revision) > 64 or not CLASS_VALUE.fullmatch(revision)):
        raise ConfigError(f"{name}={revision!r}: 1-64 of A-Z a-z 0-9 . _ : / @ + -")
    return revision


def _read_health_weights(env: Mapping[str, str], name: str, default: Mapping[str, float]) -> dict[str, float]:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return dict(default)
    out = {f: 0.0 for f in HEALTH_FACTORS}
    for entry in raw.split(","):
        key, sep, value = entry.strip().partition("=")
        if not sep or key not in HEALTH_FACTORS:
            raise ConfigError(
                f"{name}={raw!r}: entry {entry.strip()!r}: expected factor=weight, factor one of {list(HEALTH_FACTORS)}"
            )
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


@dataclasses.dataclass(frozen=True)
class SignalsConfig:
    """Validated serving-signal settings; each field's default is the setting's one default.

    Attributes (environment variable, default; formulas and units: docs/signals.md):
        class_sources: ``LLM_OTEL_CLASS_HEADERS`` (unset). ``dimension:source`` pairs, see
            :mod:`llm_otel.signals.classes`.
        class_max_values: ``LLM_OTEL_CLASS_MAX_VALUES`` (20). Metric labels per dimension before ``other``.
        class_max_len: ``LLM_OTEL_CLASS_MAX_LEN`` (64). Longest accepted class value.
        tiers: ``LLM_OTEL_TIERS`` / ``LLM_OTEL_TIERS_FILE`` (unset). Tier table, see :mod:`llm_otel.config.tiers`.
        model_revision: ``LLM_OTEL_MODEL_REVISION`` (unset). Revision label (canary/stable) when no
            header gives one.
        vram_warn, vram_warn_hold_s: ``LLM_OTEL_VRAM_WARN`` (0.80), ``LLM_OTEL_VRAM_WARN_HOLD_S`` (30).
        vram_critical, vram_critical_hold_s: ``LLM_OTEL_VRAM_CRITICAL`` (0.90),
            ``LLM_OTEL_VRAM_CRITICAL_HOLD_S`` (10).
        vram_clear_margin, vram_clear_hold_s: ``LLM_OTEL_VRAM_CLEAR_MARGIN`` (0.05),
            ``LLM_OTEL_VRAM_CLEAR_HOLD_S`` (30).
        vram_source: ``LLM_OTEL_VRAM_SOURCE`` (auto). ``auto`` | ``nvml`` | ``kv_cache``.
        efficiency_window_s: ``LLM_OTEL_EFFICIENCY_WINDOW_S`` (10).
        health_weights: ``LLM_OTEL_HEALTH_WEIGHTS`` (latency=0.4,errors=0.3,gpu=0.2,uptime=0.1).
        health_ttft_target_s: ``LLM_OTEL_HEALTH_TTFT_TARGET_S`` (1.0).
        health_max_error_rate: ``LLM_OTEL_HEALTH_MAX_ERROR_RATE`` (0.05).
        health_gpu_knee: ``LLM_OTEL_HEALTH_GPU_KNEE`` (0.85).
        health_warmup_s: ``LLM_OTEL_HEALTH_WARMUP_S`` (60).
        health_window_s: ``LLM_OTEL_HEALTH_WINDOW_S`` (300).
        health_port: ``LLM_OTEL_HEALTH_PORT`` (unset: no endpoint).
        health_host: ``LLM_OTEL_HEALTH_HOST`` (127.0.0.1).
        health_min_score: ``LLM_OTEL_HEALTH_MIN_SCORE`` (0.5).
        tick_s: seconds between the signals thread's ticks (not a variable).
        exporter_endpoint: where spans go when they go over OTLP (``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``),
            for the health score's exporter-reachability factor; None when the traces exporter is not OTLP.
    """

    class_sources: Mapping[str, str] = setting("LLM_OTEL_CLASS_HEADERS", read=read_class_sources, default_factory=dict)
    class_max_values: int = setting("LLM_OTEL_CLASS_MAX_VALUES", 20, read_int, lo=1, hi=10_000)
    class_max_len: int = setting("LLM_OTEL_CLASS_MAX_LEN", 64, read_int, lo=1, hi=1024)
    tiers: TierTable | None = setting(TIERS_VARIABLES, None, tier_table)
    model_revision: str | None = setting("LLM_OTEL_MODEL_REVISION", None, _read_revision)
    vram_warn: float = setting("LLM_OTEL_VRAM_WARN", 0.80, read_float, lo=0.01, hi=1.0)
    vram_warn_hold_s: float = setting("LLM_OTEL_VRAM_WARN_HOLD_S", 30.0, read_float, lo=0.0)
    vram_critical: float = setting("LLM_OTEL_VRAM_CRITICAL", 0.90, read_float, lo=0.01, hi=1.0)
    vram_critical_hold_s: float = setting("LLM_OTEL_VRAM_CRITICAL_HOLD_S", 10.0, read_float, lo=0.0)
    vram_clear_margin: float = setting("LLM_OTEL_VRAM_CLEAR_MARGIN", 0.05, read_float, lo=0.0, hi=0.5)
    vram_clear_hold_s: float = setting("LLM_OTEL_VRAM_CLEAR_HOLD_S", 30.0, read_float, lo=0.0)
    vram_source: str = setting(
        "LLM_OTEL_VRAM_SOURCE", "auto", read_choice, choices=frozenset({"auto", "nvml", "kv_cache"})
    )
    efficiency_window_s: float = setting("LLM_OTEL_EFFICIENCY_WINDOW_S", 10.0, read_float, lo=0.1, hi=3600.0)
    health_weights: Mapping[str, float] = setting(
        "LLM_OTEL_HEALTH_WEIGHTS",
        read=_read_health_weights,
        default_factory=lambda: {"latency": 0.4, "errors": 0.3, "gpu": 0.2, "uptime": 0.1},
    )
    health_ttft_target_s: float = setting("LLM_OTEL_HEALTH_TTFT_TARGET_S", 1.0, read_float, lo=1e-6)
    health_max_error_rate: float = setting("LLM_OTEL_HEALTH_MAX_ERROR_RATE", 0.05, read_float, lo=1e-6, hi=1.0)
    health_gpu_knee: float = setting("LLM_OTEL_HEALTH_GPU_KNEE", 0.85, read_float, lo=0.0, hi=0.999)
    health_warmup_s: float = setting("LLM_OTEL_HEALTH_WARMUP_S", 60.0, read_float, lo=0.0)
    health_window_s: float = setting("LLM_OTEL_HEALTH_WINDOW_S", 300.0, read_float, lo=1.0)
    health_port: int | None = setting("LLM_OTEL_HEALTH_PORT", None, read_optional_int, lo=0, hi=65535)
    health_host: str = setting("LLM_OTEL_HEALTH_HOST", "127.0.0.1", read_str)
    health_min_score: float = setting("LLM_OTEL_HEALTH_MIN_SCORE", 0.5, read_float, lo=0.0, hi=1.0)
    tick_s: float = 1.0
    exporter_endpoint: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SignalsConfig:
        """Read and validate (:func:`signals_settings`). Raises ConfigError naming the variable (or
        the tier table line)."""
        return signals_settings(env)


def signals_settings(env: Mapping[str, str] | None = None) -> SignalsConfig:
    """The serving-signal settings from ``env`` (``os.environ``). Raises ConfigError naming the
    variable (or the tier table line)."""
    env = os.environ if env is None else env
    values = read_fields(SignalsConfig, env)
    if values["vram_warn"] > values["vram_critical"]:
        raise ConfigError(
            f"LLM_OTEL_VRAM_WARN={values['vram_warn']} is above LLM_OTEL_VRAM_CRITICAL={values['vram_critical']}"
        )
    return SignalsConfig(**values, exporter_endpoint=_health_exporter_endpoint(env))


def _health_exporter_endpoint(env: Mapping[str, str]) -> str | None:
    """The OTLP traces endpoint the health score probes, or None when spans do not go over OTLP
    (an invalid exporter variable is reported by ``instrument()``/``doctor``, not here)."""
    try:
        if exporter_setting(env, "TRACES") != "otlp":
            return None
    except ConfigError:
        return None
    return otlp_endpoint(env, "TRACES")
