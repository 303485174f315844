"""Layering rules from ARCHITECTURE.md, checked on the import graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "elastic_harness"


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


def ours(package: str) -> set[str]:
    found = set()
    for path in (PKG / package).rglob("*.py") if (PKG / package).is_dir() else [PKG / f"{package}.py"]:
        found |= {m for m in imports_of(path) if m.startswith("elastic_harness")}
    return found


@pytest.mark.parametrize("package, allowed", [
    ("spec", {"elastic_harness.errors", "elastic_harness.spec"}),
    ("data", {"elastic_harness.data", "elastic_harness.errors"}),
    # a stream's order: pure (numpy), nothing but the sampler's helpers
    ("data/order", {"elastic_harness.data.sampler"}),
    # the one fold of the event log, and the event contract: pure, shared by host and agent
    ("goodput", set()),
    ("runstate", {"elastic_harness.goodput"}),
    ("events", set()),
    # what this install has (extras): one home, imports only the errors
    ("deps", {"elastic_harness.errors"}),
    # the one boundary to torch's internals: below everything, so every layer may use it
    ("torchcompat", {"elastic_harness.errors", "elastic_harness.torchcompat"}),
    # the fault vocabulary: data and pure decisions over the spec
    ("chaos/vocabulary", {"elastic_harness.errors", "elastic_harness.spec"}),
    # where a generation restores from (memory, a peer, storage): a pure function of the offers
    ("memtier/choose", set()),
    # the job's key and listening sockets: used on every side, so they depend on nothing
    ("jobkey", {"elastic_harness.errors", "elastic_harness.runfiles"}),
    ("listen", set()),
    # the run directory's names: below everything, so every layer may spell them through it
    ("runfiles", set()),
    # which job a worker runs: parsed once by the entry, handed to init; torch-free
    ("runtime/jobsource", {"elastic_harness.errors", "elastic_harness.spec", "elastic_harness.launch.env",
                           "elastic_harness.runfiles"}),
    # the parallel layout: pure numbers, validated when built
    ("runtime/topology", {"elastic_harness.errors", "elastic_harness.spec.layout"}),
    # a simulated host's init and its pids seen from the machine: standard library only
    ("simhost", set()),
    ("pidns", set()),
    # a peer's beacon: sockets only, on every agent
    ("launch/probe", {"elastic_harness.listen"}),
    # the verdicts on nodes and rounds: pure decisions over evidence
    ("launch/verdict", set()),
    ("launch/rounds", set()),
    ("launch/exclusion", set()),
    # a script job's own files (what it imports from beside it): read and compiled, shipped
    ("scriptfiles", {"elastic_harness.errors"}),
])
def test_pure_packages_import_almost_nothing_of_ours(package, allowed):
    extra = {m for m in ours(package) if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert extra == set()


@pytest.mark.parametrize("package", ["spec", "launch", "k8s", "chaos"])
def test_host_side_never_imports_the_worker_side(package):
    bad = {m for m in ours(package) if m.startswith(("elastic_harness.runtime", "elastic_harness.checkpoint.manager"))}
    assert bad == set()


def test_memtier_never_imports_the_loop_or_the_launcher():
    bad = {m for m in ours("memtier") if m.startswith(("elastic_harness.runtime", "elastic_harness.launch"))}
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
    # runtime/dist.py owns the process group: it may check a group the user's script made
    # against what the launcher said; nothing else asks torch who it is. bench/tput_plain.py
    # is the plain torchrun DDP script the harness is measured against: it uses nothing of
    # the harness and asks torch, as such scripts do.
    plain = ("bench/tput_plain.py", "bench/tput_stream_plain.py")  # the streaming one too
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


# Circles that another change removes (issue 12 item 5); each entry must still exist, so
# the list cannot outlive its circle.
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_import_cycles_inside_the_package():
    found = cycles(import_graph())
    assert found - KNOWN_CYCLES == set(), "import cycles (break them; see issue 12 item 5)"
    assert KNOWN_CYCLES - found == set(), "a known cycle is gone: remove it from KNOWN_CYCLES"


@pytest.mark.parametrize("module", ["where", "layout"])
def test_checkpoint_decisions_are_pure(module):
    """One home for "where checkpoints live" and "which one to load": nothing of ours (but the
    run directory's names, which import nothing), no torch."""
    found = imports_of(PKG / "checkpoint" / f"{module}.py") - {"elastic_harness.runfiles"}
    assert not {m for m in found if m.startswith(("elastic_harness", "torch"))}


def test_only_runfiles_spells_the_run_directory_names():
    """One module names what a run directory holds (``runfiles``); the rest use its names."""
    names = ('"events.jsonl"', '"job.resolved.yaml"', '"summary.json"', '"job.key"', '".elastic-harness.lock"')
    spellers = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                      if any(n in p.read_text() for n in names))
    assert spellers == ["runfiles.py"]


def test_host_side_locks_do_not_import_torch():
    """``rundir`` takes locks before any agent starts: it must not pay for importing torch."""
    for module in ("lock", "fence", "where", "layout", "storage", "streams"):
        assert not {m for m in imports_of(PKG / "checkpoint" / f"{module}.py") if m.split(".")[0] == "torch"
                    and not _type_only(PKG / "checkpoint" / f"{module}.py", m)}, module


def _type_only(path: Path, module: str) -> bool:
    guarded = [node for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"]
    return any(isinstance(n, ast.ImportFrom) and n.module == module for g in guarded for n in ast.walk(g))


@pytest.mark.parametrize("module", ["jobsource", "topology"])
def test_job_source_and_layout_do_not_import_torch(module):
    """The entry parses the job before the task or the script imports torch; the layout is
    numbers, decided without asking torch.distributed anything."""
    assert not {m for m in imports_of(PKG / "runtime" / f"{module}.py") if m.split(".")[0] == "torch"}


def test_the_resume_check_reads_no_torch_and_no_pickle():
    """``run``/``submit`` decide "already finished" before anything starts, from manifests:
    no torch import (seconds), nothing unpickled (the checkpoint is not trusted yet)."""
    import subprocess
    import sys

    code = ("import sys, elastic_harness.resumepoint, elastic_harness.commands.jobargs\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pickle')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torch" not in out.stdout, out.stdout
    found = imports_of(PKG / "resumepoint.py")
    assert not {m for m in found if m.split(".")[0] in ("torch", "pickle")}


def test_only_the_spec_loader_reads_yaml():
    """User YAML is read by one loader (``spec.loader``: YAML 1.2 scalars, keys given twice
    refused); nothing else calls PyYAML's readers."""
    readers = ("yaml.load(", "yaml.safe_load", "yaml.full_load", "yaml.unsafe_load", "yaml.load_all",
               "yaml.compose", "yaml.parse(", "Loader=", "SafeLoader", "yaml.FullLoader", "CLoader")
    found = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                   if any(r in p.read_text() for r in readers))
    assert found == ["spec/loader.py"]
