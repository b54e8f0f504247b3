"""Hook tables: missing targets are skipped with one warning; removal restores attributes exactly."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from llm_otel.instrumentation._hooks import Hook, apply_hooks, remove_hooks


class Adapter:
    def __init__(self):
        self.calls = []

    def tracer(self, qualname):
        def wrapper(wrapped, instance, args, kwargs):
            self.calls.append(qualname)
            return wrapped(*args, **kwargs)

        return wrapper


@pytest.fixture
def engine_module(monkeypatch):
    mod = types.ModuleType("fake_engine_layout")

    class Engine:
        def step(self, x):
            return x + 1

        @staticmethod
        def make(x):
            return x * 2

    class Child(Engine):
        pass

    mod.Engine, mod.Child = Engine, Child
    monkeypatch.setitem(sys.modules, "fake_engine_layout", mod)
    return mod


@pytest.mark.case("C05")
def test_missing_targets_warn_once_each_and_the_rest_keeps_working(engine_module, caplog):
    hooks = [
        Hook("fake_engine_layout", "Engine.step", "tracer", "test", ""),
        Hook("fake_engine_layout", "Engine.renamed_step", "tracer", "test", ""),
        Hook("fake_engine_layout.moved_module", "Engine.step", "tracer", "test", ""),
        Hook("fake_engine_layout", "Child.step", "tracer", "test", ""),  # inherited: not ours to patch
    ]
    adapter = Adapter()
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        applied = apply_hooks(hooks, adapter, "FakeEngine")
    assert [a.hook.target for a in applied] == ["Engine.step"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert any("fake_engine_layout:Engine.renamed_step" in w for w in warnings)
    assert any("fake_engine_layout.moved_module:Engine.step" in w for w in warnings)
    assert engine_module.Engine().step(1) == 2 and adapter.calls == ["fake_engine_layout:Engine.step"]
    remove_hooks(applied)


def test_removal_restores_the_exact_attribute_including_staticmethods(engine_module):
    original_step = vars(engine_module.Engine)["step"]
    original_make = vars(engine_module.Engine)["make"]
    hooks = [
        Hook("fake_engine_layout", "Engine.step", "tracer", "t", ""),
        Hook("fake_engine_layout", "Engine.make", "tracer", "t", ""),
    ]
    adapter = Adapter()
    applied = apply_hooks(hooks, adapter, "FakeEngine")
    assert vars(engine_module.Engine)["step"] is not original_step
    assert engine_module.Engine.make(3) == 6 and engine_module.Engine().make(3) == 6
    remove_hooks(applied)
    assert vars(engine_module.Engine)["step"] is original_step
    assert vars(engine_module.Engine)["make"] is original_make
    assert isinstance(vars(engine_module.Engine)["make"], staticmethod)


def test_alternative_layouts_of_one_function_warn_only_when_none_resolves(engine_module, caplog):
    hooks = [
        Hook("fake_engine_layout.old_module", "Engine.step", "tracer", "old", "", group="step"),
        Hook("fake_engine_layout", "Engine.step", "tracer", "new", "", group="step"),
        Hook("fake_engine_layout.gone", "Engine.step", "tracer", "old", "", group="other"),
    ]
    with caplog.at_level(logging.WARNING, logger="llm_otel"):
        applied = apply_hooks(hooks, Adapter(), "FakeEngine")
    assert [a.hook.layout for a in applied] == ["new"]
    assert [r.getMessage().split(" hook target ")[1].split(" ")[0] for r in caplog.records] == [
        "fake_engine_layout.gone:Engine.step"
    ]
    remove_hooks(applied)


def test_a_missing_optional_dependency_is_one_debug_line_a_moved_target_one_warning(tmp_path, monkeypatch, caplog):
    """A module of the engine that cannot load because another package is not installed (an
    optional part, e.g. tritonclient without grpc) is not the engine moving a target: debug only.
    A missing engine submodule or attribute is: one warning each, naming it."""
    pkg = tmp_path / "fake_engine_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "needs_extra.py").write_text("import fake_absent_extra_dependency\n")
    (pkg / "present.py").write_text("class Client:\n    def infer(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = [
        Hook("fake_engine_pkg.needs_extra", "Client.infer", "tracer", "x", "p"),
        Hook("fake_engine_pkg.needs_extra", "Client.stream", "tracer", "x", "p"),
        Hook("fake_engine_pkg.moved", "Client.infer", "tracer", "x", "p"),
        Hook("fake_engine_pkg.present", "Client.gone", "tracer", "x", "p"),
        Hook("fake_engine_pkg.present", "Client.infer", "tracer", "x", "p"),
    ]
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        applied = apply_hooks(hooks, Adapter(), "FakeEngine")
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        assert [a.hook.target for a in applied] == ["Client.infer"]
        assert len(warnings) == 2
        assert (
            "fake_engine_pkg.moved:Client.infer" in warnings[0] and "fake_engine_pkg.present:Client.gone" in warnings[1]
        )
        assert len(debug) == 1 and "fake_absent_extra_dependency is not installed" in debug[0]
    finally:
        remove_hooks(applied)
        for name in [m for m in sys.modules if m.startswith("fake_engine_pkg")]:
            del sys.modules[name]


@pytest.mark.parametrize(
    "path, package",
    [
        ("llm_otel.instrumentation.vllm:VLLMInstrumentor", "vllm"),
        ("llm_otel.instrumentation.triton:TritonClientInstrumentor", "tritonclient"),
        ("llm_otel.instrumentation.lightllm:LightLLMInstrumentor", "lightllm"),
    ],
)
def test_an_instrumentor_whose_library_is_not_importable_is_silent(path, package):
    """``opentelemetry-instrument`` loads every installed instrumentor in every process (skipping
    the dependency check): one whose library is absent logs one debug line and nothing else (it
    was 14-38 'hook target not found' warnings each in every LightLLM process). Runs in its own
    interpreter: instrumentors are singletons, and the session's real engine holds the vLLM one."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import importlib, importlib.util, json, logging
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider
        real_find_spec = importlib.util.find_spec
        def find_spec(name, *args, **kwargs):
            if name == {package!r} or name.startswith({package!r} + "."):
                return None
            return real_find_spec(name, *args, **kwargs)
        importlib.util.find_spec = find_spec
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.levelno, record.getMessage()))
        logger = logging.getLogger("llm_otel")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(Keep())
        module, _, name = {path!r}.partition(":")
        inst = getattr(importlib.import_module(module), name)()
        inst.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider(), skip_dep_check=True)
        print(json.dumps({{"records": records, "applied": len(getattr(inst, "_applied", []) or [])}}))
        inst.uninstrument()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    records = result["records"]
    assert [level for level, _ in records] == [logging.DEBUG], records
    assert package in records[0][1] and "not importable" in records[0][1]
    assert result["applied"] == 0


