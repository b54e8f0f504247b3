"""Serving signals for SLA tiers and load balancing: request classes, tier SLO checks, KV-cache
footprint per request, token efficiency, VRAM pressure levels and a health score (+ ``/healthz``).

:class:`Signals` (:mod:`.service`) is created by :class:`llm_otel.telemetry.Telemetry` (one per
``instrument()``) and listens to its request lifecycle (:mod:`llm_otel.listeners`): every engine's
requests are classified and admitted at start (:meth:`Signals.on_start`), counted per engine step
(:meth:`Signals.on_tokens`) and checked against their tier at finish (:meth:`Signals.on_finish`);
adapters call only ``Telemetry``. Its background thread (started when an engine reports its KV
pool, ``Telemetry.attach_kv_source``) feeds the VRAM pressure monitor once a second. Formulas,
units and sources: docs/signals.md.

Configuration (:class:`SignalsConfig` in :mod:`.config`, ``Settings.signals``; read and validated
by :func:`llm_otel.config.signals_settings` once; invalid values raise ConfigError at
``instrument()``):

``LLM_OTEL_CLASS_HEADERS`` (unset) dimension:source pairs, see :mod:`.classes`;
``LLM_OTEL_CLASS_MAX_VALUES`` (20) metric labels per dimension before ``other``;
``LLM_OTEL_CLASS_MAX_LEN`` (64) longest accepted value;
``LLM_OTEL_TIERS`` / ``LLM_OTEL_TIERS_FILE`` (unset) tier table, see :mod:`.tiers`;
``LLM_OTEL_MODEL_REVISION`` (unset) revision label (canary/stable) when no header gives one;
``LLM_OTEL_VRAM_WARN`` (0.80), ``LLM_OTEL_VRAM_WARN_HOLD_S`` (30), ``LLM_OTEL_VRAM_CRITICAL`` (0.90),
``LLM_OTEL_VRAM_CRITICAL_HOLD_S`` (10), ``LLM_OTEL_VRAM_CLEAR_MARGIN`` (0.05),
``LLM_OTEL_VRAM_CLEAR_HOLD_S`` (30), ``LLM_OTEL_VRAM_SOURCE`` (auto | nvml | kv_cache);
``LLM_OTEL_EFFICIENCY_WINDOW_S`` (10);
``LLM_OTEL_HEALTH_WEIGHTS`` (latency=0.4,errors=0.3,gpu=0.2,uptime=0.1),
``LLM_OTEL_HEALTH_TTFT_TARGET_S`` (1.0), ``LLM_OTEL_HEALTH_MAX_ERROR_RATE`` (0.05),
``LLM_OTEL_HEALTH_GPU_KNEE`` (0.85), ``LLM_OTEL_HEALTH_WARMUP_S`` (60), ``LLM_OTEL_HEALTH_WINDOW_S`` (300),
``LLM_OTEL_HEALTH_PORT`` (unset: no endpoint), ``LLM_OTEL_HEALTH_HOST`` (127.0.0.1),
``LLM_OTEL_HEALTH_MIN_SCORE`` (0.5).
"""

from llm_otel.signals.classes import ClassExtractor
from llm_otel.signals.config import SignalsConfig
from llm_otel.signals.health import HealthScore, HealthServer
from llm_otel.signals.kv import KVSpec
from llm_otel.signals.pressure import PressureMonitor
from llm_otel.signals.service import GIB, Signals, kv_source_for, request_instruments
from llm_otel.signals.tiers import TierTable

__all__ = ["Signals", "SignalsConfig", "KVSpec", "PressureMonitor", "HealthScore", "HealthServer", "TierTable",
           "ClassExtractor"]
