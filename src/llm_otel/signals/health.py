"""Health score in [0, 1] and a tiny ``/healthz`` HTTP endpoint.

Each factor is a "goodness" in [0, 1]; the score is their weighted mean over the factors that
are available (weights renormalised), so a CPU-only process without GPU utilisation is scored on
the rest. Factors (docs/signals.md):

* ``latency`` = 1 if p95 <= target, else max(0, 2 - p95 / target): 0 at twice the target. p95 of
  the TTFT of requests finished in the last ``window_s`` (``LLM_OTEL_HEALTH_WINDOW_S``); no
  requests -> 1.
* ``errors``  = max(0, 1 - error_rate / max_error_rate) over the same window; none -> 1.
* ``gpu``     = 1 up to ``gpu_knee`` (``LLM_OTEL_HEALTH_GPU_KNEE``) utilisation, then linear to 0
  at 1.0 (no headroom);
  absent without NVML.
* ``uptime``  = min(1, uptime_s / warmup_s): a replica that just started ramps up.

Weights: ``LLM_OTEL_HEALTH_WEIGHTS``. Every parameter's default is
:class:`llm_otel.config.SignalsConfig`'s.
The dominant factor is the one with the largest weighted deficit ``w * (1 - factor)``; ``none``
when every factor is 1.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from llm_otel.config.signals import HEALTH_FACTORS, SignalsConfig
from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")

FACTORS = HEALTH_FACTORS
_DEFAULTS = SignalsConfig()  # every parameter's default is the setting's


def score(factors: Mapping[str, float | None], weights: Mapping[str, float]) -> tuple[float, str]:
    """Weighted mean of the available factors and the dominant factor. All absent -> (1.0, none)."""
    total = sum(weights[f] for f, v in factors.items() if v is not None)
    if total <= 0:
        return 1.0, "none"
    value = sum(weights[f] * v for f, v in factors.items() if v is not None) / total
    deficits = {f: weights[f] * (1.0 - v) for f, v in factors.items() if v is not None}
    dominant = max(deficits, key=deficits.__getitem__)
    if deficits[dominant] <= 1e-12:
        dominant = "none"
    return min(1.0, max(0.0, value)), dominant


class HealthScore:
    """Keeps the recent-request windows and computes the score on demand.

    Args:
        weights: factor -> weight >= 0 (missing factors weigh 0).
        latency_target_s: TTFT p95 target in seconds.
        max_error_rate: error fraction at which the errors factor reaches 0.
        gpu_knee: utilisation above which the gpu factor falls.
        warmup_s: seconds after ``started`` until the uptime factor is 1.
        window_s: how far back requests count; at most ``max_samples`` are kept.
        utilization: callable returning GPU utilisation in [0, 1] or None (the NVML poller).
    """

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        latency_target_s: float = _DEFAULTS.health_ttft_target_s,
        max_error_rate: float = _DEFAULTS.health_max_error_rate,
        gpu_knee: float = _DEFAULTS.health_gpu_knee,
        warmup_s: float = _DEFAULTS.health_warmup_s,
        window_s: float = _DEFAULTS.health_window_s,
        max_samples: int = 4096,
        utilization: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.weights = {f: float((weights or _DEFAULTS.health_weights).get(f, 0.0)) for f in FACTORS}
        self.latency_target_s = latency_target_s
        self.max_error_rate = max_error_rate
        self.gpu_knee = gpu_knee
        self.warmup_s = warmup_s
        self.window_s = window_s
        self.utilization = utilization
        self.clock = clock
        self.started = clock()
        # Preallocated rings (finish time, value), oldest overwritten: a fixed 100 KiB at the
        # default size from the start. Deques of (float, float) tuples held the same samples in
        # about 175 bytes per request, growing for the first 4,096 requests of every process (the
        # engine soak's "+38 bytes per request", docs/performance.md#memory).
        n = max(1, int(max_samples))
        self._lat_t = np.full(n, -np.inf)
        self._lat_v = np.zeros(n)
        self._lat_n = 0  # samples written so far; the next goes to index _lat_n % n
        self._out_t = np.full(n, -np.inf)
        self._out_e = np.zeros(n, dtype=bool)
        self._out_n = 0

    def observe(self, ttft_s: float | None, error: bool) -> None:
        """One finished request (O(1), no allocation that stays, called at finish)."""
        now = self.clock()
        i = self._out_n % self._out_t.size
        self._out_e[i] = error
        self._out_t[i] = now
        self._out_n += 1
        if ttft_s is not None and not error:
            i = self._lat_n % self._lat_t.size
            self._lat_v[i] = ttft_s
            self._lat_t[i] = now
            self._lat_n += 1

    def factors(self) -> dict[str, float | None]:
        now = self.clock()
        horizon = now - self.window_s
        lat = self._lat_v[self._lat_t >= horizon]  # boolean index: a copy, safe against observe()
        outcomes = self._out_e[self._out_t >= horizon]
        if lat.size:
            p95 = float(np.percentile(lat, 95))
            latency = 1.0 if p95 <= self.latency_target_s else max(0.0, 2.0 - p95 / self.latency_target_s)
        else:
            latency = 1.0
        if outcomes.size:
            rate = float(outcomes.mean())
            errors = max(0.0, 1.0 - rate / self.max_error_rate)
        else:
            errors = 1.0
        gpu = None
        util = self.utilization() if self.utilization is not None else None
        if util is not None:
            gpu = 1.0 if util <= self.gpu_knee else max(0.0, (1.0 - util) / (1.0 - self.gpu_knee))
        uptime = 1.0 if self.warmup_s <= 0 else min(1.0, max(0.0, now - self.started) / self.warmup_s)
        return {"latency": latency, "errors": errors, "gpu": gpu, "uptime": uptime}

    def compute(self) -> tuple[float, str, dict[str, float | None]]:
        """``(score, dominant factor, factors)``."""
        factors = self.factors()
        value, dominant = score(factors, self.weights)
        return value, dominant, factors


def otlp_endpoint_reachable(endpoint: str | None, timeout_s: float = 1.0) -> bool | None:
    """TCP reachability of an OTLP endpoint URL (None when no endpoint is configured). Sends nothing."""
    if not endpoint:
        return None
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 4317)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class HealthServer:
    """``GET /healthz`` -> 200 when healthy, 503 otherwise, with a JSON body explaining why.
    ``HEAD`` answers the same status and headers without the body (load-balancer checks).

    Healthy = score >= ``min_score`` and VRAM pressure is not ``critical`` and the exporter is not
    known to be unreachable. ``report`` returns ``(score, dominant, factors, pressure level or None,
    exporter_ok or None)``. Runs in daemon threads; binds ``host`` and ``port`` (0 picks
    a free one, see :attr:`port`). Raises ValueError when ``port`` is not an int in 0..65535 and
    OSError when the port cannot be bound.
    """

    def __init__(
        self,
        report: Callable[[], tuple],
        port: int,
        host: str = _DEFAULTS.health_host,
        min_score: float = _DEFAULTS.health_min_score,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"health port must be an integer in 0..65535, got {port!r}")
        self.report = report
        self.min_score = min_score
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _respond(self, with_body: bool) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/healthz", "/health", "/"):
                    self.send_error(404)  # send_error itself omits the body for HEAD
                    return
                code, body = server.response()
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if with_body:
                    self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                self._respond(with_body=True)

            def do_HEAD(self) -> None:  # noqa: N802 - load-balancer checks: same status and headers, no body
                self._respond(with_body=False)

            def log_message(self, *args: Any) -> None:  # health checks are frequent: no access log
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def response(self) -> tuple[int, dict]:
        try:
            value, dominant, factors, level, exporter_ok = self.report()
        except Exception as exc:  # noqa: BLE001 - a broken signal must not look healthy
            process_errors().report("signals.health.report", exc, "the health report failed; /healthz answers 503")
            return 503, {"status": "unhealthy", "reasons": [f"health report failed: {type(exc).__name__}"]}
        reasons = []
        if value < self.min_score:
            reasons.append(f"score {value:.3f} < {self.min_score} (dominant factor {dominant})")
        if level == "critical":
            reasons.append("VRAM pressure critical")
        if exporter_ok is False:
            reasons.append("telemetry exporter unreachable")
        body = {
            "status": "unhealthy" if reasons else "ok",
            "score": round(value, 4),
            "dominant_factor": dominant,
            "factors": {k: (None if v is None else round(v, 4)) for k, v in factors.items()},
            "vram_pressure": level,
            "exporter": {True: "ok", False: "unreachable", None: "not configured"}[exporter_ok],
            "reasons": reasons,
        }
        return (503 if reasons else 200), body

    def start(self) -> HealthServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="llm-otel-healthz", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close_inherited(self) -> None:
        """In a forked child: close this process's copy of the listening socket (the parent's
        thread serves it; ``stop()`` here would wait forever for a thread that is not here)."""
        try:
            self._httpd.socket.close()
        except OSError:
            pass

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
