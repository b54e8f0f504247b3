"""Signatures of hooked engine functions, read from source with ``ast`` (nothing is imported).

A *target* is ``(module, qualname)``: ``("vllm.v1.worker.gpu.model_runner",
"GPUModelRunner.sample")``. :func:`extract` finds the module's file under a *source* (an
installed package root such as ``site-packages``, an unpacked source tree, or a wheel read in
place) and returns, for each target, JSON-able data: the module, the class path, the function
name, whether it is ``async``, its decorators, and every parameter's name, kind and whether it
has a default. Goldens are files of that data for one engine release; :func:`compare` lists the
differences that would break a wrapper (a renamed/removed target or parameter, a moved
position, a parameter losing its default).

Reading source instead of importing it is the point: a wheel built for CUDA (vLLM's GPU model
runner) or another Python version can still be checked on a CPU machine.

CLI (writes a golden)::

    python tests/contracts/signatures.py --source vllm-0.33.0-cp38-abi3-manylinux.whl \\
        --target vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample --out golden.json
    python tests/contracts/signatures.py --installed vllm --targets-file targets.txt

``--targets-file`` holds one ``module:qualname`` per line (``#`` comments allowed).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import zipfile
from collections.abc import Iterable, Sequence
from typing import Any

Target = tuple[str, str]

#: parameter kinds, named as ``inspect.Parameter.kind`` names them
POSITIONAL_ONLY = "POSITIONAL_ONLY"
POSITIONAL_OR_KEYWORD = "POSITIONAL_OR_KEYWORD"
VAR_POSITIONAL = "VAR_POSITIONAL"
KEYWORD_ONLY = "KEYWORD_ONLY"
VAR_KEYWORD = "VAR_KEYWORD"


class Source:
    """Python files of one engine release: a directory that holds the top-level package
    (``site-packages``, a checkout's ``src``) or a ``.whl``/``.zip`` read without unpacking."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._zip = zipfile.ZipFile(self.path) if zipfile.is_zipfile(self.path) else None
        self._trees: dict[str, ast.Module] = {}
        if self._zip is None and not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path}: neither a directory nor a wheel/zip")

    def read(self, relpath: str) -> str | None:
        """Text of ``relpath`` (``/``-separated, relative to the root), or None if absent."""
        if self._zip is not None:
            try:
                return self._zip.read(relpath).decode("utf-8")
            except KeyError:
                return None
        full = os.path.join(self.path, *relpath.split("/"))
        if not os.path.isfile(full):
            return None
        with open(full, encoding="utf-8") as fh:
            return fh.read()

    def files(self, prefix: str) -> list[str]:
        """Relpaths (``/``-separated) of the files under directory ``prefix``, sorted."""
        prefix = prefix.rstrip("/") + "/"
        if self._zip is not None:
            return sorted(n for n in self._zip.namelist() if n.startswith(prefix) and not n.endswith("/"))
        found = []
        for root, _dirs, names in os.walk(os.path.join(self.path, *prefix.split("/"))):
            rel = os.path.relpath(root, self.path).replace(os.sep, "/")
            found.extend(f"{rel}/{name}" for name in names)
        return sorted(found)

    def tree(self, relpath: str, text: str) -> ast.Module:
        """``ast`` of ``text`` (the file ``relpath``), parsed once per source."""
        if relpath not in self._trees:
            self._trees[relpath] = ast.parse(text, filename=relpath)
        return self._trees[relpath]

    def module_file(self, module: str) -> tuple[str, str] | None:
        """``(relpath, text)`` of ``module``'s source (``a/b.py`` or ``a/b/__init__.py``)."""
        base = module.replace(".", "/")
        for relpath in (f"{base}.py", f"{base}/__init__.py"):
            text = self.read(relpath)
            if text is not None:
                return relpath, text
        return None


