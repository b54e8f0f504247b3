"""Every field case in ``shared/CASES.md`` is shown by at least one test, marked ``case("Cnn")``.

``shared/`` sits beside the repository (the project's shared notes; CI puts a copy beside the
clone). The markers are read from the test files' source (AST), so running this file alone checks
the whole suite. A case listed in ``KNOWN_GAPS`` has no test yet: it is a strict xfail, so the
first test marked with it makes this fail until the case is taken off the list."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
CASES_MD = TESTS.parent.parent / "shared" / "CASES.md"
CASE_ID = re.compile(r"C\d\d")

# Cases no test shows yet, each with what is missing.
KNOWN_GAPS: dict[str, str] = {}


def case_ids(cases_md: pathlib.Path) -> list[str]:
    """The case ids of the table in CASES.md (rows ``| C01 | ...``), in order."""
    return re.findall(r"^\|\s*(C\d\d)\s*\|", cases_md.read_text(), re.M)


def _is_case_marker(func: ast.expr) -> bool:
    """``pytest.mark.case``"""
    return ast.unparse(func) == "pytest.mark.case"


def case_markers(tests_dir: pathlib.Path = TESTS) -> dict[str, list[str]]:
    """Case id -> the tests marked with it (``file::test``), from every ``test_*.py`` under ``tests_dir``."""
    found: dict[str, list[str]] = {}
    for path in sorted(tests_dir.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and _is_case_marker(deco.func):
                    where = f"{path.relative_to(tests_dir)}::{node.name}"
                    assert deco.args and not deco.keywords, f'{where}: case() takes case ids, e.g. case("C06")'
                    for arg in deco.args:
                        ok = (
                            isinstance(arg, ast.Constant)
                            and isinstance(arg.value, str)
                            and CASE_ID.fullmatch(arg.value)
                        )
                        assert ok, f'{where}: case ids are strings like "C06", not {ast.unparse(arg)}'
                        found.setdefault(arg.value, []).append(where)
    return found


def _ids_or_skip() -> list[str]:
    if not CASES_MD.is_file():
        return []
    return case_ids(CASES_MD)


MARKERS = case_markers()


@pytest.mark.skipif(not CASES_MD.is_file(), reason=f"{CASES_MD} is absent (shared/ sits beside the repository)")
@pytest.mark.parametrize("case", _ids_or_skip() or ["-"])
def test_every_case_is_shown_by_a_test_marked_with_its_id(case):
    if case in KNOWN_GAPS:
        assert case not in MARKERS, f"{case} is marked on {MARKERS[case]}: take it off KNOWN_GAPS"
        pytest.xfail(f"{case}: {KNOWN_GAPS[case]}")
    assert case in MARKERS, f"no test is marked case({case!r}) ({CASES_MD})"


@pytest.mark.skipif(not CASES_MD.is_file(), reason=f"{CASES_MD} is absent (shared/ sits beside the repository)")
def test_every_case_marker_names_a_case_of_the_table():
    known = set(case_ids(CASES_MD))
    assert len(known) >= 28
    unknown = {c: tests for c, tests in MARKERS.items() if c not in known}
    assert not unknown, f"case ids not in {CASES_MD}: {unknown}"
    assert not set(KNOWN_GAPS) - known


def test_test_names_say_what_they_check_not_a_case_number():
    numbered = [
        f"{p.relative_to(TESTS)}::{n.name}"
        for p in sorted(TESTS.rglob("test_*.py"))
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.match(r"test_c\d\d", n.name)
    ]
    assert numbered == [], "name the behaviour and put the case id in @pytest.mark.case(...)"


def test_case_markers_are_found_in_the_sources():
    # the reader above against the suite as written: stale if it ever finds nothing
    assert MARKERS["C06"] and MARKERS["C19"]
    assert (
        "test_lightllm_pypi.py::test_real_2024_layout_traces_the_request_span_tree_with_the_engines_exact_counts"
        in MARKERS["C09"]
    )
