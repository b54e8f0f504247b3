"""CUDA-graph capture safety (llm_otel.gpu.capture; case C23), the CuPy kernel cache fallback
(case C21) and the CuPy/torch CUDA-major check (llm_otel.gpu.stack), all run on CPU.

The capture side is torch's ``torch.cuda.graphs.CUDAGraph.capture_begin`` / ``capture_end``: on a
CPU build of torch the class exists but cannot be instantiated, so the gate is installed on a
stand-in with the real methods' signatures (checked below against the installed torch) and, for
what the real class can do here (raise), on the real class.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import types

import numpy as np
import pytest
from conftest import make_captured

from llm_otel.gpu import ring as R
from llm_otel.gpu import stack as S
from llm_otel.gpu.capture import CaptureGate
from llm_otel.telemetry.steps import StepTracker

torch = pytest.importorskip("torch")


class Graph:
    """Stands in for torch.cuda.graphs.CUDAGraph (torch/cuda/graphs.py): same capture methods."""

    def __init__(self, log):
        self.log = log

    def capture_begin(self, pool=None, capture_error_mode="global", check_input_liveness=False):
        self.log.append("begin")

    def capture_end(self):
        self.log.append("end")


def test_the_stand_in_has_torchs_capture_signatures():
    from torch.cuda.graphs import CUDAGraph

    for name in ("capture_begin", "capture_end"):
        real = list(inspect.signature(vars(CUDAGraph)[name]).parameters)
        assert list(inspect.signature(vars(Graph)[name]).parameters) == real


class DeviceRing(R.NumpyRing):
    """The host ring, marked as a device ring so the tracker gates it like the CuPy ring; every
    poll/calibrate notes whether a capture was in progress (there must never be one)."""

    on_device = True

    def __init__(self, gate, capacity=64):
        super().__init__(capacity)
        self.gate = gate
        self.calls = 0
        self.during_capture = 0

    def _touch(self):
        self.calls += 1
        self.during_capture += self.gate.active > 0

    def poll(self):
        self._touch()
        return super().poll()

    def calibrate(self):
        self._touch()


@pytest.fixture()
def gate(monkeypatch):
    """A fresh gate in place of the process's (the device timeline, the worker and the logit capture read it by module name)."""
    fresh = CaptureGate()
    import llm_otel.gpu.timeline as timeline_module
    import llm_otel.instrumentation.vllm.worker as worker_module
    import llm_otel.telemetry.logit_capture as logit_capture_module

    monkeypatch.setattr(timeline_module, "capture_gate", fresh)
    monkeypatch.setattr(logit_capture_module, "capture_gate", fresh)
    monkeypatch.setattr(worker_module, "capture_gate", fresh)
    yield fresh
    fresh.uninstall()


@pytest.mark.case("C23")
def test_drain_does_no_device_work_during_a_capture_and_catches_up_after(gate):
    cap = make_captured()
    ring = DeviceRing(gate)
    tracker = StepTracker(cap.telemetry, backend=ring, nvtx=False, start_thread=False)
    assert gate.install(Graph)
    graph = Graph([])
    ctx = tracker.begin(["r1"])
    tracker.end(ctx)
    graph.capture_begin(capture_error_mode="global")
    assert gate.active == 1 and graph.log == ["begin"]
    assert tracker.drain() == 0 and ring.calls == 0  # no event query / copy while capturing
    during = tracker.begin(["r2"])  # a step begun while capturing launches no record
    assert during.recorded is False
    tracker.end(during)
    graph.capture_end()
    assert gate.active == 0 and graph.log == ["begin", "end"]
    tracker.drain()
    assert ring.calls >= 1 and ring.during_capture == 0
    assert ctx.completed and ctx.device_duration_ns is not None  # the records waited in the ring
    assert during.completed and during.device_duration_ns is None
    assert gate.skipped == 1
    tracker.close()


@pytest.mark.case("C23")
def test_a_capture_waits_for_device_work_in_flight(gate):
    gate.install(Graph)
    inside, release = threading.Event(), threading.Event()

    def drain_pass():
        with gate.device_work() as allowed:
            assert allowed
            inside.set()
            release.wait(5)

    drainer = threading.Thread(target=drain_pass)
    drainer.start()
    inside.wait(5)
    capturer = threading.Thread(target=Graph([]).capture_begin)
    capturer.start()
    capturer.join(timeout=0.2)
    assert capturer.is_alive() and gate.active == 0  # not begun while our device work runs
    release.set()
    capturer.join(5)
    drainer.join(5)
    assert gate.active == 1


@pytest.mark.case("C23")
def test_drain_thread_polling_through_many_captures_never_touches_the_device_inside_one(gate):
    cap = make_captured()
    ring = DeviceRing(gate, capacity=4096)
    tracker = StepTracker(cap.telemetry, backend=ring, nvtx=False, drain_period_s=0.0005)
    gate.install(Graph)
    graph = Graph([])
    for i in range(200):
        tracker.end(tracker.begin([f"r{i}"]))  # starts the real drain thread
        graph.capture_begin()
        graph.capture_end()
    tracker.close()
    assert ring.calls > 0 and ring.during_capture == 0
    assert tracker.counts["steps"] == 200