def installed_root(package: str) -> str:
    """Directory holding the installed top-level ``package`` (found without importing it).

    Raises:
        ModuleNotFoundError: ``package`` is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ModuleNotFoundError(package)
    if spec.submodule_search_locations:
        return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
    return os.path.dirname(os.path.abspath(spec.origin or ""))


def _parameters(args: ast.arguments) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = []
    positional = [*args.posonlyargs, *args.args]
    # defaults align with the *last* positional parameters
    first_default = len(positional) - len(args.defaults)
    for index, arg in enumerate(positional):
        kind = POSITIONAL_ONLY if index < len(args.posonlyargs) else POSITIONAL_OR_KEYWORD
        params.append({"name": arg.arg, "kind": kind, "has_default": index >= first_default})
    if args.vararg is not None:
        params.append({"name": args.vararg.arg, "kind": VAR_POSITIONAL, "has_default": False})
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append({"name": arg.arg, "kind": KEYWORD_ONLY, "has_default": default is not None})
    if args.kwarg is not None:
        params.append({"name": args.kwarg.arg, "kind": VAR_KEYWORD, "has_default": False})
    return params


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    return ast.unparse(node)


def _definitions(body: Iterable[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound by a module or class body: defs, classes and plain assignments, looking into
    ``if``/``try``/``with`` blocks (version switches) but not into functions. The last binding
    wins, as it does at run time for straight-line code."""
    found: dict[str, ast.AST] = {}
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt
        elif isinstance(stmt, ast.If):
            found.update(_definitions(stmt.body))
            found.update(_definitions(stmt.orelse))
        elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            found.update(_definitions(stmt.body))
            for handler in stmt.handlers:
                found.update(_definitions(handler.body))
            found.update(_definitions(stmt.orelse))
            found.update(_definitions(stmt.finalbody))
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            found.update(_definitions(stmt.body))
    return found


_PROPERTIES = {"property", "cached_property"}


def _class_fields(node: ast.ClassDef) -> list[str]:
    """Data attributes a class declares: class-level annotated or assigned names (dataclass
    fields), properties, and ``self.<name> = ...`` targets in ``__init__``; sorted; other
    methods excluded."""
    names = {
        name
        for name, value in _definitions(node.body).items()
        if isinstance(value, (ast.Assign, ast.AnnAssign))
        or (
            isinstance(value, (ast.FunctionDef, ast.AsyncFunctionDef))
            and {_decorator_name(d).split(".")[-1] for d in value.decorator_list} & _PROPERTIES
        )
    }
    init = _definitions(node.body).get("__init__")
    if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)) and init.args.args:
        self_name = init.args.args[0].arg
        for sub in ast.walk(init):
            targets = (
                sub.targets
                if isinstance(sub, ast.Assign)
                else [sub.target]
                if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for target in targets:
                for leaf in ast.walk(target):
                    if (
                        isinstance(leaf, ast.Attribute)
                        and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == self_name
                    ):
                        names.add(leaf.attr)
    return sorted(names)


def _imported_from(body: list[ast.stmt], name: str) -> str | None:
    """The module a module-level ``from module import name`` (absolute) takes ``name`` from."""
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
            if any((alias.asname or alias.name) == name and alias.name == name for alias in stmt.names):
                return stmt.module
    return None


def signature(source: Source, module: str, qualname: str) -> dict[str, Any]:
    """Signature data of one target.

    Returns a dict with ``module``, ``qualname``, ``found`` (bool) and, when found: ``file``
    (path relative to the source root), ``classes`` (the enclosing class path, ``[]`` for a
    module-level function), ``name``, ``kind`` (``function``, ``async_function``, ``class``,
    ``assignment``), ``decorators`` (dotted names) and ``params`` (list of ``{"name", "kind",
    "has_default"}`` for functions; ``None`` otherwise); a class also has ``fields`` (see
    :func:`_class_fields`). When not found, ``missing`` says which part was absent (``module`` or
    the first missing name of the qualname). A module-level name the module imports with an
    absolute ``from x import name`` is followed to ``x`` (``reexported_from``).
    """
    entry: dict[str, Any] = {"module": module, "qualname": qualname, "found": False}
    located = source.module_file(module)
    if located is None:
        entry["missing"] = "module"
        return entry
    relpath, text = located
    scope: ast.AST = ast.parse(text, filename=relpath)
    parts = qualname.split(".")
    node: ast.AST | None = None
    for index, part in enumerate(parts):
        body = getattr(scope, "body", None)
        node = _definitions(body).get(part) if isinstance(body, list) else None
        if node is None and index == 0 and isinstance(body, list):
            origin = _imported_from(body, part)
            if origin is not None:  # `from x import name` re-exports it: the hook patches this name here
                found = signature(source, origin, qualname)
                found.update(module=module, reexported_from=origin)
                return found
        if node is None:
            entry["missing"] = ".".join(parts[: index + 1])
            return entry
        if index < len(parts) - 1 and not isinstance(node, ast.ClassDef):
            entry["missing"] = ".".join(parts[: index + 2])  # only classes are looked into
            return entry
        scope = node
    assert node is not None
    entry.update(found=True, file=relpath, classes=parts[:-1], name=parts[-1])
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        entry["kind"] = "async_function" if isinstance(node, ast.AsyncFunctionDef) else "function"
        entry["decorators"] = [_decorator_name(d) for d in node.decorator_list]
        entry["params"] = _parameters(node.args)
    elif isinstance(node, ast.ClassDef):
        entry["kind"] = "class"
        entry["decorators"] = [_decorator_name(d) for d in node.decorator_list]
        entry["params"] = None
        entry["fields"] = _class_fields(node)
    else:
        entry["kind"] = "assignment"
        entry["decorators"] = []
        entry["params"] = None
    return entry


def _import_origin(body: list[ast.stmt], name: str, module: str, is_package: bool) -> tuple[str, str] | None:
    """``(module, original name)`` a module-level ``from ... import`` binds ``name`` from (``as``
    renames and relative imports resolved; imports under ``if``/``try`` included, the last wins)."""
    found = None
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom):
            if stmt.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (stmt.level - 1)]
                origin = ".".join(parts + ([stmt.module] if stmt.module else []))
            else:
                origin = stmt.module or ""
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    found = (origin, alias.name)
        elif isinstance(stmt, ast.If):
            found = _import_origin(stmt.body + stmt.orelse, name, module, is_package) or found
        elif isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            blocks = stmt.body + [s for h in stmt.handlers for s in h.body] + stmt.orelse + stmt.finalbody
            found = _import_origin(blocks, name, module, is_package) or found
    return found


