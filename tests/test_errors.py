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
    for rm in data.resource_metrics if data else []:
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
    assert counted(reader) == {
        ("signals.health.report", "RuntimeError"): 1,
        ("gpu.nvtx.range", "OSError"): 1,
        ("export.prometheus.exemplars", "ValueError"): 1,
    }


# Helpers a handler may hand its exception to instead of calling ``report`` itself: each reports
# or counts it (nvtx ``_fail`` and prometheus ``_warn``: process_errors().report; offload
# ``_lose``: the dropped-spans count; gpu timeline ``_ring_failed``: turns device timing off with
# one warning per ring, deliberately not a hook failure - test_gpu_steps asserts that).
REPORTING_HELPERS = {"_fail", "_warn", "_lose", "_ring_failed"}


def _broad_handlers(path: pathlib.Path):
    """``except Exception`` / ``except BaseException`` / bare ``except`` handlers of one module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ExceptHandler):
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if node.type is None or any(getattr(t, "id", None) in ("Exception", "BaseException") for t in types):
                yield node


def _uncounted_handlers(path: pathlib.Path, root: pathlib.Path = SRC) -> list[str]:
    """Broad handlers that neither report (``.report(``/``.bad_input(``), re-raise, hand the
    exception to a reporting helper, nor say on their ``except`` line why they are silent
    (``# ... silent: <why>``: a feature probe, exit cleanup, a failure counted elsewhere);
    and, silent or not, every handler that logs without counting."""
    lines = path.read_text().splitlines()
    found = []
    for node in _broad_handlers(path):
        body = ast.Module(body=node.body, type_ignores=[])
        calls = [ast.unparse(c.func) for c in ast.walk(body) if isinstance(c, ast.Call)]
        counted = any(
            c.endswith((".report", ".bad_input")) or c.rsplit(".", 1)[-1] in REPORTING_HELPERS for c in calls
        ) or any(isinstance(n, ast.Raise) for n in ast.walk(body))
        logs = any(c.startswith(("logger.", "logging.")) for c in calls)
        silent = "silent:" in lines[node.lineno - 1]
        if (logs and not counted) or not (counted or silent):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_broad_except_in_the_package_counts_its_failure_or_says_why_it_is_silent():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 80
    assert [site for p in files for site in _uncounted_handlers(p)] == []


def test_the_handler_check_catches_log_only_and_unexplained_silent_handlers(tmp_path):
    """The check itself: a log-only handler and a bare ``pass`` fail it; a counted one, a
    re-raise and a ``# silent:`` one pass; ``silent:`` does not excuse logging without counting."""
    module = tmp_path / "probe.py"
    module.write_text(
        "try:\n    x()\nexcept Exception as exc:  # noqa: BLE001\n    logger.warning('x %s', exc)\n"
        "try:\n    x()\nexcept Exception:  # noqa: BLE001\n    pass\n"
        "try:\n    x()\nexcept Exception as exc:  # noqa: BLE001\n    errors.report('s', exc)\n"
        "try:\n    x()\nexcept BaseException:\n    raise\n"
        "try:\n    x()\nexcept Exception:  # noqa: BLE001 - silent: feature probe\n    pass\n"
        "try:\n    x()\nexcept Exception:  # silent: but logs\n    logger.debug('x')\n"
    )
    assert _uncounted_handlers(module, tmp_path) == ["probe.py:3", "probe.py:7", "probe.py:23"]
