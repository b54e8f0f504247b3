"""An exporter process that cannot run (its interpreter exits at once: a wrong ``sys.executable``
under an embedding server, a crash at import) is restarted for the next spans, and is one outage in
the log, not a line per restart (fresh-install review of issue 19, F6). Real exporter-process
launch path (``OffloadBuffer``), the tests' OTLP receiver as the collector."""

from __future__ import annotations

import logging
import sys
import time

from llm_otel.config import Settings
from llm_otel.process.providers import build_providers


def test_an_exporter_process_that_keeps_dying_is_one_outage_in_the_log(receiver, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="llm_otel")
    receiver.clear()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_METRICS_EXPORTER": "none",
    }
    tp, _ = build_providers(Settings(console="off", adaptive_sampling="off"), env, shutdown_on_exit=False)
    tp.buffer.respawn_s = 0.3  # the production 5 s, compressed: about ten restart attempts
    monkeypatch.setattr(sys, "executable", "/bin/false")
    tracer = tp.get_tracer("t")
    for _ in range(60):
        tracer.start_span("s").end()
        time.sleep(0.05)
    tp.shutdown(timeout_millis=1000)
    lines = [r.getMessage() for r in caplog.records if r.name == "llm_otel" and r.levelno == logging.WARNING]
    assert 1 <= len(lines) <= 2, "\n".join(lines)
