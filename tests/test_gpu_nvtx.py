"""NVTX ranges with span-id payloads (llm_otel.gpu.nvtx) against the real ``nvtx`` package.

Without an NVTX tool attached (this machine has no Nsight) the package hands out a dummy domain;
the payload conversion is checked on the package's real ``EventAttributes`` (the Cython struct that
the tool reads), and the range calls on a domain object with ``nvtx.Domain``'s methods that keeps
what it was given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import tools

from llm_otel.gpu.nvtx import (
    DOMAIN,
    REQUEST_MESSAGE,
    STEP_MESSAGE,
    NvtxRanges,
    int64_to_span_id,
    request_payload,
    span_id_to_int64,
)

nvtx = pytest.importorskip("nvtx")
from nvtx._lib.lib import DummyDomain, EventAttributes, dummy_domain  # noqa: E402


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_span_id_payload_is_a_signed_int64_that_maps_back(span_id):
    value = span_id_to_int64(span_id)
    assert -(1 << 63) <= value < (1 << 63)
    assert int64_to_span_id(value) == span_id
    assert value.to_bytes(8, "little", signed=True) == span_id.to_bytes(8, "little")  # same 64 bits


def test_high_span_ids_become_negative_and_the_real_nvtx_struct_accepts_them():
    span_id = 0xF067AA0BA902B7FF  # >= 2**63
    value = span_id_to_int64(span_id)
    assert value == span_id - (1 << 64) < 0
    attrs = EventAttributes(dummy_domain, None, None, None, value)
    assert attrs.payload == value
    with pytest.raises(OverflowError):  # why the conversion is needed: the package stores int64
        EventAttributes(dummy_domain, None, None, None, span_id)


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_values_outside_uint64_are_refused(bad):
    with pytest.raises(ValueError):
        span_id_to_int64(bad)


def test_request_payload_carries_the_full_trace_id_and_span_id():
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    p = request_payload(trace_id, 0x00F067AA0BA902B7)
    assert p.dtype.names == ("trace_id_hi", "trace_id_lo", "span_id") and p.nbytes == 24 and p.ndim == 0
    assert (int(p["trace_id_hi"]) << 64) | int(p["trace_id_lo"]) == trace_id
    assert int(p["span_id"]) == 0x00F067AA0BA902B7
    assert hasattr(nvtx, "numpy_dtype")  # this nvtx version has structured (extended) payloads


def test_without_a_tool_the_real_package_gives_a_dummy_domain_and_ranges_are_off():
    assert isinstance(nvtx.get_domain(DOMAIN), DummyDomain)
    ranges = NvtxRanges()
    assert ranges.active is False
    ranges.begin_step(1 << 63, "decode")  # all no-ops, nothing raised
    ranges.end_step(1 << 63)
    ranges.start_request("r", 1, 2)
    ranges.end_request("r")
    assert ranges.open_requests == 0


def test_disabled_by_setting_even_with_a_domain():
    ranges = NvtxRanges(enabled=False, domain=RecordingDomain())
    ranges.begin_step(5)
    assert ranges.active is False and ranges._domain is None


class RecordingDomain:
    """The ``nvtx.Domain`` methods NvtxRanges uses (nvtx/_lib/lib.pyx: Domain.get_event_attributes,
    push_range, pop_range, start_range, end_range); keeps each call. Int payloads go through the
    real EventAttributes struct."""

    def __init__(self):
        self.calls = []
        self.categories: dict[str, int] = {}
        self._next_range = 100

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        if isinstance(category, str):
            category = self.categories.setdefault(category, len(self.categories) + 1)
        if isinstance(payload, int):
            EventAttributes(dummy_domain, None, None, category, payload)  # raises on a bad payload
        return {"message": message, "category": category, "payload": payload}

    def push_range(self, attrs):
        self.calls.append(("push", attrs))

    def pop_range(self):
        self.calls.append(("pop", None))

    def start_range(self, attrs):
        self._next_range += 1
        self.calls.append(("start", attrs, self._next_range))
        return self._next_range

    def end_range(self, range_id):
        self.calls.append(("end", range_id))


def test_step_range_has_a_fixed_message_phase_category_and_the_step_span_id_payload():
    domain = RecordingDomain()
    ranges = NvtxRanges(domain=domain)
    sid = 0xE3E70682C2094CAC
    ranges.begin_step(sid, "prefill")
    ranges.end_step(sid)
    (push, attrs), (pop, _) = domain.calls
    assert push == "push" and pop == "pop"
    assert attrs["message"] == STEP_MESSAGE == "llm.engine.step"
    assert attrs["category"] == domain.categories["prefill"]
    assert int64_to_span_id(attrs["payload"]) == sid


def test_ids_never_appear_in_messages():
    domain = RecordingDomain()
    ranges = NvtxRanges(domain=domain)
    for i in range(50):
        ranges.begin_step(0x1234_0000 + i)
        ranges.end_step(0x1234_0000 + i)
        ranges.start_request(f"req-{i}", 0xABCDEF << 64 | i, 0x5555 + i)
    messages = {c[1]["message"] for c in domain.calls if c[0] in ("push", "start")}
    assert messages == {STEP_MESSAGE, REQUEST_MESSAGE}  # two registered strings, however many ids


def test_request_range_starts_once_and_ends_from_another_thread():
    domain = RecordingDomain()
    ranges = NvtxRanges(domain=domain)
    trace_id, span_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    ranges.start_request("r1", trace_id, span_id)
    ranges.start_request("r1", trace_id, span_id)  # its second step: no second range
    starts = [c for c in domain.calls if c[0] == "start"]
    assert len(starts) == 1
    payload = starts[0][1]["payload"]
    assert isinstance(payload, np.ndarray) and int(payload["span_id"]) == span_id
    t = threading.Thread(target=ranges.end_request, args=("r1",))
    t.start()
    t.join()
    assert domain.calls[-1] == ("end", starts[0][2])
    ranges.end_request("r1")  # unknown now: ignored
    assert ranges.open_requests == 0


def test_end_step_on_another_thread_does_not_pop_someone_elses_range():
    domain = RecordingDomain()
    ranges = NvtxRanges(domain=domain)
    ranges.begin_step(7)
    t = threading.Thread(target=ranges.end_step, args=(7,))
    t.start()
    t.join()
    assert [c[0] for c in domain.calls] == ["push"]
    ranges.end_step(7)
    assert [c[0] for c in domain.calls] == ["push", "pop"]


def test_a_failing_domain_turns_ranges_off_with_one_log_line(caplog):
    class Broken(RecordingDomain):
        def push_range(self, attrs):
            raise RuntimeError("tool went away")

    ranges = NvtxRanges(domain=Broken())
    with caplog.at_level("WARNING", logger="llm_otel"):
        ranges.begin_step(1)
        ranges.begin_step(2)
    assert ranges.active is False
    assert len([r for r in caplog.records if "NVTX ranges turned off" in r.getMessage()]) == 1


# --- with a real NVTX tool attached ---------------------------------------------------------
NVTX_HEADERS = [
    d
    for d in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda")
    if d and os.path.exists(os.path.join(d, "include", "nvtx3", "nvToolsExt.h"))
]

TOOL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from conftest import make_captured
    from llm_otel.telemetry.steps import StepTracker
    cap = make_captured()
    steps = StepTracker(cap.telemetry, backend="numpy", nvtx=True, start_thread=False)
    assert steps.nvtx.active, "the nvtx package did not see the tool"
    req = cap.telemetry.tracer.start_span("text_completion m").get_span_context()
    ctx = steps.begin(["r1"], phase="decode", request_spans={"r1": (req.trace_id, req.span_id)})
    steps.end(ctx)
    steps.end_requests(["r1"])
    steps.close()
    print(ctx.span_id, req.trace_id, req.span_id)
""")