@pytest.mark.case("C23")
def test_a_capture_that_fails_to_begin_is_not_counted_on_the_real_torch_class(gate):
    from torch.cuda.graphs import CUDAGraph

    original = vars(CUDAGraph)["capture_begin"]
    assert gate.install(CUDAGraph) and gate.install(CUDAGraph)  # idempotent
    assert vars(CUDAGraph)["capture_begin"].__wrapped__ is original
    graph = object.__new__(CUDAGraph)  # CPU torch: the C++ base is a dummy that raises
    with pytest.raises(Exception) as wrapped_error:
        CUDAGraph.capture_begin(graph)
    assert gate.active == 0
    gate.uninstall()
    assert vars(CUDAGraph)["capture_begin"] is original
    with pytest.raises(Exception) as plain_error:
        CUDAGraph.capture_begin(graph)
    assert type(plain_error.value) is type(wrapped_error.value)  # the engine sees the same error


@pytest.mark.case("C23")
def test_the_worker_launches_no_end_record_while_its_stream_captures(gate, monkeypatch):
    from llm_otel.instrumentation.vllm.worker import WorkerAdapter

    cap = make_captured()
    worker = WorkerAdapter(cap.telemetry)
    ends = []
    cap.telemetry._steps = types.SimpleNamespace(end=lambda ctx, **kw: ends.append(kw))
    monkeypatch.setattr(type(cap.telemetry), "steps", property(lambda self: self._steps), raising=False)
    monkeypatch.setattr(worker, "_cuda_stream", lambda: False)  # torch: is_current_stream_capturing()
    worker._end_step("ctx", "hook")
    assert ends == [{"stream": None, "record": False}]


def test_capturing_reads_the_current_stream_when_the_gate_saw_nothing():
    gate = CaptureGate()
    capturing = types.SimpleNamespace(is_initialized=lambda: True, is_current_stream_capturing=lambda: True)
    idle = types.SimpleNamespace(is_initialized=lambda: True, is_current_stream_capturing=lambda: False)
    assert gate.capturing(capturing) and not gate.capturing(idle)
    assert not gate.capturing()  # CPU torch: not initialised
    gate.active = 1
    assert gate.capturing(idle)


# --- C21: CuPy's kernel cache unwritable -------------------------------------------------------
class CupyCompiler:
    """Stands in for CuPy's RawModule compile path (cupy/cuda/compiler.py,
    _compile_module_with_cache -> _compile_with_cache_cuda): CUPY_CACHE_IN_MEMORY is read at each
    compilation; otherwise the binary is written under CUPY_CACHE_DIR (makedirs + a temporary file),
    which raises OSError where that is not writable. The compilation itself is nvcc -ptx when present."""

    def __init__(self):
        self.compiled = 0

    def RawModule(self, code):  # noqa: N802 - CuPy's name
        compiler = self

        class Module:
            def get_function(self, name):
                assert name in code
                if not compiler.compiled_once:
                    compiler._compile(code)
                return ("kernel", name)

        return Module()

    compiled_once = False

    def _compile(self, code):
        if shutil.which("nvcc"):
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "k.cu")
                with open(src, "w") as fh:
                    fh.write(code)
                subprocess.run(
                    ["nvcc", "-ptx", "-arch=sm_80", src, "-o", os.path.join(tmp, "k.ptx")],
                    check=True,
                    capture_output=True,
                )
        if os.environ.get("CUPY_CACHE_IN_MEMORY", "0") != "1":
            cache_dir = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
            os.makedirs(cache_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=cache_dir):
                pass
        self.compiled += 1
        self.compiled_once = True


@pytest.mark.case("C21")
def test_an_unwritable_kernel_cache_compiles_in_memory_with_one_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a path under a regular file cannot be created, even by root
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "kernel_cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    cp = CupyCompiler()
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        kernels = R.load_kernels(cp)
    assert kernels == [("kernel", R.KERNEL_NAME), ("kernel", R.TIMER_KERNEL_NAME)] and cp.compiled == 1
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(blocker / "kernel_cache") in warning and "in memory" in warning and "NotADirectoryError" in warning
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ  # the process environment is put back


@pytest.mark.case("C21")
def test_a_kernel_that_cannot_compile_at_all_falls_back_to_the_host_clock_ring(monkeypatch, caplog):
    class Broken:
        def RawModule(self, code):  # noqa: N802
            raise PermissionError(13, "Permission denied", "/home/ro/.cupy/kernel_cache")

    with pytest.raises(R.RingError) as err:
        R.load_kernels(Broken())
    assert not err.value.expected and "in memory failed too" in str(err.value)

    def cupy_ring(capacity=R.DEFAULT_CAPACITY, device=None):
        raise err.value

    monkeypatch.setattr(R, "CupyRing", cupy_ring)
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        ring = R.make_ring("auto", capacity=8)
    assert isinstance(ring, R.NumpyRing)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "kernel cache" in warnings[0].getMessage()
    ring.record(7, R.KIND_BEGIN)  # the fallback works
    assert [int(r["span_id"]) for r in ring.poll()] == [7]


