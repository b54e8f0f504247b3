"""Hook tables: missing targets are skipped with one warning; removal restores attributes exactly."""

from __future__ import annotations

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


def test_c05_missing_targets_warn_once_each_and_the_rest_keeps_working(engine_module, caplog):
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
    hooks = [Hook("fake_engine_layout", "Engine.step", "tracer", "t", ""),
             Hook("fake_engine_layout", "Engine.make", "tracer", "t", "")]
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
        "fake_engine_layout.gone:Engine.step"]
    remove_hooks(applied)