@pytest.fixture(scope="module")
def nvtx_tool(tmp_path_factory):
    """tests/nvtx_tool/recorder.c built as an NVTX injection library (what Nsight attaches)."""
    cc = tools.require("a C compiler", shutil.which("cc") or shutil.which("gcc"), "apt-get install gcc")
    tools.require(
        "the NVTX 3 headers", NVTX_HEADERS, "the CUDA toolkit's include/nvtx3 under $CUDA_HOME or /usr/local/cuda"
    )
    lib = tmp_path_factory.mktemp("nvtx") / "librecorder.so"
    src = os.path.join(os.path.dirname(__file__), "nvtx_tool", "recorder.c")
    proc = subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-I",
            os.path.join(NVTX_HEADERS[0], "include"),
            "-o",
            str(lib),
            src,
            "-lpthread",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return lib


def test_with_a_tool_attached_the_real_package_carries_the_step_and_request_ids(nvtx_tool, tmp_path):
    record = tmp_path / "nvtx.txt"
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(nvtx_tool), LLM_OTEL_NVTX_RECORD=str(record))
    env.pop("NVTX_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, "-c", TOOL_SCRIPT, os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    step_span_id, trace_id, request_span_id = map(int, proc.stdout.split())
    lines = [line.split() for line in record.read_text().splitlines()]
    categories = {int(line[2]): line[3] for line in lines if line[0] == "category"}
    (push,) = [line for line in lines if line[0] == "push"]
    assert push[1:3] == ["llm_otel", "llm.engine.step"] and categories[int(push[3])] == "decode"
    assert push[4] == "2"  # NVTX_PAYLOAD_TYPE_INT64
    assert int64_to_span_id(int(push[5])) == step_span_id
    assert ["pop", "llm_otel"] in lines
    (start,) = [line for line in lines if line[0] == "start"]
    assert start[1:3] == ["llm_otel", "llm.request"]
    assert int(start[4]) & 0xFFFFFFFF == 0xDFBD0009  # NVTX_PAYLOAD_TYPE_EXT: a structured payload
    raw = bytes.fromhex(start[5])
    assert len(raw) == 24
    hi, lo, sid = (int.from_bytes(raw[i : i + 8], "little") for i in (0, 8, 16))
    assert (hi << 64 | lo, sid) == (trace_id, request_span_id)
    assert ["end", start[6]] in lines  # the same range ended
    assert {line[2] for line in lines if line[0] in ("push", "start")} == {"llm.engine.step", "llm.request"}
