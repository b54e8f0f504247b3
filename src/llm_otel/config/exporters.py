"""The OpenTelemetry exporter variables llm-otel reads when it builds providers itself
(``OTEL_{TRACES,METRICS}_EXPORTER``, ``OTEL_EXPORTER_OTLP_*``, ``OTEL_EXPORTER_PROMETHEUS_*``,
``OTEL_TRACES_SAMPLER``). Their defaults are the constants below, the SDK's own."""

from __future__ import annotations

from collections.abc import Mapping

from llm_otel.config.parse import ConfigError, read_choice

__all__ = [
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
    "prometheus_base_port",
    "prometheus_host",
]

EXPORTERS = {"TRACES": ("otlp", "console", "none"), "METRICS": ("otlp", "prometheus", "console", "none")}
DEFAULT_EXPORTER = "otlp"
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_OTLP_PROTOCOL = "grpc"  # the Python SDK's default
PROMETHEUS_PORT = 9464  # OpenTelemetry's default for OTEL_EXPORTER_PROMETHEUS_PORT
PROMETHEUS_HOST = "localhost"


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
        return DEFAULT_EXPORTER
    unknown = sorted(names - set(accepted))
    if unknown:
        raise ConfigError(
            f"{name}={raw!r}: unknown exporter {', '.join(unknown)}; expected one of {', '.join(accepted)}"
        )
    if len(names) > 1:
        raise ConfigError(
            f"{name}={raw!r}: llm-otel configures one exporter per signal; expected one of {', '.join(accepted)}"
        )
    return names.pop()


def otlp_protocol(env: Mapping[str, str], signal: str) -> str:
    """The OTLP protocol for ``signal``: ``OTEL_EXPORTER_OTLP_<signal>_PROTOCOL``, else
    ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc`` (the Python SDK's default).

    Raises ConfigError for a value other than ``grpc`` / ``http/protobuf`` in either variable,
    whether or not an endpoint is set."""
    general = read_choice(env, "OTEL_EXPORTER_OTLP_PROTOCOL", None, set(OTLP_PROTOCOLS))
    specific = read_choice(env, f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", None, set(OTLP_PROTOCOLS))
    return specific or general or DEFAULT_OTLP_PROTOCOL


def validate_exporter_env(env: Mapping[str, str]) -> None:
    """Check the exporter variables llm-otel reads when it builds providers itself:
    ``OTEL_{TRACES,METRICS}_EXPORTER`` and ``OTEL_EXPORTER_OTLP{,_TRACES,_METRICS}_PROTOCOL``.
    Raises ConfigError naming the first invalid variable."""
    for signal in ("TRACES", "METRICS"):
        exporter_setting(env, signal)
        otlp_protocol(env, signal)


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


def prometheus_base_port(env: Mapping[str, str]) -> int:
    """``OTEL_EXPORTER_PROMETHEUS_PORT`` (:data:`PROMETHEUS_PORT`), the port of the first frontend.
    Raises ConfigError for anything but a port number in [1, 65534]."""
    raw = (env.get("OTEL_EXPORTER_PROMETHEUS_PORT") or "").strip()
    try:
        base = int(raw) if raw else PROMETHEUS_PORT
    except ValueError:
        raise ConfigError(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r}: expected a port number") from None
    if not 0 < base < 65535:
        raise ConfigError(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r}: expected a port number in [1, 65534]")
    return base


def prometheus_host(env: Mapping[str, str]) -> str:
    """``OTEL_EXPORTER_PROMETHEUS_HOST`` (:data:`PROMETHEUS_HOST`)."""
    return (env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or PROMETHEUS_HOST).strip()
