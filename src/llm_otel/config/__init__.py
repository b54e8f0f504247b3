"""llm-otel's configuration: every ``OTEL_*`` / ``LLM_OTEL_*`` variable it reads, validated once.

A leaf: this package imports nothing else of llm-otel, and every other part may import it.

* :mod:`.parse` - :class:`ConfigError` and the environment parsers; :func:`~.parse.setting`
  declares a setting (variable, parser, its one default) as a dataclass field.
* :mod:`.settings` - :class:`Settings`, the frozen settings object (``Settings.from_env()``).
* :mod:`.signals` - :class:`SignalsConfig` (``Settings.signals``): the serving signals' settings;
  :mod:`.classes` request-class sources, :mod:`.tiers` the tier table.
* :mod:`.exporters` - the OpenTelemetry exporter, OTLP, Prometheus and sampler variables.
"""

from llm_otel.config.classes import CLASS_DIMENSIONS, ENGINE_FIELDS, ENGINE_LORA, ENGINE_PRIORITY, parse_class_sources
from llm_otel.config.exporters import (
    DEFAULT_EXPORTER,
    DEFAULT_OTLP_PROTOCOL,
    EXPORTERS,
    OTLP_PROTOCOLS,
    PROMETHEUS_HOST,
    PROMETHEUS_PORT,
    exporter_setting,
    otlp_endpoint,
    otlp_protocol,
    prometheus_base_port,
    prometheus_host,
    signal_endpoint,
    traces_sampler,
    validate_exporter_env,
)
from llm_otel.config.parse import ConfigError
from llm_otel.config.settings import Settings, otlp_max_request_bytes, traces_per_s
from llm_otel.config.signals import HEALTH_FACTORS, SignalsConfig, signals_settings
from llm_otel.config.tiers import Tier, TierTable, tier_table

__all__ = [
    "ConfigError",
    "Settings",
    "SignalsConfig",
    "signals_settings",
    "tier_table",
    "Tier",
    "TierTable",
    "HEALTH_FACTORS",
    "CLASS_DIMENSIONS",
    "ENGINE_PRIORITY",
    "ENGINE_LORA",
    "ENGINE_FIELDS",
    "parse_class_sources",
    "EXPORTERS",
    "DEFAULT_EXPORTER",
    "OTLP_PROTOCOLS",
    "DEFAULT_OTLP_PROTOCOL",
    "PROMETHEUS_PORT",
    "PROMETHEUS_HOST",
    "exporter_setting",
    "otlp_protocol",
    "validate_exporter_env",
    "otlp_endpoint",
    "signal_endpoint",
    "traces_sampler",
    "traces_per_s",
    "otlp_max_request_bytes",
    "prometheus_base_port",
    "prometheus_host",
]
