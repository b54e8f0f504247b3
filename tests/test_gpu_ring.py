"""The step-record ring buffer (llm_otel.gpu.ring): NumPy backend, the shared reader, the CUDA
kernel source compiled to PTX by nvcc, and backend choice without a GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import tools

from llm_otel.gpu import ring as R


def test_records_come_back_in_order_with_host_timestamps():
    ring = R.NumpyRing(capacity=8)
    for sid in (11, 12, 13):
        ring.record(sid, R.KIND_BEGIN)
        ring.record(sid, R.KIND_END)
    recs = ring.poll()
    assert [(int(r["span_id"]), int(r["kind"])) for r in recs] == [(11, 1), (11, 2), (12, 1), (12, 2), (13, 1), (13, 2)]
    ts = recs["timestamp"].astype(np.int64)
    assert (np.diff(ts) >= 0).all()
    assert (recs["aux"] == recs["timestamp"]).all()  # host clock: launch == execution
    assert list(recs["seq"]) == [1, 2, 3, 4, 5, 6]
    assert len(ring.poll()) == 0  # read once


def test_span_ids_keep_all_64_bits():
    ring = R.NumpyRing(capacity=4)
    ring.record((1 << 64) - 1, R.KIND_BEGIN)
    ring.record(1 << 63, R.KIND_END)
    assert [int(r["span_id"]) for r in ring.poll()] == [(1 << 64) - 1, 1 << 63]


def test_overflow_overwrites_the_oldest_and_counts_them_without_blocking():
    ring = R.NumpyRing(capacity=4)
    for i in range(10):
        ring.record(100 + i, R.KIND_BEGIN)
    recs = ring.poll()
    assert [int(r["span_id"]) for r in recs] == [106, 107, 108, 109]
    assert ring.overwritten == 6
    ring.record(200, R.KIND_END)
    assert [int(r["span_id"]) for r in ring.poll()] == [200] and ring.overwritten == 6


def test_a_claimed_but_unwritten_slot_is_read_on_the_next_pass():
    words = np.zeros((4, R.RECORD_WORDS), dtype=np.uint64)
    reader = R._Reader(4)
    words[0] = (1, 1, 10, 10, 1)
    words[1] = (1, 2, 20, 20, 0)  # writer claimed index 1 but has not written seq yet
    assert [int(r["timestamp"]) for r in reader.collect(words, 2)] == [10]
    words[1, 4] = 2
    assert [int(r["timestamp"]) for r in reader.collect(words, 2)] == [20]


def test_a_slot_overwritten_during_the_read_is_counted_not_returned():
    words = np.zeros((2, R.RECORD_WORDS), dtype=np.uint64)
    reader = R._Reader(2)
    words[0] = (5, 1, 10, 10, 3)  # index 0's slot already holds index 2 (seq 3)
    words[1] = (6, 1, 11, 11, 2)
    recs = reader.collect(words, 2)
    assert [int(r["span_id"]) for r in recs] == [6] and reader.overwritten == 1


def test_writers_on_many_threads_lose_nothing_within_capacity():
    ring = R.NumpyRing(capacity=4096)

    def write(base):
        for i in range(500):
            ring.record(base + i, R.KIND_BEGIN)

    threads = [threading.Thread(target=write, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = ring.poll()
    assert len(recs) == 2000 and ring.overwritten == 0
    assert sorted(int(s) for s in recs["span_id"]) == sorted(k * 10_000 + i for k in range(4) for i in range(500))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=2, max_value=16),
    st.lists(st.tuples(st.integers(min_value=0, max_value=40), st.booleans()), min_size=1, max_size=30),
)
def test_reader_returns_exactly_the_unread_records_still_in_the_ring(capacity, plan):
    ring = R.NumpyRing(capacity=capacity)
    written = 0
    got: list[int] = []
    for n_writes, read in plan:
        for _ in range(n_writes):
            ring.record(written, R.KIND_BEGIN)
            written += 1
        if read:
            got.extend(int(s) for s in ring.poll()["span_id"])
    got.extend(int(s) for s in ring.poll()["span_id"])
    assert got == sorted(got) and len(set(got)) == len(got)  # in order, no duplicates
    assert len(got) + ring.overwritten == written  # every record read or counted as lost
    assert got[-min(capacity, written) :] == list(range(max(0, written - capacity), written))


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError):
        R.NumpyRing(capacity=1)


# --- the CUDA kernel --------------------------------------------------------------------------
def test_kernel_source_compiles_to_ptx_with_nvcc(tmp_path):
    nvcc = tools.binary(
        "nvcc", "the CUDA toolkit's compiler compile-checks the kernel source (the machine image has it)"
    )
    src = tmp_path / "ring.cu"
    src.write_text(R.KERNEL_SOURCE)
    out = tmp_path / "ring.ptx"
    proc = subprocess.run([nvcc, "--ptx", "-o", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"nvcc failed:\n{proc.stderr}"
    ptx = out.read_text()
    assert f".entry {R.KERNEL_NAME}(" in ptx and f".entry {R.TIMER_KERNEL_NAME}(" in ptx
    assert "%globaltimer" in ptx  # device clock read
    assert "atom.global.add.u64" in ptx  # slot claimed atomically on the device head counter
    assert ptx.count(".param .u64") >= 7  # six record arguments (64-bit) + the timer's output


def test_without_cupy_or_gpu_auto_uses_the_host_ring_and_cupy_is_refused():
    has_gpu = False
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:  # noqa: BLE001
            has_gpu = False
    if has_gpu:
        pytest.skip("a GPU is present: benchmarks/gpu/device_check.sh covers the CuPy ring")
    assert isinstance(R.make_ring("auto"), R.NumpyRing)
    with pytest.raises(R.RingError):
        R.make_ring("cupy")
    assert R.make_ring("off") is None
    with pytest.raises(ValueError):
        R.make_ring("tpu")
