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
    # the one fold of the event log, and the event contract: pure, shared by host and agent
    ("goodput", set()),
    ("runstate", {"elastic_harness.goodput"}),
    ("events", set()),
    # the fault vocabulary: data and pure decisions over the spec
    ("chaos/vocabulary", {"elastic_harness.errors", "elastic_harness.spec"}),
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
