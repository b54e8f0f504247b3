"""An exporter process that cannot run (its interpreter exits at once: a wrong ``sys.executable``
under an embedding server, a crash at import) is restarted for the next spans, and is one outage in
the log, not a line per restart (fresh-install review of issue 19, F6). Real exporter-process
launch path (``OffloadBuffer``), the tests' OTLP receiver as the collector."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from llm_otel.config import Settings
from llm_otel.process.providers import build_providers


def test_an_exporter_process_that_keeps_dying_is_one_outage_in_the_log(receiver, caplog, monkeypatch):
    """Processes really start again (new pids, each the interpreter the serving process names,
    each exited, at most one a respawn interval), the log says so once, and once the interpreter
    works the next restart is a live exporter process that delivers."""
    caplog.set_level(logging.WARNING, logger="llm_otel")
    receiver.clear()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_METRICS_EXPORTER": "none",
    }
    tp, _ = build_providers(Settings(console="off", adaptive_sampling="off"), env, shutdown_on_exit=False)
    buffer = tp.buffer
    buffer.respawn_s = 0.3  # the production 5 s, compressed: about ten restart attempts
    started: list[tuple[float, subprocess.Popen]] = []  # every exporter process the buffer started
    real_process = buffer._process  # noqa: SLF001 - the buffer's own launch path, observed

    def observed_process():
        proc = real_process()
        if proc is not None and (not started or started[-1][1] is not proc):
            started.append((time.monotonic(), proc))
        return proc

    monkeypatch.setattr(buffer, "_process", observed_process)
    interpreter = sys.executable
    monkeypatch.setattr(sys, "executable", "/bin/false")
    tracer = tp.get_tracer("t")
    try:
        for _ in range(60):
            tracer.start_span("s").end()
            time.sleep(0.05)
        dead = list(started)
        lines = [r.getMessage() for r in caplog.records if r.name == "llm_otel" and r.levelno == logging.WARNING]
        # the interpreter works again (fixed deployment): the next restart is a live exporter process
        monkeypatch.setattr(sys, "executable", interpreter)
        deadline = time.monotonic() + 30
        while not receiver.spans(name="after") and time.monotonic() < deadline:
            tracer.start_span("after").end()
            time.sleep(0.1)
        assert receiver.wait_for_spans(1, name="after", timeout=10)
        (_, live), *_ = started[len(dead) :]
    finally:
        tp.shutdown(timeout_millis=5000)
    assert 1 <= len(lines) <= 2, "\n".join(lines)
    # restarted, not only logged: 3 s of spans at one attempt per 0.3 s is about ten processes
    print(f"\n{len(dead)} exporter processes started and exited in 3 s, then pid {live.pid} delivered")
    assert len(dead) >= 5, [p.pid for _, p in dead]
    assert len({p.pid for _, p in dead}) == len(dead)
    assert all(p.args[0] == "/bin/false" and p.wait(5) == 1 for _, p in dead)
    gaps = [b - a for (a, _), (b, _) in zip(dead, dead[1:])]
    assert min(gaps) >= 0.3 * 0.9, gaps  # one attempt per respawn interval, not one per span
    assert live.args[0] == interpreter and live.pid not in {p.pid for _, p in dead}
