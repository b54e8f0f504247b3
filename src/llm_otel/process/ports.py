"""Which port each process of a serving topology listens on (Prometheus metrics, ``/healthz``),
and when it starts listening.

One scheme for every topology; a single frontend keeps the configured ports unchanged:

==========================================  ==========================  ==========================
process                                     Prometheus (base = 9464 or  ``/healthz`` (base =
                                            ``OTEL_EXPORTER_PROMETHEUS_  ``LLM_OTEL_HEALTH_PORT``)
                                            PORT``)
==========================================  ==========================  ==========================
the frontend (offline ``LLM``, one API      base                        base
server, or API server 0)
API server *i* (``vllm serve                base - *i*                  base - *i*
--api-server-count N``, ``ApiServer_<i>``)
engine core of data-parallel rank *r*       base + 1 + *r*              none
workers                                     none                        none
the ``vllm serve`` launcher when it starts  none                        none
several API servers (it serves no request)
==========================================  ==========================  ==========================

API servers count down from the base and engine cores up from it, so neither depends on how many
of the other there are (a process knows only its own index), and ``LLM_OTEL_HEALTH_PORT=0`` still
means "a free port" in every process.

*When*: a vLLM frontend process binds its Prometheus port (and starts reporting the sampling
probability, the one gauge a frontend has before any request) when it creates its engine client
(``EngineCoreClient.make_client`` / ``make_async_mp_client``), i.e. when it is known to serve
requests: vLLM's launcher loads the plugins (and so builds our providers) while it parses its
command line, before it knows whether it will serve or only start API servers. Everywhere else
(engine cores, applications that call ``llm_otel.instrument()``) the port is bound at once. The
``/healthz`` endpoint starts with the first request the process serves (``llm_otel.signals``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

from llm_otel.config import prometheus_base_port
from llm_otel.errors import guard

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader

logger = logging.getLogger("llm_otel")
# the process names of the topology above (vLLM's multiprocessing names: API server i, the engine
# core of data-parallel rank r); the engine's adapter reads its identity from the same names
_API_SERVER_RE = re.compile(r"^ApiServer_(\d+)$")
_DP_RE = re.compile(r"_DP(\d+)$")

_lock = threading.Lock()
_defer_frontend = False
_pending: list[Callable[[], bool]] = []
_serving = False


def api_server_index(process_name: str | None = None) -> int:
    """This frontend's index among vLLM's API servers: *i* in the process name ``ApiServer_<i>``
    (``vllm.v1.utils.APIServerProcessManager``; this process when ``process_name`` is None), 0 for
    any other process."""
    name = multiprocessing.current_process().name if process_name is None else process_name
    match = _API_SERVER_RE.match(name)
    return int(match.group(1)) if match else 0


def frontend_port(base: int, index: int) -> int:
    """Port of the frontend with API-server ``index`` (``base - index``; 0 stays 0, a free port)."""
    return base - index if base else 0


def engine_core_port(base: int, dp_rank: int) -> int:
    """Prometheus port of the engine core of data-parallel rank ``dp_rank``: ``base + 1 + dp_rank``."""
    return base + 1 + dp_rank


def scheme(
    prometheus_base: int | None,
    api_servers: int = 1,
    dp_size: int = 1,
    health_base: int | None = None,
    serving_ports: tuple[int, ...] = (),
) -> tuple[list[tuple[str, str, int]], list[str]]:
    """The ports of a topology: ``([(process, endpoint, port)], [collision, ...])``.

    ``api_servers``: API server processes (``--api-server-count``, 1 = the launcher serves);
    ``dp_size``: engine cores on this host; ``prometheus_base``: ``OTEL_EXPORTER_PROMETHEUS_PORT``
    (None: no Prometheus endpoints); ``health_base``: ``LLM_OTEL_HEALTH_PORT`` or None;
    ``serving_ports``: ports the engine itself listens on (vLLM's ``--port``), checked for clashes.
    A collision names the two users of one port, or a port outside 1..65535."""
    rows: list[tuple[str, str, int]] = []
    for i in range(max(1, api_servers)):
        name = f"ApiServer_{i}" if api_servers > 1 else "frontend"
        if prometheus_base is not None:
            rows.append((name, "prometheus", frontend_port(prometheus_base, i)))
        if health_base is not None:
            rows.append((name, "healthz", frontend_port(health_base, i)))
    if prometheus_base is not None:
        for r in range(max(1, dp_size)):
            rows.append(
                (
                    f"EngineCore_DP{r}" if dp_size > 1 else "engine_core",
                    "prometheus",
                    engine_core_port(prometheus_base, r),
                )
            )
    problems: list[str] = []
    users: dict[int, str] = {p: f"the engine's own port {p}" for p in serving_ports}
    for process, endpoint, port in rows:
        if endpoint == "healthz" and port == 0:
            continue  # a free port each
        if not 0 < port < 65536:
            problems.append(f"{process} {endpoint} port {port} is outside 1..65535")
            continue
        who = f"{process} {endpoint}"
        if port in users:
            problems.append(f"port {port}: {users[port]} and {who}")
        else:
            users[port] = who
    return rows, problems


def defer_frontend_endpoints() -> None:
    """From now on, :func:`when_serving` work of this process (its endpoints, the sampling gauge)
    waits for :func:`serving_started` (set by the vLLM plugin in vLLM's own frontend processes,
    before it builds their providers)."""
    global _defer_frontend
    _defer_frontend = True


def when_serving(start: Callable[[], bool]) -> bool | None:
    """Run ``start`` now and return its result, or keep it for when this process starts serving
    (frontend work deferred: its endpoints, the gauges only a serving frontend has) and return None."""
    with _lock:
        if _defer_frontend and not _serving:
            _pending.append(start)
            return None
    return start()


def serving_started() -> None:
    """This process serves requests (it created an engine client): start the deferred endpoints.
    Idempotent; never raises (a failing start is logged by the start function itself)."""
    global _serving
    with _lock:
        _serving = True
        pending = list(_pending)
        _pending.clear()
    for start in pending:
        with guard("process.ports.start", message="an endpoint of this process could not start"):
            start()  # an endpoint must never stop the engine


def prometheus_port(env: Mapping[str, str], role: str, process_name: str | None = None) -> int | None:
    """The Prometheus port a process of ``role`` (``frontend``/``engine_core``/``worker``) serves on,
    or None (workers); ``process_name`` defaults to this process's multiprocessing name
    (``ApiServer_<i>``, ``EngineCore_DP<r>``). Raises ConfigError for a bad
    ``OTEL_EXPORTER_PROMETHEUS_PORT``."""
    base = prometheus_base_port(env)
    name = process_name if process_name is not None else multiprocessing.current_process().name
    if role == "frontend":
        return frontend_port(base, api_server_index(name))
    if role == "engine_core":
        match = _DP_RE.search(name)
        return engine_core_port(base, int(match.group(1)) if match else 0)
    return None


def prometheus_reader(env: Mapping[str, str], role: str) -> MetricReader | None:
    """This process's Prometheus metric reader with its endpoint started on its port
    (:func:`prometheus_port`), or None (worker role, or the port is busy: logged). A vLLM
    frontend's endpoint starts once it serves requests (:func:`when_serving`); until then the
    reader collects nothing. Raises ConfigError for a bad port variable; needs
    opentelemetry-exporter-prometheus (:mod:`llm_otel.export.prometheus`)."""
    from llm_otel.export.prometheus import prometheus_reader as reader_on

    # export.prometheus is not annotated: it returns its ExemplarPrometheusMetricReader or None
    return cast(
        "MetricReader | None",
        reader_on(env, role, prometheus_port(env, role), when_serving if role == "frontend" else None),
    )


def prometheus_reader_from_env(env: Mapping[str, str] | None = None, role: str = "frontend") -> MetricReader | None:
    """The Prometheus metric reader (endpoint started) when ``OTEL_METRICS_EXPORTER=prometheus``,
    else None; None with one warning when opentelemetry-exporter-prometheus is not installed.
    Raises ConfigError for a bad ``OTEL_EXPORTER_PROMETHEUS_PORT``."""
    from llm_otel.export.providers import exporter_choice

    env = os.environ if env is None else env
    if exporter_choice(env, "METRICS") != "prometheus":
        return None
    try:
        import llm_otel.export.prometheus  # noqa: F401 - needs opentelemetry-exporter-prometheus
    except ImportError as exc:
        logger.warning(
            "llm-otel: OTEL_METRICS_EXPORTER=prometheus needs opentelemetry-exporter-prometheus "
            "(pip install 'llm-otel[prometheus]'): %s; metrics are not exported",
            exc,
        )
        return None
    return prometheus_reader(env, role)


def _reset_for_tests() -> None:
    global _defer_frontend, _serving
    with _lock:
        _defer_frontend = False
        _serving = False
        _pending.clear()
