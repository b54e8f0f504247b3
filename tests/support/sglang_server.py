"""SGLang 0.5.23's real server on CPU (``.venv-sglang``, made by tests/support/sglang_env/install.sh)
under ``opentelemetry-instrument``, exporting to a test OTLP receiver.

``start(otlp_endpoint, extra_args)`` launches ``python -m sglang.launch_server`` on the tiny Llama with
the CPU flags SGLang needs here (``--device cpu --disable-overlap-schedule --attention-backend
torch_native --dtype float32``, ``SGLANG_USE_CPU_ENGINE=1``), this checkout's ``src`` first on
``PYTHONPATH`` so every spawned SGLang process imports this llm-otel, and waits for ``/health``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time
import urllib.request
from typing import Any

from support.vllm_servers import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-sglang"


def unavailable_reason() -> str | None:
    """Why the real server cannot run here (None when it can)."""
    if not (VENV / "bin" / "python").exists() or not sorted(VENV.glob("lib/python3*/site-packages/sglang")):
        return f"no SGLang in {VENV} (bash .ci/install.sh creates it)"
    return None


@dataclasses.dataclass
class SGLangServer:
    process: subprocess.Popen
    port: int
    log: pathlib.Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def stream(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Any]:
        """The ``data:`` chunks of a server-sent-events response, decoded, up to ``[DONE]``."""
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})}
        )
        chunks = []
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunks.append(json.loads(data))
        return chunks

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start(
    model: str,
    otlp_endpoint: str,
    log: pathlib.Path,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 300.0,
    instrument: bool = True,
    env_overrides: dict[str, str] | None = None,
) -> SGLangServer:
    """Launch the server (under ``opentelemetry-instrument`` unless ``instrument`` is False) and wait
    for ``/health``; raises RuntimeError with the log's tail when it does not come up."""
    # PYTHONPATH goes last: opentelemetry-instrument rewrites it in every process it starts, and
    # when it is the first environment variable that breaks setproctitle (the process titles,
    # sglang::scheduler / sglang::detokenizer, stay the spawn command line)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_", "PYTHONPATH"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_TRACES_SAMPLER="always_on",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="none",
        OTEL_METRIC_EXPORT_INTERVAL="500",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME="sglang-test",
        LLM_OTEL_ADAPTIVE_SAMPLING="off",
        LLM_OTEL_STEP_SPANS_PER_S="100000",  # every step of a sampled request gets its span
        LLM_OTEL_LOGIT_DIST_RATIO="1",  # every sampled request gets llm.logit_dist
        LLM_OTEL_LOGIT_EVENTS="64",
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=str(ROOT / "src"),
    )
    env.update(env_overrides or {})
    port = free_port()
    cmd = [
        *([str(VENV / "bin" / "opentelemetry-instrument")] if instrument else []),
        str(VENV / "bin" / "python"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--device",
        "cpu",
        "--disable-overlap-schedule",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        "4096",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    out = log.open("w")
    process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = SGLangServer(process, port, log)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2):
                return server
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"SGLang server did not start; last lines:\n{log.read_text()[-3000:]}") from None
            time.sleep(1)
