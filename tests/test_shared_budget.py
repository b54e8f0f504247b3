"""The trace budget is per server, not per process (issue 29, CASES.md C27): the API servers of one
``vllm serve --api-server-count N`` share one :class:`SharedTraceBudget`. Real processes share the
budget's file; time is a shared decision counter (one decision = 1/600 s, so three processes make
600 root decisions per second together), so the counts do not depend on how fast this machine runs
them. Expected kept traces (the sum of the probabilities used: what the budget bounds) and kept
traces (randomness >= threshold) are both counted."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import signal
import uuid

import pytest
from opentelemetry.sdk.trace._sampling_experimental._util import MAX_THRESHOLD

from llm_otel.sampling import SharedTraceBudget, trace_budget

PROCESSES, DECISIONS, DT = 3, 2000, 1 / 600  # 6,000 decisions over 10 s at 600/s, budget 10/s


def _server(key: str, directory: str, counter, out) -> None:
    def clock() -> float:
        with counter.get_lock():
            counter.value += 1
            return counter.value * DT

    budget = trace_budget(10.0, key=key, directory=directory)
    rng = random.Random(os.getpid())
    expected = kept = 0.0
    for _ in range(DECISIONS):
        threshold, _ = budget.limit(0, now=clock())
        expected += (MAX_THRESHOLD - threshold) / MAX_THRESHOLD
        kept += rng.getrandbits(56) >= threshold
    outliers = sum(budget.take_outlier(now=1000.0) for _ in range(100))  # one instant for all
    out.put((expected, kept, outliers))


def _run(key: str, directory: str) -> tuple[float, float, int]:
    ctx = multiprocessing.get_context("fork")
    counter, out = ctx.Value("d", 0.0), ctx.Queue()
    keys = [key] * PROCESSES if key else [""] * PROCESSES
    procs = [ctx.Process(target=_server, args=(k, directory, counter, out)) for k in keys]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return sum(r[0] for r in results), sum(r[1] for r in results), sum(r[2] for r in results)


@pytest.mark.case("C27")
def test_api_servers_of_one_launcher_keep_one_budget_between_them(tmp_path):
    expected, kept, outliers = _run(f"t-{uuid.uuid4().hex}", str(tmp_path))
    seconds = PROCESSES * DECISIONS * DT
    bound = 10 + 10.0 * seconds + PROCESSES * DECISIONS * 2**-12  # capacity + refill + minimum p
    assert 0.7 * 10.0 * seconds < expected <= bound, expected
    assert 0.5 * 10.0 * seconds < kept < 1.6 * bound, kept
    # the outlier bound is shared too: a burst at one instant keeps the bucket (10), not 3 x 10
    assert outliers == 10, outliers
    # per-process budgets (what each API server kept before): over the per-server bound (130-210
    # here, by how the processes interleave), and N buckets of outliers
    alone_expected, _, alone_outliers = _run("", str(tmp_path))
    assert alone_expected > bound and alone_outliers == PROCESSES * 10, (alone_expected, alone_outliers)


def _hold_lock(path: str, ready, stop: bool) -> None:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    if stop:
        signal.pause()  # holds the lock until killed (a stopped or hung holder)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding it


@pytest.mark.case("C27")
def test_a_dead_or_hung_lock_holder_never_blocks_a_decision(tmp_path):
    budget = SharedTraceBudget(10.0, key="crash", directory=str(tmp_path))
    assert budget.limit(0, now=1.0) == (0, False) and budget.path is not None
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    dead = ctx.Process(target=_hold_lock, args=(budget.path, ready, False))
    dead.start()
    dead.join(30)
    assert dead.exitcode == -signal.SIGKILL
    assert budget._locked(None)[0]  # the kernel released the dead holder's lock: shared again
    ready.clear()
    hung = ctx.Process(target=_hold_lock, args=(budget.path, ready, True))
    hung.start()
    try:
        assert ready.wait(30)
        assert budget._locked(None)[0] is False  # busy: not waited for
        threshold, _ = budget.limit(0, now=1.1)  # decided on this process's copy of the state
        assert 0 <= threshold < MAX_THRESHOLD
    finally:
        hung.kill()
        hung.join(30)
    assert budget._locked(None)[0]


@pytest.mark.case("C27")
def test_only_api_servers_of_a_launcher_get_a_shared_key(monkeypatch):
    from llm_otel.process import identity

    monkeypatch.setattr(identity, "tracked_identity", lambda: {"llm.process.role": "frontend"})
    assert identity.server_budget_key() is None
    monkeypatch.setattr(identity, "tracked_identity", lambda: {"llm.process.api_server.index": 1})
    key = identity.server_budget_key()
    assert key is not None and key.startswith(f"launcher-{os.getppid()}-")
    with open(f"/proc/{os.getppid()}/stat", "rb") as f:
        assert key.endswith("-" + f.read().rsplit(b")", 1)[1].split()[19].decode())