def resolve_class(source: Source, module: str, name: str, _depth: int = 0) -> tuple[str, ast.ClassDef, str] | None:
    """Where the class bound to ``module.name`` is defined: ``("module:Class", node, relpath)``.

    Follows module-level aliases (``NixlConnector = NixlPullConnector``) and ``from x import
    name [as other]`` re-exports (absolute or relative, package ``__init__`` files included).
    Returns None when the name is not bound to a class in ``source`` (absent, or from a package
    outside it, such as ``abc.ABC``)."""
    located = source.module_file(module)
    if located is None or _depth > 20:
        return None
    relpath, text = located
    body = source.tree(relpath, text).body
    node = _definitions(body).get(name)
    if isinstance(node, ast.ClassDef):
        return f"{module}:{name}", node, relpath
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
        return resolve_class(source, module, node.value.id, _depth + 1)
    if node is None:
        origin = _import_origin(body, name, module, relpath.endswith("/__init__.py"))
        if origin is not None:
            return resolve_class(source, origin[0], origin[1], _depth + 1)
    return None


def class_mro(source: Source, module: str, name: str) -> list[tuple[str, ast.ClassDef | None, str | None]]:
    """Method resolution order of the class bound to ``module.name``, read from source: C3
    linearisation over its bases as :func:`resolve_class` finds them. A base outside ``source``
    (``ABC``, ``Generic[T]``) is a leaf ``("<outside>:ABC", None, None)``. ``[]`` when the class
    itself is not found.

    Raises:
        TypeError: the bases admit no consistent order (Python would refuse the class too).
    """
    start = resolve_class(source, module, name)
    if start is None:
        return []
    memo: dict[str, list[tuple[str, ast.ClassDef | None, str | None]]] = {}

    def linearize(ref: tuple[str, ast.ClassDef | None, str | None]) -> list:
        key, node, _relpath = ref
        if key in memo:
            return memo[key]
        if node is None:
            return [ref]
        owner = key.split(":", 1)[0]
        bases = []
        for base in node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            found = resolve_class(source, owner, expr.id) if isinstance(expr, ast.Name) else None
            bases.append(found or (f"<outside>:{ast.unparse(expr)}", None, None))
        sequences = [linearize(b) for b in bases] + [bases]
        result = [ref]
        while any(sequences):
            sequences = [s for s in sequences if s]
            for seq in sequences:
                head = seq[0]
                if not any(head[0] in [r[0] for r in s[1:]] for s in sequences):
                    break
            else:
                raise TypeError(f"{key}: inconsistent bases")
            result.append(head)
            sequences = [s[1:] if s[0][0] == head[0] else s for s in sequences]
        memo[key] = result
        return result

    return linearize(start)


def method_as_seen(source: Source, module: str, name: str, method: str) -> dict[str, Any]:
    """Signature data of ``method`` as the class bound to ``module.name`` resolves it: the first
    class of :func:`class_mro` whose body binds the name. Returns ``found`` and, when found,
    ``defined_in`` (``"module:Class"``), ``file``, ``kind``, ``decorators`` and ``params`` as
    :func:`signature` gives them (``params`` None for a non-function binding)."""
    for key, node, relpath in class_mro(source, module, name):
        if node is None:
            continue
        bound = _definitions(node.body).get(method)
        if bound is None:
            continue
        entry: dict[str, Any] = {"found": True, "defined_in": key, "file": relpath}
        if isinstance(bound, (ast.FunctionDef, ast.AsyncFunctionDef)):
            entry["kind"] = "async_function" if isinstance(bound, ast.AsyncFunctionDef) else "function"
            entry["decorators"] = [_decorator_name(d) for d in bound.decorator_list]
            entry["params"] = _parameters(bound.args)
        else:
            entry.update(kind="class" if isinstance(bound, ast.ClassDef) else "assignment", decorators=[], params=None)
        return entry
    return {"found": False}


