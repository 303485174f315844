"""Functions stay short (docs/conventions.md, "Size"): none over 40 lines outside the benches,
save those named below, each waiting for its split. A function is counted from its ``def`` to
its last line, docstring included, decorators not. Classes and parameter lists:
``test_class_size``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PKG = Path(__file__).resolve().parents[2] / "elastic_harness"
LIMIT = 40
# "path:qualified name": functions over the limit, each to be split (remove it when it is).
WAITING: set[str] = set()


def lengths(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in ``path``, nested ones too."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def test_no_function_over_40_lines_outside_the_benches():
    long = {f"{p.relative_to(PKG).as_posix()}:{name}"
            for p in PKG.rglob("*.py") if "bench" not in p.relative_to(PKG).parts
            for name, n in lengths(p) if n > LIMIT}
    assert long - WAITING == set(), "split these where a name explains the part"
    assert WAITING - long == set(), "split already: take them off WAITING"


def test_the_count_sees_methods_and_nested_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n")
    assert lengths(f) == [("A.m", 4), ("A.m.inner", 2)]
