"""Layering rules from ARCHITECTURE.md, checked on the import graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "elastic_harness"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def ours(package: str) -> set[str]:
    found = set()
    for path in (PKG / package).rglob("*.py") if (PKG / package).is_dir() else [PKG / f"{package}.py"]:
        found |= {m for m in imports_of(path) if m.startswith("elastic_harness")}
    return found


@pytest.mark.parametrize("package, allowed", [
    ("spec", {"elastic_harness.errors", "elastic_harness.spec"}),
    ("data", {"elastic_harness.data"}),
])
def test_pure_packages_import_almost_nothing_of_ours(package, allowed):
    extra = {m for m in ours(package) if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert extra == set()


@pytest.mark.parametrize("package", ["spec", "launch", "k8s", "chaos"])
def test_host_side_never_imports_the_worker_side(package):
    bad = {m for m in ours(package) if m.startswith(("elastic_harness.runtime", "elastic_harness.checkpoint.manager"))}
    assert bad == set()


def test_checkpoint_never_imports_the_loop():
    bad = {m for m in ours("checkpoint") if m.startswith("elastic_harness.runtime")}
    assert bad == set()


def test_only_env_module_reads_worker_environment():
    readers = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if any(k in text for k in ('"RANK"', '"WORLD_SIZE"', '"LOCAL_RANK"', "TORCHELASTIC_RESTART")):
            readers.append(path.relative_to(PKG).as_posix())
    assert readers == ["launch/env.py"]


def test_nothing_asks_torch_distributed_who_it_is():
    offenders = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                 if "get_rank()" in p.read_text() or "get_world_size()" in p.read_text()]
    assert offenders == []


def module_graph(package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` (lazy and type-only imports count)."""
    prefix = f"elastic_harness.{package}."
    graph = {}
    for path in (PKG / package).glob("*.py"):
        name = prefix + path.stem
        graph[name] = set()
        for m in imports_of(path):
            if m == f"elastic_harness.{package}":  # `from elastic_harness.checkpoint import x`
                tree = ast.parse(path.read_text())
                graph[name] |= {prefix + a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                                and n.module == m for a in n.names}
            elif m.startswith(prefix):
                graph[name].add(m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_checkpoint_modules_import_no_circle():
    assert cycles(module_graph("checkpoint")) == []


@pytest.mark.parametrize("module", ["where", "layout"])
def test_checkpoint_decisions_are_pure(module):
    """One home for "where checkpoints live" and "which one to load": nothing of ours, no torch."""
    found = imports_of(PKG / "checkpoint" / f"{module}.py")
    assert not {m for m in found if m.startswith(("elastic_harness", "torch"))}


def test_host_side_locks_do_not_import_torch():
    """``rundir`` takes locks before any agent starts: it must not pay for importing torch."""
    for module in ("lock", "fence", "where", "layout", "storage", "streams"):
        assert not {m for m in imports_of(PKG / "checkpoint" / f"{module}.py") if m.split(".")[0] == "torch"
                    and not _type_only(PKG / "checkpoint" / f"{module}.py", m)}, module


def _type_only(path: Path, module: str) -> bool:
    guarded = [node for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"]
    return any(isinstance(n, ast.ImportFrom) and n.module == module for g in guarded for n in ast.walk(g))
