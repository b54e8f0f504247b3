"""A real Triton Inference Server for the tests: the ``tritonserver`` 2.51 binary shipped in the
``nvidia-pytriton`` wheel, run from its own virtual environment (``.venv-triton``, numpy < 2 for
the Python backend stub; created by ``.ci/install.sh``), with a model repository written here.

Models (Python backend; ``text_input`` BYTES[1], optional ``max_tokens`` INT32[1]):

* ``text_echo`` - one response: ``text_output`` = the input + `` => ok``; ``params_json`` = the
  request parameters as JSON (Triton copies ``traceparent``/``tracestate`` headers into them:
  ``--*-header-forward-pattern``). Input ``fail`` -> an error response; ``slow`` -> answers after 1 s.
* ``tok_stream`` - decoupled, one response per token (``max_tokens``, default 4, 10 ms apart),
  the final flag on the last token (vLLM backend style); ``max_tokens < 0`` -> error. The first
  response of each request also carries ``params_json`` (the parameters, as for ``text_echo``: a
  stream's ``traceparent`` header reaches every request of the stream).
* ``tok_stream_empty_final`` - same, the final flag in an extra empty response (PyTriton style).
* ``tok_err`` - decoupled: one token, then an error response.
* ``no_output`` - a success response with no output tensor; ``wrong_dtype`` - ``text_output``
  (declared BYTES) sent as FP32: malformed responses.

The server exports its own OpenTelemetry spans (OTLP/HTTP JSON, hex ids) to ``otlp_url`` with
rate 1 and level TIMESTAMPS.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = pathlib.Path(os.environ.get("LLM_OTEL_TRITON_VENV", ROOT / ".venv-triton"))

MODEL_PY = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _text(request):
    return pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()


def _max_tokens(request):
    t = pb_utils.get_input_tensor_by_name(request, "max_tokens")
    return 4 if t is None else int(t.as_numpy().reshape(-1)[0])


def _out(name, value):
    return pb_utils.Tensor(name, np.array([value.encode()], dtype=np.object_))


class TritonPythonModel:
    def initialize(self, args):
        self.mode = json.loads(args["model_config"])["parameters"]["mode"]["string_value"]

    def execute(self, requests):
        if self.mode in ("echo", "no_output", "wrong_dtype"):
            responses = []
            for request in requests:
                if self.mode == "no_output":  # a success response without the declared output
                    responses.append(pb_utils.InferenceResponse(output_tensors=[]))
                    continue
                if self.mode == "wrong_dtype":  # text_output is declared BYTES; this sends FP32
                    responses.append(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor("text_output", np.array([1.5], dtype=np.float32))]))
                    continue
                text = _text(request)
                if text == "slow":
                    time.sleep(1.0)
                if text == "fail":
                    responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("planted failure")))
                    continue
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    _out("text_output", text + " => ok"), _out("params_json", request.parameters())]))
            return responses
        for request in requests:
            sender = request.get_response_sender()
            n = _max_tokens(request)
            if n < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("max_tokens must be >= 0")),
                            flags=FINAL)
                continue
            for i in range(n):
                time.sleep(0.01)
                if request.is_cancelled():  # the client cancelled or dropped the stream: stop generating
                    sender.send(flags=FINAL)
                    break
                if self.mode == "err" and i == 1:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("boom mid-stream")),
                                flags=FINAL)
                    break
                last = i == n - 1
                flags = FINAL if (last and self.mode == "final_on_last") else 0
                outputs = [_out("text_output", f"tok{i} ")]
                if i == 0:  # what the server saw, once per request
                    outputs.append(_out("params_json", request.parameters()))
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
            else:
                if self.mode in ("empty_final", "err"):
                    sender.send(flags=FINAL)
        return None
"""

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
{decoupled}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }}{extra_output}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "mode" value {{ string_value: "{mode}" }} }}
"""

MODELS = {
    "text_echo": ("echo", False),
    "tok_stream": ("final_on_last", True),
    "tok_stream_empty_final": ("empty_final", True),
    "tok_err": ("err", True),
    "no_output": ("no_output", False),
    "wrong_dtype": ("wrong_dtype", False),
}


def site_packages(venv: pathlib.Path = VENV) -> pathlib.Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages/pytriton"))
    return found[0].parent if found else None


def unavailable_reason() -> str | None:
    """Why the real server cannot run here (None when it can)."""
    sp = site_packages()
    if sp is None:
        return f"no nvidia-pytriton in {VENV} (bash .ci/install.sh creates it)"
    if not (sp / "pytriton/tritonserver/bin/tritonserver").exists():
        return "the nvidia-pytriton wheel has no tritonserver binary"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_repository(root: pathlib.Path) -> pathlib.Path:
    repo = root / "models"
    for name, (mode, decoupled) in MODELS.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
        params = mode in ("echo", "final_on_last", "empty_final", "err")  # text_echo and the streams
        extra = ',\n  { name: "params_json" data_type: TYPE_STRING dims: [ 1 ] }' if params else ""
        (repo / name / "config.pbtxt").write_text(
            CONFIG.format(
                name=name,
                mode=mode,
                extra_output=extra,
                decoupled="model_transaction_policy { decoupled: true }" if decoupled else "",
            )
        )
    return repo


@dataclasses.dataclass
class TritonServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: pathlib.Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=5)


def start(workdir: pathlib.Path, otlp_url: str, timeout_s: float = 60.0) -> TritonServer:
    """Start tritonserver on free 127.0.0.1 ports; returns once every model is ready.

    Raises RuntimeError with the server log's tail when it exits or is not ready in time.
    """
    sp = site_packages()
    if sp is None:
        raise RuntimeError(unavailable_reason())
    pt = sp / "pytriton" / "tritonserver"
    backend = workdir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for src in (
        pt / "backends/python/libtriton_python.so",
        pt / "backends/python/triton_python_backend_utils.py",
        pt / f"python_backend_stubs/{sys.version_info.major}.{sys.version_info.minor}/triton_python_backend_stub",
    ):
        shutil.copy2(src, backend / src.name)
    repo = write_repository(workdir)
    http_port, grpc_port = free_port(), free_port()
    libdir = subprocess.check_output(
        [str(VENV / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"], text=True
    ).strip()
    env = dict(os.environ)
    # the stub links libpython of the venv's interpreter and the wheel's bundled libraries; its
    # embedded Python finds its prefix through `python3` on PATH (numpy < 2 lives there)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, str(sp / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")) if p
    )
    env["PATH"] = os.pathsep.join((str(VENV / "bin"), env.get("PATH", "")))
    for key in [k for k in env if k.startswith("PYTHON") or k.startswith("OTEL_")]:
        del env[key]
    log = workdir / "tritonserver.log"
    cmd = [
        str(pt / "bin/tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={workdir / 'backends'}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--allow-metrics=false",
        "--exit-timeout-secs=5",
        "--http-header-forward-pattern=traceparent|tracestate",
        "--grpc-header-forward-pattern=traceparent|tracestate",
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        f"opentelemetry,url={otlp_url}",
        "--trace-config",
        "opentelemetry,resource=service.name=triton-test",
        "--trace-config",
        "opentelemetry,bsp_schedule_delay=100",
        "--trace-config",
        "rate=1",
        "--trace-config",
        "count=-1",
        "--trace-config",
        "level=TIMESTAMPS",
    ]
    out = open(log, "wb")
    process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
    server = TritonServer(process, http_port, grpc_port, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"tritonserver did not become ready (exit code {process.poll()}):\n{tail}")