# Each engine's hook tables (module-level Hook values and lists of them in <engine>/hooks.py) and
# the adapter class whose attributes the tables' factory names are resolved on by apply_hooks.
ADAPTERS = {
    "vllm": "llm_otel.instrumentation.vllm.adapter:VLLMAdapter",
    "lightllm": "llm_otel.instrumentation.lightllm.adapter:LightLLMAdapter",
    "triton": "llm_otel.instrumentation.triton.adapter:TritonAdapter",
    "sglang": "llm_otel.instrumentation.sglang.adapter:SGLangAdapter",
}
# Hooks that apply_hooks never resolves on the adapter, with what installs them instead.
NOT_ADAPTER_FACTORIES = {
    # a __setstate__ added to MultimodalParams (which has none to wrap) by carrier.make_setstate
    "lightllm:SETSTATE": "llm_otel.instrumentation.lightllm.carrier:make_setstate",
}

_FACTORY_CHECK = r"""
import importlib, importlib.abc, inspect, json, pkgutil, sys

ENGINES = ("vllm", "tritonclient", "lightllm", "sglang", "torch")  # none of them may be needed


class NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ENGINES:
            raise ImportError(f"{name} is blocked: the hook-table check must run without the engine")
        return None


sys.meta_path.insert(0, NoEngine())
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

import llm_otel.instrumentation as instrumentation
from llm_otel.config import Settings
from llm_otel.instrumentation._hooks import Hook
from llm_otel.telemetry import Telemetry

adapters, not_adapter = json.loads(sys.argv[1]), json.loads(sys.argv[2])
telemetry = Telemetry(TracerProvider(), MeterProvider(), Settings.from_env({}))
problems, checked, tables = [], 0, []
for info in pkgutil.iter_modules(instrumentation.__path__):
    if not info.ispkg:
        continue
    hooks_module = importlib.import_module(f"llm_otel.instrumentation.{info.name}.hooks")
    entries = []
    for var, value in vars(hooks_module).items():
        if isinstance(value, Hook):
            entries.append((f"{info.name}:{var}", value))
        elif isinstance(value, list) and value and all(isinstance(h, Hook) for h in value):
            tables.append(f"{info.name}:{var}")
            entries.extend((f"{info.name}:{var}", h) for h in value)
    if info.name not in adapters:
        problems.append(f"{info.name}: hook tables {sorted({e for e, _ in entries})} but no adapter class listed")
        continue
    module, _, cls = adapters[info.name].partition(":")
    adapter = getattr(importlib.import_module(module), cls)(telemetry)
    for where, hook in entries:
        if where in not_adapter:
            module, _, name = not_adapter[where].partition(":")
            if not callable(getattr(importlib.import_module(module), name, None)):
                problems.append(f"{where} {hook.qualname}: installer {not_adapter[where]} missing")
            continue
        factory = adapter
        try:
            for part in hook.factory.split("."):
                factory = getattr(factory, part)
            wrapper = factory(hook.qualname)
            inspect.signature(wrapper).bind(None, None, (), {})
        except Exception as exc:
            problems.append(f"{where} {hook.qualname}: factory {hook.factory!r} on {cls}: "
                            f"{type(exc).__name__}: {exc}")
            continue
        checked += 1
print(json.dumps({"problems": problems, "checked": checked, "tables": tables,
                  "engines_imported": sorted(m for m in sys.modules if m.split(".")[0] in ENGINES)}))
"""