def extract(source: Source | str, targets: Sequence[Target]) -> dict[str, dict[str, Any]]:
    """Signature data of every target, keyed ``"module:qualname"`` (see :func:`signature`)."""
    if not isinstance(source, Source):
        source = Source(source)
    return {f"{module}:{qualname}": signature(source, module, qualname) for module, qualname in targets}


def compare(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Differences between two signature entries of one target that can break a wrapper.

    Reported: found vs missing, a different kind (sync vs async, function vs other), and for
    each parameter position a different name, kind or default-presence, plus added/removed
    parameters. Decorators and the file are informational and not compared. Returns ``[]`` when
    the target is compatible.
    """
    label = f"{expected.get('module')}:{expected.get('qualname')}"
    if expected.get("found") != actual.get("found"):
        where = "now missing" if expected.get("found") else "now present"
        return [f"{label}: {where} ({actual.get('missing') or expected.get('missing')})"]
    if not expected.get("found"):
        return []
    diffs = []
    if expected.get("kind") != actual.get("kind"):
        diffs.append(f"{label}: kind {expected.get('kind')} -> {actual.get('kind')}")
    gone = sorted(set(expected.get("fields") or ()) - set(actual.get("fields") or ()))
    if gone:
        diffs.append(f"{label}: fields removed: {', '.join(gone)}")
    old, new = expected.get("params") or [], actual.get("params") or []
    for index in range(max(len(old), len(new))):
        a = old[index] if index < len(old) else None
        b = new[index] if index < len(new) else None
        if a == b:
            continue
        if a is None:
            diffs.append(f"{label}: parameter {index} added: {b['name']} ({b['kind']})")
        elif b is None:
            diffs.append(f"{label}: parameter {index} removed: {a['name']} ({a['kind']})")
        else:
            changed = [f"{key} {a[key]!r} -> {b[key]!r}" for key in ("name", "kind", "has_default") if a[key] != b[key]]
            diffs.append(f"{label}: parameter {index}: " + ", ".join(changed))
    return diffs


def compare_all(expected: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]]) -> list[str]:
    """:func:`compare` over two :func:`extract` results; keys only in one side are reported."""
    diffs = []
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            diffs.append(f"{key}: not extracted")
        elif key not in expected:
            diffs.append(f"{key}: not in the golden")
        else:
            diffs.extend(compare(expected[key], actual[key]))
    return diffs


def parse_target(text: str) -> Target:
    """``"module:Class.method"`` -> ``("module", "Class.method")``.

    Raises:
        ValueError: no ``:`` separator or an empty side.
    """
    module, sep, qualname = text.strip().partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"target {text!r} is not 'module:qualname'")
    return module, qualname


def golden(source_label: str, signatures: dict[str, dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """The document written to a golden file: provenance plus the signatures."""
    return {"source": source_label, **meta, "targets": signatures}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", help="a package root directory or a .whl read in place")
    where.add_argument("--installed", metavar="PACKAGE", help="the installed top-level package")
    parser.add_argument("--target", action="append", default=[], help="module:qualname (repeatable)")
    parser.add_argument("--targets-file", help="file with one module:qualname per line")
    parser.add_argument("--out", help="write the golden here (default: stdout)")
    parser.add_argument("--meta", action="append", default=[], help="key=value added to the golden")
    args = parser.parse_args(argv)
    targets = [parse_target(t) for t in args.target]
    if args.targets_file:
        with open(args.targets_file, encoding="utf-8") as fh:
            targets += [parse_target(line.split("#")[0]) for line in fh if line.split("#")[0].strip()]
    if not targets:
        parser.error("no targets (--target or --targets-file)")
    path = args.source or installed_root(args.installed)
    meta = dict(item.split("=", 1) for item in args.meta)
    document = golden(os.path.basename(os.path.normpath(path)), extract(path, targets), **meta)
    text = json.dumps(document, indent=1, sort_keys=True) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    missing = [key for key, entry in document["targets"].items() if not entry["found"]]
    for key in missing:
        print(f"signatures: {key} not found", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
