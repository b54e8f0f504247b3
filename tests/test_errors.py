"""One failure style: a failure inside llm-otel is counted in ``llm_otel.instrumentation.errors``
and logged once per site (llm_otel.errors: HookErrors, guard, process_errors)."""

from __future__ import annotations

import ast
import logging
import pathlib

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from llm_otel import errors as E
from llm_otel.errors import HookErrors, guard, process_errors

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "llm_otel"


def counted(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    """``llm_otel.instrumentation.errors`` points: (hook, error.type) -> count."""
    out = {}
    data = reader.get_metrics_data()
    for rm in (data.resource_metrics if data else []):
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == "llm_otel.instrumentation.errors":
                    for p in m.data.data_points:
                        out[(p.attributes["llm.instrumentation.hook"], p.attributes["error.type"])] = p.value
    return out


@pytest.fixture
def metered():
    """A HookErrors with a meter: this process's process_errors() while the test runs."""
    reader = InMemoryMetricReader()
    errors = HookErrors(MeterProvider(metric_readers=[reader]).get_meter("t"))
    assert process_errors() is errors
    return errors, reader


def test_guard_swallows_and_counts_every_failure_and_logs_each_site_once(metered, caplog):
    errors, reader = metered
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        for _ in range(3):
            with guard("test.site") as g:
                raise ValueError("boom")
            assert g.failed
        with guard("test.other", errors, message="the other site failed; nothing is lost") as g:
            raise KeyError("k")
        with guard("test.site") as ok:
            pass
    assert not ok.failed
    assert counted(reader) == {("test.site", "ValueError"): 3, ("test.other", "KeyError"): 1}
    lines = [r for r in caplog.records if r.name == "llm_otel"]
    assert len(lines) == 2
    assert "test.site" in lines[0].getMessage() and lines[0].exc_info is not None  # a bug: its traceback
    assert lines[1].getMessage().startswith("llm-otel: the other site failed; nothing is lost (KeyError: 'k')")
    assert lines[1].exc_info is None  # a message says what it costs: one line


def test_guard_lets_keyboard_interrupt_and_system_exit_through(metered):
    errors, reader = metered
    with pytest.raises(KeyboardInterrupt):
        with guard("test.interrupt"):
            raise KeyboardInterrupt
    assert counted(reader) == {}


def test_failures_before_the_first_metered_hook_errors_are_counted_into_it_and_not_logged_twice(caplog):
    E._default = None  # a process where no Telemetry exists yet
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        process_errors().report("test.early", RuntimeError("x"), "early failure")
        process_errors().report("test.early", RuntimeError("x"), "early failure")
        reader = InMemoryMetricReader()
        errors = HookErrors(MeterProvider(metric_readers=[reader]).get_meter("t"))
        errors.report("test.early", RuntimeError("x"), "early failure")
    assert process_errors() is errors
    assert counted(reader)[("test.early", "RuntimeError")] == 3
    assert sum("early failure" in r.getMessage() for r in caplog.records) == 1


def test_converted_sites_report_through_process_errors(metered, caplog):
    """Three of the sites that used to log only (or nothing): the /healthz report, an NVTX range
    call, Prometheus exemplars. Each keeps its behaviour (503, ranges off, metrics without
    exemplars) and is now counted."""
    from llm_otel.export.prometheus import ExemplarPrometheusMetricReader
    from llm_otel.gpu.nvtx import NvtxRanges
    from llm_otel.signals.health import HealthServer

    errors, reader = metered

    def broken():
        raise RuntimeError("signal broke")

    server = HealthServer(broken, port=0)
    try:
        assert server.response() == (503, {"status": "unhealthy", "reasons": ["health report failed: RuntimeError"]})
    finally:
        server._httpd.server_close()  # never started serving: nothing to shut down

    class Domain:  # nvtx's Domain: get_event_attributes(...) then push_range(attributes)
        def get_event_attributes(self, **kwargs):
            return kwargs

        def push_range(self, attributes):
            raise OSError("nvtx broke")

    ranges = NvtxRanges(domain=Domain())
    ranges.begin_step(1)
    assert not ranges.active
    ExemplarPrometheusMetricReader()._warn(ValueError("index"))
    assert counted(reader) == {("signals.health.report", "RuntimeError"): 1, ("gpu.nvtx.range", "OSError"): 1,
                               ("export.prometheus.exemplars", "ValueError"): 1}


# Modules converted to the one style (issue 21); the rest of src/ follows once the moves land.
UNIFORM = ["export", "gpu", "telemetry/record.py", "telemetry/metrics.py", "telemetry/logits.py",
           "signals/health.py", "instrumentation/_hooks.py"]


def _logged_only_handlers(path: pathlib.Path) -> list[str]:
    """Broad ``except Exception`` handlers that log without counting (no ``.report(``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ExceptHandler):
            continue
        types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        if not any(getattr(t, "id", None) in ("Exception", "BaseException") for t in types if t is not None):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        calls = [ast.unparse(c.func) for c in ast.walk(body) if isinstance(c, ast.Call)]
        if any(c.startswith("logger.") for c in calls) and not any(c.endswith(".report") for c in calls) \
                and not any(isinstance(n, ast.Raise) for n in ast.walk(body)):
            found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_no_broad_except_in_the_converted_modules_only_logs():
    files = [p for entry in UNIFORM for p in ((SRC / entry).rglob("*.py") if (SRC / entry).is_dir() else [SRC / entry])]
    assert len(files) > 10
    assert [site for p in files for site in _logged_only_handlers(p)] == []