def test_every_hook_factory_in_every_hook_table_exists_on_its_adapter_without_the_engine_installed():
    """A factory name is a string that apply_hooks resolves only when the engine is there (a typo
    or a renamed adapter method shows up as a silently missing hook on someone's server). Every
    ``Hook`` in every ``llm_otel/instrumentation/<engine>/hooks.py`` must name an attribute path of
    that engine's adapter that, called with the hook's qualname, returns a wrapt wrapper
    ``wrapper(wrapped, instance, args, kwargs)``. Runs in an interpreter where vLLM, tritonclient,
    LightLLM and torch cannot be imported."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _FACTORY_CHECK, json.dumps(ADAPTERS), json.dumps(NOT_ADAPTER_FACTORIES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == []
    assert result["engines_imported"] == []
    assert {"vllm:HOOKS", "lightllm:HOOKS", "triton:HOOKS", "sglang:HOOKS"} <= set(result["tables"])
    from llm_otel.instrumentation.lightllm.hooks import HOOKS as LIGHTLLM
    from llm_otel.instrumentation.sglang.hooks import HOOKS as SGLANG
    from llm_otel.instrumentation.triton.hooks import HOOKS as TRITON
    from llm_otel.instrumentation.vllm.hooks import HOOKS as VLLM

    assert result["checked"] == len(VLLM) + len(LIGHTLLM) + len(TRITON) + len(SGLANG)


def _import_hooked(tmp_path, monkeypatch, package: str, first_use):
    """An ImportHooked instrumentor over a two-module package in ``tmp_path`` (not yet imported)."""
    import threading

    from llm_otel.instrumentation._hooks import ImportHooked

    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("one", "two"):
        (pkg / f"{name}.py").write_text("import time\ntime.sleep(0.05)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Instrumentor(ImportHooked):
        ENGINE, SITE = "Fake engine", "instrumentation.fake.import_hook"
        _lock = threading.RLock()
        built = 0
        hooked: list = []

        def _first_use(self):
            type(self).built += 1
            return first_use()

        def _hook_module(self, module):
            self.hooked.append(module.__name__)

    inst = Instrumentor()
    inst.hooked = []
    inst._wait_for([f"{package}.one", f"{package}.two"], {"settings": None})
    return inst


def test_import_hooked_builds_its_adapter_once_at_the_first_hooked_import_even_from_two_threads(tmp_path, monkeypatch):
    """The Triton and LightLLM instrumentors build their telemetry (and the global providers) at
    the first import of a module they hook, not at instrument(): nothing before it, once however
    many threads import at the same time, and each module hooked once."""
    import importlib
    import threading

    inst = _import_hooked(tmp_path, monkeypatch, "fake_lazy_pkg", object)
    try:
        assert inst.adapter is None and inst.built == 0
        threads = [
            threading.Thread(target=importlib.import_module, args=(f"fake_lazy_pkg.{n}",))
            for n in ("one", "two", "one", "two")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert inst.adapter is not None and inst.built == 1
        assert sorted(inst.hooked) == ["fake_lazy_pkg.one", "fake_lazy_pkg.two"]
        inst._on_import(sys.modules["fake_lazy_pkg.one"])  # a later registration firing again
        assert sorted(inst.hooked) == ["fake_lazy_pkg.one", "fake_lazy_pkg.two"]
        inst._stop()
        inst._on_import(sys.modules["fake_lazy_pkg.two"])  # uninstrumented: the hooks stay and do nothing
        assert inst.adapter is None and len(inst.hooked) == 2
    finally:
        for name in [m for m in sys.modules if m.startswith("fake_lazy_pkg")]:
            del sys.modules[name]


def test_import_hooked_an_invalid_exporter_setting_met_at_the_first_import_is_one_error_line(
    tmp_path, monkeypatch, caplog
):
    """Providers are built at the first hooked import now, inside the application's ``import``: a
    ConfigError from them must not escape into it. One ERROR line; that engine stays uninstrumented
    in this process (later imports hook nothing)."""
    import importlib

    from llm_otel.config import ConfigError
    from llm_otel.instrumentation import _hooks

    def refuse():
        raise ConfigError("OTEL_EXPORTER_OTLP_PROTOCOL='carrier-pigeon' is not grpc, http/protobuf or http/json")

    monkeypatch.setattr(_hooks, "_CONFIG_ERROR_LOGGED", [False])
    inst = _import_hooked(tmp_path, monkeypatch, "fake_refused_pkg", refuse)
    try:
        with caplog.at_level(logging.DEBUG, logger="llm_otel"):
            importlib.import_module("fake_refused_pkg.one")
            importlib.import_module("fake_refused_pkg.two")
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "OTEL_EXPORTER_OTLP_PROTOCOL" in errors[0], errors
        assert inst.adapter is None and inst.built == 1 and inst.hooked == []
    finally:
        for name in [m for m in sys.modules if m.startswith("fake_refused_pkg")]:
            del sys.modules[name]


def test_import_hooked_a_hooked_import_inside_a_hook_does_not_deadlock(tmp_path, monkeypatch):
    """Hooking one module may import another hooked module of the same engine (a layout probe, a
    submodule the first one pulls in late): its post-import hook runs in the same thread, inside
    the first one's lock. It must hook it, not wait for itself forever."""
    import importlib
    import threading

    inst = _import_hooked(tmp_path, monkeypatch, "fake_reentry_pkg", object)
    plain = inst._hook_module

    def hook_module(module):
        plain(module)
        if module.__name__.endswith(".one"):
            importlib.import_module("fake_reentry_pkg.two")

    inst._hook_module = hook_module
    try:
        worker = threading.Thread(target=importlib.import_module, args=("fake_reentry_pkg.one",), daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the nested hooked import deadlocked"
        assert inst.hooked == ["fake_reentry_pkg.one", "fake_reentry_pkg.two"] and inst.built == 1
        from llm_otel.instrumentation.lightllm import LightLLMInstrumentor
        from llm_otel.instrumentation.triton import TritonClientInstrumentor

        for real in (TritonClientInstrumentor, LightLLMInstrumentor):  # the same re-entrant lock
            assert type(real._lock) is type(threading.RLock()), real
    finally:
        for name in [m for m in sys.modules if m.startswith("fake_reentry_pkg")]:
            del sys.modules[name]


def test_a_configuration_refusal_is_reported_once_per_process_tree(monkeypatch, caplog):
    """The first process to refuse an invalid setting logs one ERROR line and leaves the message in
    ``LLM_OTEL_CONFIG_REFUSED`` for the processes it starts; one that inherited the same message
    logs it at DEBUG; a different message is still an ERROR line."""
    import os

    from llm_otel.config import ConfigError
    from llm_otel.instrumentation import _hooks

    exc = ConfigError("LLM_OTEL_TOKEN_EVENTS='bad': expected an integer")
    monkeypatch.setattr(_hooks, "_CONFIG_ERROR_LOGGED", [False])
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        _hooks.configuration_refused("vLLM", exc)
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert os.environ[_hooks.REFUSED_ENV] == str(exc)

    caplog.clear()  # a child of that process: same environment, same error
    monkeypatch.setattr(_hooks, "_CONFIG_ERROR_LOGGED", [False])
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        _hooks.configuration_refused("vLLM", exc)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "reported by a parent process" in caplog.records[0].getMessage()

    caplog.clear()  # a child whose own setting is wrong in another way says so
    monkeypatch.setattr(_hooks, "_CONFIG_ERROR_LOGGED", [False])
    with caplog.at_level(logging.DEBUG, logger="llm_otel"):
        _hooks.configuration_refused("vLLM", ConfigError("OTEL_TRACES_EXPORTER='x': unknown exporter x"))
    assert [r.levelno for r in caplog.records] == [logging.ERROR]


SPAWNED_BOOTSTRAP = """
    import multiprocessing
    from multiprocessing.process import BaseProcess
    from llm_otel.process import bootstrap

    original = BaseProcess.__dict__["_bootstrap"]
    seen = []

    def first(process):
        seen.append(("first", process.name, multiprocessing.current_process() is process,
                     multiprocessing.parent_process() is not None))

    def failing(process):
        raise RuntimeError("boom")

    def last(process):
        seen.append(("last", process.name))

    for callback in (first, failing, first, last):  # first twice: added once
        bootstrap.at_spawned_bootstrap(callback)
    bootstrap.at_spawned_bootstrap(print)
    bootstrap.cancel_at_spawned_bootstrap(print)
    child = multiprocessing.Process(target=seen.append, args=(("target",),), name="Stage-1")
    child._parent_pid = 1  # as a spawned child's pickled Process says (its parent's pid)
    code = child._bootstrap()
    print("RESULT", code, seen, BaseProcess.__dict__["_bootstrap"] is original, "run" in child.__dict__)
    bootstrap.at_spawned_bootstrap(first)
    bootstrap.cancel_at_spawned_bootstrap(first)
    print("RESULT cancelled", BaseProcess.__dict__["_bootstrap"] is original)
"""


def test_at_spawned_bootstrap_runs_each_callback_once_before_the_target():
    """The LightLLM re-labelling and the vLLM engine providers share one patch of
    ``BaseProcess._bootstrap``: each callback runs once, in order, with the process object once it
    is the current process with its parent known and before the target; a failing callback is
    reported and the others and the target still run; the patch removes itself, and cancelling the
    last callback removes it before any bootstrap."""
    import subprocess
    import textwrap

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SPAWNED_BOOTSTRAP)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == [
        "RESULT 0 [('first', 'Stage-1', True, True), ('last', 'Stage-1'), ('target',)] True False",
        "RESULT cancelled True",
    ], done.stdout + done.stderr
    assert "boom" in done.stderr and "instrumentation.process_bootstrap" in done.stderr, done.stderr


FORKED_BOOTSTRAP = """
    import multiprocessing, os, sys
    from llm_otel.process import bootstrap

    seen = []
    bootstrap.at_forked_bootstrap(lambda: seen.append(("first", multiprocessing.current_process().name)))
    bootstrap.at_forked_bootstrap(lambda: seen.append(("second", os.getpid() != parent)))
    parent = os.getpid()

    def target(out):
        with open(out, "w") as f:
            f.write(repr(seen))

    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=target, args=(sys.argv[1],), name="Stage-2")
    child.start()
    child.join()
    print("RESULT", child.exitcode, open(sys.argv[1]).read(), seen)
"""


def test_at_forked_bootstrap_runs_each_callback_in_a_forked_child_before_the_target(tmp_path):
    """A child multiprocessing forks runs the callbacks, in order, once it is named and before its
    target; the parent runs none."""
    import subprocess
    import textwrap

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKED_BOOTSTRAP), str(tmp_path / "seen")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == ["RESULT 0 [('first', 'Stage-2'), ('second', True)] []"], done.stdout + done.stderr
