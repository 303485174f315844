"""The map's rules, checked on the import graph.

The import rules are the table of docs/architecture.md ("Import rules"), read here, so the map
and the checks cannot drift apart; the rules about who reads the environment, who spells the
run directory's names and who reads YAML are docs/conventions.md's ("One home for each
decision")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "elastic_harness"
MAP = PKG.parent / "docs" / "architecture.md"


def imports_of(path: Path) -> set[str]:
    """The modules ``path`` imports; ``from elastic_harness import runfiles`` counts as
    ``elastic_harness.runfiles`` (a module of ours), not as the package."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names if _is_ours(f"{node.module}.{a.name}")}
            out |= subs or {node.module}
    return out


def _is_ours(module: str) -> bool:
    if not module.startswith("elastic_harness."):
        return False
    rel = Path(*module.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def room_path(room: str) -> Path:
    """``data.order`` is ``data/order.py``; ``data`` the folder (or a top module ``data.py``)."""
    rel = Path(*room.split("."))
    return PKG / rel if (PKG / rel).is_dir() else (PKG / rel).with_suffix(".py")


def files_of(room: str) -> list[Path]:
    path = room_path(room)
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def ours(room: str) -> set[str]:
    """The modules of ours that ``room`` (a folder or a module, ``room_path``) imports."""
    return {m for path in files_of(room) for m in imports_of(path) if m.startswith("elastic_harness")}


def torch_imports(room: str, *, type_hints_too: bool = True) -> set[str]:
    """The torch modules (``torch``, ``torchdata``, ...) ``room`` imports; without
    ``type_hints_too``, those imported only under ``TYPE_CHECKING`` left out."""
    return {m for path in files_of(room) for m in imports_of(path)
            if m.split(".")[0].startswith("torch") and (type_hints_too or not _type_only(path, m))}


def read_rules(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(room, rule, names) of every row of the import-rules table in docs/architecture.md:
    its rows are the lines that start with a backticked room (the header and separator do
    not)."""
    rows = []
    section = text.split("\n## Import rules\n", 1)[1]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows.append((cells[0].strip("`"), cells[1], tuple(n.strip("`") for n in cells[2].split())))
    return rows


RULES = read_rules(MAP.read_text())
KINDS = {"only", "never", "no torch", "no torch at run time"}


def rules_of(kind: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(room, names) for room, rule, names in RULES if rule == kind]


def test_the_map_states_the_rules():
    """Every row of the table is a rule this file checks, about a room that exists, in names
    that exist: a typo must not turn a rule into one that holds vacuously."""
    assert len(RULES) >= 38, "the import-rules table of docs/architecture.md was not found whole"
    assert {rule for _, rule, _ in RULES} <= KINDS
    for room, rule, names in RULES:
        assert room_path(room).exists(), f"docs/architecture.md names a room that is not there: {room}"
        for name in names:
            if name != "nothing":
                assert room_path(name).exists(), f"docs/architecture.md: {room} {rule} names {name}"
        assert rule in ("only", "never") or not names, f"{room}: '{rule}' takes no names"


@pytest.mark.parametrize("package, allowed", [pytest.param(r, n, id=r) for r, n in rules_of("only")])
def test_pure_packages_import_almost_nothing_of_ours(package, allowed):
    allowed = {f"elastic_harness.{a}" for a in allowed if a != "nothing"}
    extra = {m for m in ours(package) if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert extra == set()


@pytest.mark.parametrize("package, banned", [pytest.param(r, n, id=r) for r, n in rules_of("never")])
def test_rooms_never_import_what_the_map_forbids(package, banned):
    """The host side never imports the worker side, the tier neither the loop nor the
    launcher, checkpoints never the loop."""
    prefixes = tuple(f"elastic_harness.{n}" for n in banned)
    assert {m for m in ours(package) if m.startswith(prefixes)} == set()


@pytest.mark.parametrize("room", [r for r, _ in rules_of("no torch")])
def test_rooms_that_import_no_torch(room):
    """The decisions the host makes before anything starts, and the job and layout a worker
    reads before its task or script imports torch: no torch import of any kind."""
    assert torch_imports(room) == set()


@pytest.mark.parametrize("room", [r for r, _ in rules_of("no torch at run time")])
def test_rooms_that_import_torch_only_for_type_hints(room):
    """``rundir`` takes locks before any agent starts: it must not pay for importing torch."""
    assert torch_imports(room, type_hints_too=False) == set()


def test_only_env_module_reads_worker_environment():
    readers = []
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        if any(k in text for k in ('"RANK"', '"WORLD_SIZE"', '"LOCAL_RANK"', "TORCHELASTIC_RESTART")):
            readers.append(path.relative_to(PKG).as_posix())
    assert readers == ["launch/env.py"]


def test_nothing_asks_torch_distributed_who_it_is():
    # runtime/dist.py owns the process group: it may check a group the user's script made
    # against what the launcher said; nothing else asks torch who it is. bench/throughput/plain.py
    # is the plain torchrun DDP script the harness is measured against: it uses nothing of
    # the harness and asks torch, as such scripts do.
    plain = ("bench/throughput/plain.py", "bench/throughput/stream_plain.py")  # the streaming one too
    offenders = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                 if p.relative_to(PKG).as_posix() not in plain
                 and ("get_rank()" in p.read_text() or "get_world_size()" in p.read_text())]
    assert offenders in ([], ["runtime/dist.py"])


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from pkg import mod`` counts as ``pkg.mod``).

    Every import statement counts, in functions and under ``TYPE_CHECKING`` too: deferring
    an import hides a circle from Python, not from the design. A package's ``__init__`` run
    on the way to a submodule does not count."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs or {node.module}
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The modules of every strongly connected component larger than one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == {frozenset("abc")}


# Circles that another change removes; each entry must still exist, so the list cannot
# outlive its circle.
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_import_cycles_inside_the_package():
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), "import cycles (break them: docs/architecture.md)"
    assert KNOWN_CYCLES - found == set(), "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_only_runfiles_spells_the_run_directory_names():
    """One module names what a run directory holds (``runfiles``); the rest use its names."""
    names = ('"events.jsonl"', '"job.resolved.yaml"', '"summary.json"', '"job.key"', '".elastic-harness.lock"')
    spellers = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                      if any(n in p.read_text() for n in names))
    assert spellers == ["runfiles.py"]


def _type_only(path: Path, module: str) -> bool:
    guarded = [node for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"]
    return any(isinstance(n, ast.ImportFrom) and n.module == module for g in guarded for n in ast.walk(g))


def test_the_resume_check_reads_no_torch_and_no_pickle():
    """``run``/``submit`` decide "already finished" before anything starts, from manifests:
    no torch import (seconds), nothing unpickled (the checkpoint is not trusted yet)."""
    import subprocess
    import sys

    code = ("import sys, elastic_harness.commands.support.resumepoint, elastic_harness.commands.jobargs\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pickle')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout, out.stdout
    found = imports_of(PKG / "commands" / "support" / "resumepoint.py")
    assert not {m for m in found if m.split(".")[0] in ("torch", "pickle")}


def test_only_the_spec_loader_reads_yaml():
    """User YAML is read by one loader (``spec.loader``: YAML 1.2 scalars, keys given twice
    refused); nothing else calls PyYAML's readers."""
    readers = ("yaml.load(", "yaml.safe_load", "yaml.full_load", "yaml.unsafe_load", "yaml.load_all",
               "yaml.compose", "yaml.parse(", "Loader=", "SafeLoader", "yaml.FullLoader", "CLoader")
    found = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                   if any(r in p.read_text() for r in readers))
    assert found == ["spec/loader.py"]
