"""The import graph of ``src/llm_otel``: parts import only the parts below them, and no module
imports itself back through others (issue 27).

The rules are read from the table in docs/architecture.md ("Parts and imports"), so the page and
the check cannot drift apart. Every ``import`` / ``from ... import`` statement counts, wherever it
stands: module level, inside functions, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"


# --- reading the source -----------------------------------------------------------------------
def modules(src: pathlib.Path = SRC) -> dict[str, tuple[pathlib.Path, bool]]:
    """``{"llm_otel.telemetry.spans": (path, is_package)}`` for every module under ``src``."""
    found = {}
    for path in sorted((src / "llm_otel").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, package)
    return found


def _targets(name: str, package: bool, node: ast.AST, known: set[str]) -> list[str]:
    """The llm_otel modules one import statement reaches (``from pkg import mod`` is ``pkg.mod``)."""
    raw: list[str] = []
    if isinstance(node, ast.Import):
        raw = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".") if package else name.split(".")[:-1]
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        raw = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin for alias in node.names]
    out = []
    for target in raw:
        if not (target == "llm_otel" or target.startswith("llm_otel.")):
            continue
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            out.append(target)
    return out


def import_graph(src: pathlib.Path = SRC) -> dict[str, set[str]]:
    """Module -> the llm_otel modules it imports (any statement anywhere in the file)."""
    found = modules(src)
    known = set(found)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, (path, package) in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_targets(name, package, node, known))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# --- reading the rules ------------------------------------------------------------------------
def rules(doc: pathlib.Path = DOC) -> tuple[list[tuple[str, list[str]]], dict[str, set[str]]]:
    """The "Parts and imports" table: ``([(part, [module patterns])], {part: parts it may import})``.

    Each row: ``| part | modules | may import |``; module patterns are backticked dotted names, a
    trailing ``.*`` meaning the name and everything under it. The first matching pattern, longest
    first, decides a module's part.
    """
    text = doc.read_text()
    section = text.split("## Parts and imports", 1)[1].split("\n## ", 1)[0]
    parts: list[tuple[str, list[str]]] = []
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        part = cells[0].strip("`")
        patterns = re.findall(r"`([^`]+)`", cells[1])
        may = set(re.findall(r"`([^`]+)`", cells[2]))
        parts.append((part, patterns))
        allowed[part] = may
    return parts, allowed


def part_of(module: str, parts: list[tuple[str, list[str]]]) -> str | None:
    best: tuple[int, str] | None = None
    for part, patterns in parts:
        for pattern in patterns:
            base = pattern[:-2] if pattern.endswith(".*") else pattern
            hit = module == base or (pattern.endswith(".*") and module.startswith(base + "."))
            if hit and (best is None or len(base) > best[0]):
                best = (len(base), part)
    return best[1] if best else None


def violations(graph: dict[str, set[str]], parts, allowed) -> list[str]:
    out = []
    for source in sorted(graph):
        sp = part_of(source, parts)
        for target in sorted(graph[source]):
            tp = part_of(target, parts)
            if sp is None or tp is None:
                continue  # reported by test_every_module_belongs_to_a_part
            if sp != tp and tp not in allowed[sp]:
                out.append(f"{source} ({sp}) imports {target} ({tp})")
    return out


# --- the checks -------------------------------------------------------------------------------
def test_the_rules_table_is_complete_and_acyclic():
    parts, allowed = rules()
    names = {p for p, _ in parts}
    assert {"config", "core", "export", "process", "instrumentation", "face"} <= names
    for part, may in allowed.items():
        assert may <= names, f"{part} may import unknown parts {may - names}"
    # the allowed relation itself has no circle, so obeying it leaves no circle between parts
    assert cycles({p: set(m) for p, m in allowed.items()}) == []


def test_every_module_belongs_to_a_part():
    parts, _ = rules()
    orphans = [m for m in modules() if part_of(m, parts) is None]
    assert orphans == [], f"modules in no part of docs/architecture.md's table: {orphans}"


def test_no_part_imports_a_part_it_may_not():
    parts, allowed = rules()
    assert violations(import_graph(), parts, allowed) == []


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_config_imports_nothing_of_the_project():
    graph = import_graph()
    config = [m for m in graph if m == "llm_otel.config" or m.startswith("llm_otel.config.")]
    assert config
    for module in config:
        outside = {t for t in graph[module] if not (t == "llm_otel.config" or t.startswith("llm_otel.config."))}
        assert outside == set(), f"{module} imports {outside}"


def test_nothing_but_the_face_imports_the_package_root():
    parts, _ = rules()
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "llm_otel" in targets and part_of(m, parts) != "face")
    assert importers == []


# --- the checker finds what it must (so a green run means something) ---------------------------
def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, body in files.items():
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return tmp_path / "src"


def test_the_checker_sees_function_level_and_relative_imports_and_circles(tmp_path):
    src = _tree(
        tmp_path,
        {
            "llm_otel/__init__.py": "",
            "llm_otel/config.py": "def f():\n    from llm_otel.telemetry import spans\n",
            "llm_otel/telemetry/__init__.py": "",
            "llm_otel/telemetry/spans.py": "from .. import config\nfrom ..export import offload\n",
            "llm_otel/export/__init__.py": "",
            "llm_otel/export/offload.py": "import llm_otel.telemetry.spans\n",
        },
    )
    graph = import_graph(src)
    assert graph["llm_otel.config"] == {"llm_otel.telemetry.spans"}
    assert graph["llm_otel.telemetry.spans"] == {"llm_otel.config", "llm_otel.export.offload"}
    assert sorted(map(sorted, cycles(graph))) == [
        ["llm_otel.config", "llm_otel.export.offload", "llm_otel.telemetry.spans"]
    ]
    parts = [
        ("config", ["llm_otel.config"]),
        ("core", ["llm_otel.telemetry.*"]),
        ("export", ["llm_otel.export.*"]),
        ("face", ["llm_otel"]),
    ]
    allowed = {"config": set(), "core": {"config"}, "export": {"core", "config"}, "face": {"config", "core", "export"}}
    assert violations(graph, parts, allowed) == [
        "llm_otel.config (config) imports llm_otel.telemetry.spans (core)",
        "llm_otel.telemetry.spans (core) imports llm_otel.export.offload (export)",
    ]


@pytest.mark.parametrize(
    "module, expected",
    [
        ("llm_otel", "face"),
        ("llm_otel.telemetry", "core"),
        ("llm_otel.telemetry.spans", "core"),
        ("llm_otel.export.offload", "export"),
        ("llm_otel.config", "config"),
    ],
)
def test_modules_are_placed_by_the_longest_matching_pattern(module, expected):
    parts, _ = rules()
    assert part_of(module, parts) == expected
