"""Serving signals for SLA tiers and load balancing: request classes, tier SLO checks, KV-cache
footprint per request, token efficiency, VRAM pressure levels and a health score (+ ``/healthz``).

:class:`Signals` (:mod:`.service`) is created by :class:`llm_otel.telemetry.Telemetry` (one per
``instrument()``) and listens to its request lifecycle (:mod:`llm_otel.listeners`): every engine's
requests are classified and admitted at start (:meth:`Signals.on_start`), counted per engine step
(:meth:`Signals.on_tokens`) and checked against their tier at finish (:meth:`Signals.on_finish`);
adapters call only ``Telemetry``. Its background thread (started when an engine reports its KV
pool, ``Telemetry.attach_kv_source``) feeds the VRAM pressure monitor once a second. Formulas,
units and sources: docs/signals.md.

Configuration: :class:`llm_otel.config.SignalsConfig` (``Settings.signals``), read and validated
once by :func:`llm_otel.config.signals_settings` (invalid values raise ConfigError at
``instrument()``); its docstring and docs/signals.md list the variables and defaults. This package
interprets those settings; it parses no variable itself.
"""

from llm_otel.config.signals import SignalsConfig
from llm_otel.config.tiers import TierTable
from llm_otel.signals.classes import ClassExtractor
from llm_otel.signals.health import HealthScore, HealthServer
from llm_otel.signals.kv import KVSpec
from llm_otel.signals.pressure import PressureMonitor
from llm_otel.signals.service import GIB, Signals, kv_source_for, request_instruments

__all__ = [
    "Signals",
    "SignalsConfig",
    "KVSpec",
    "PressureMonitor",
    "HealthScore",
    "HealthServer",
    "TierTable",
    "ClassExtractor",
    "GIB",
    "kv_source_for",
    "request_instruments",
]
