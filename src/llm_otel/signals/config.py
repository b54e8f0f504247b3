"""Validated serving-signal settings (:class:`SignalsConfig`); read from the environment by
:mod:`llm_otel.config`, which validates every llm-otel variable in one place."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from llm_otel.signals.health import DEFAULT_WEIGHTS
from llm_otel.signals.tiers import TierTable

__all__ = ["SignalsConfig"]


@dataclasses.dataclass(frozen=True)
class SignalsConfig:
    """Validated signal settings; variables and defaults: :mod:`llm_otel.signals`."""

    class_sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    class_max_values: int = 20
    class_max_len: int = 64
    tiers: TierTable | None = None
    model_revision: str | None = None
    vram_warn: float = 0.80
    vram_warn_hold_s: float = 30.0
    vram_critical: float = 0.90
    vram_critical_hold_s: float = 10.0
    vram_clear_margin: float = 0.05
    vram_clear_hold_s: float = 30.0
    vram_source: str = "auto"
    efficiency_window_s: float = 10.0
    health_weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    health_ttft_target_s: float = 1.0
    health_max_error_rate: float = 0.05
    health_gpu_knee: float = 0.85
    health_warmup_s: float = 60.0
    health_window_s: float = 300.0
    health_port: int | None = None
    health_host: str = "127.0.0.1"
    health_min_score: float = 0.5
    tick_s: float = 1.0
    # where spans go when they go over OTLP (OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT), for the health
    # score's exporter-reachability factor; None when the traces exporter is not OTLP
    exporter_endpoint: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SignalsConfig":
        """Read and validate (:func:`llm_otel.config.signals_settings`). Raises ConfigError naming
        the variable (or the tier table line)."""
        from llm_otel.config import signals_settings

        return signals_settings(env)