def test_no_cupy_on_a_cpu_machine_stays_a_debug_line(monkeypatch, caplog):
    monkeypatch.setattr(S, "installed_cupy", lambda: (None, None))
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        ring = R.make_ring("auto", capacity=8)
    assert isinstance(ring, R.NumpyRing)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


# --- the CUDA stack ----------------------------------------------------------------------------
def test_a_cupy_for_cuda_12_beside_torch_for_cuda_13_is_named_with_the_extra_to_install(monkeypatch, caplog):
    stack = S.CudaStack(torch_cuda="13.0", cupy_dist="cupy-cuda12x", cupy_cuda_major=12)
    assert stack.mismatch
    assert stack.advice() == (
        "CuPy (cupy-cuda12x, CUDA 12) and torch (CUDA 13.0) use different CUDA majors; the GPU step ring "
        "cannot compile its kernel and step timing falls back to the host clock. "
        "Fix: pip uninstall cupy-cuda12x && pip install 'llm-otel[gpu]'"
    )
    assert "llm-otel[gpu-cu12]" in S.CudaStack("12.8", "cupy-cuda13x", 13).advice()
    monkeypatch.setattr(S, "cuda_stack", lambda import_torch=False: stack)
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        ring = R.make_ring("auto", capacity=8)
    assert isinstance(ring, R.NumpyRing)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "cupy-cuda12x" in warning and "CUDA 13.0" in warning and "llm-otel[gpu]" in warning


@pytest.mark.parametrize(
    "torch_cuda, dist, major, mismatch",
    [
        ("13.0", "cupy-cuda13x", 13, False),
        ("12.8", "cupy-cuda12x", 12, False),
        (None, "cupy-cuda12x", 12, False),
        ("13.0", "cupy", None, False),
        ("13.0", None, None, False),
        ("12.4", "cupy-cuda13x", 13, True),
    ],
)
def test_only_two_known_different_majors_are_a_mismatch(torch_cuda, dist, major, mismatch):
    assert S.CudaStack(torch_cuda, dist, major).mismatch is mismatch


def test_the_installed_cupy_wheel_is_read_from_package_metadata(monkeypatch):
    def dists(*names):
        return lambda: [types.SimpleNamespace(metadata={"Name": n}) for n in names]

    monkeypatch.setattr(S.importlib.metadata, "distributions", dists("numpy", "cupy_cuda13x"))
    assert S.installed_cupy() == ("cupy-cuda13x", 13)
    monkeypatch.setattr(S.importlib.metadata, "distributions", dists("cupy"))
    assert S.installed_cupy() == ("cupy", None)
    monkeypatch.setattr(S.importlib.metadata, "distributions", dists("torch"))
    assert S.installed_cupy() == (None, None)
    assert S.cuda_stack().torch_cuda == torch.version.cuda  # the CPU torch here: None


def test_device_records_are_skipped_not_queued_while_capturing(gate):
    cap = make_captured()
    ring = DeviceRing(gate)
    tracker = StepTracker(cap.telemetry, backend=ring, nvtx=False, start_thread=False)
    gate.active = 1
    assert tracker.begin(["a"]).recorded is False
    assert len(ring._words.nonzero()[0]) == 0 and np.all(ring._words == 0)
    gate.active = 0
    tracker.close()


def test_doctor_names_a_cupy_torch_cuda_mismatch_and_the_extra(monkeypatch, capsys):
    from llm_otel.cli import doctor

    monkeypatch.setattr(S, "cuda_stack", lambda import_torch=False: S.CudaStack("13.0", "cupy-cuda12x", 12))
    assert doctor({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}) == 0  # informational
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("[warn] CuPy (cupy-cuda12x, CUDA 12) and torch (CUDA 13.0)")
    assert "pip install 'llm-otel[gpu]'" in lines[-1]
    monkeypatch.setattr(S, "cuda_stack", lambda import_torch=False: S.CudaStack("13.0", "cupy-cuda13x", 13))
    doctor({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    assert capsys.readouterr().out.splitlines()[-1] == "[  ok] CUDA stack: torch CUDA 13.0, cupy-cuda13x (CUDA 13)"
    monkeypatch.setattr(S, "cuda_stack", lambda import_torch=False: S.CudaStack(None, None, None))
    doctor({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    assert "host clock" in capsys.readouterr().out.splitlines()[-1]


def test_a_cupy_wheel_that_does_not_import_beside_a_cuda_torch_is_a_warning(monkeypatch, caplog):
    import builtins
    import sys

    monkeypatch.setattr(S, "cuda_stack", lambda import_torch=False: S.CudaStack("13.0", "cupy-cuda13x", 13))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("CuPy failed to load libnvrtc.so.13")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        ring = R.make_ring("auto", capacity=8)
    assert isinstance(ring, R.NumpyRing)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "libnvrtc.so.13" in warning
