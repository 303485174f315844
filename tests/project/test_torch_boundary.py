"""One boundary to torch's internals (issue 35): only ``elastic_harness/torchcompat`` reaches a
private torch name. Checked on the source (AST) of every other module of the package:

- no import of a private torch module or name (``from torch.x._y import z``,
  ``from torch.x import _y``, ``import torch._y``), nor a private module named in a string;
- no ``name._attr`` where ``name`` is bound to something imported from torch
  (``torch._foreach_copy_``, ``dynamic_rendezvous._delay``);
- in a class that derives from a torch class (directly or through ours), no ``self._x``,
  ``def _x`` or ``super()._x`` where torch's classes in its MRO have ``_x``;
- no ``obj._attr`` (nor ``getattr(obj, "_attr")``) on an object that is not ours: a private
  name the package defines nowhere belongs to someone else, and is allowed only for the
  non-torch libraries listed in ``NOT_TORCH`` (each with its reason).

Plus: every feature ``torchcompat.probe`` knows is documented in docs/torch-versions.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

PKG = REPO / "elastic_harness"
HOME = PKG / "torchcompat"

# Private names of libraries other than torch that the package reaches, and why.
NOT_TORCH = {
    "_SubParsersAction": "argparse: the type of add_subparsers()' result, for annotations",
    "_actions": "argparse: a parser's actions (cli.py lists the flags a command takes)",
    "_ex_iterable": "datasets: a streaming dataset's source (data/adapters.py, a Hugging Face adapter)",
    "_run_exitfuncs": "atexit: run the exit handlers before os._exit (procexit)",
    "_registry": "weakref.finalize: the exit-time finalizers, to detach torch.library's teardown (procexit)",
    "_getframe": "sys: the caller's frame (rendezvous/handler.py's event names)",
    "_exit": "os: leave without the interpreter's teardown",
    "_fields": "collections.namedtuple: how a batch that is a namedtuple is recognised",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def modules_outside_home() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if HOME not in p.parents)


def defined_by_us() -> set[str]:
    """Private names the package itself defines: functions, classes, class attributes,
    ``self._x`` assignments, module globals, parameters."""
    names: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names.add(sub.id)
                        elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                              and sub.value.id in ("self", "cls")):
                            names.add(sub.attr)
    return {n for n in names if private(n)}


def torch_bound(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from torch."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            bound |= {a.asname or a.name for a in node.names}
    return bound


def private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "torch"
                      and any(private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(private(part) for part in node.module.split(".")):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"torch(\.\w+)*\._\w+(\.\w+)*", node.value)):
            found.append(f"'{node.value}'")
    return found


def reached_attributes(tree: ast.AST, ours: set[str]) -> list[str]:
    """``X._attr`` on torch-bound names, and private names of objects that are not ours."""
    bound, found = torch_bound(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            on_torch = isinstance(base, ast.Name) and base.id in bound
            if on_torch or (node.attr not in ours and node.attr not in NOT_TORCH):
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and private(node.args[1].value) and node.args[1].value not in ours | set(NOT_TORCH)):
            found.append(ast.unparse(node))
    return found


def torch_source(cls: type) -> str:
    text = ""
    for k in cls.__mro__:
        if k.__module__.split(".")[0] == "torch":
            try:
                text += inspect.getsource(k)
            except (OSError, TypeError):
                continue
    return text


def names_in_class(node: ast.ClassDef) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef) and private(sub.name):
            names.add(sub.name)
        elif isinstance(sub, ast.Attribute) and private(sub.attr):
            value = sub.value
            if (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
                    isinstance(value, ast.Call) and ast.unparse(value.func) == "super"):
                names.add(sub.attr)
    return names


def subclass_reaches(path: Path, tree: ast.AST) -> list[str]:
    """In classes with a torch class in their MRO: private names that torch's classes have."""
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
    if not classes or "torch" not in path.read_text():
        return []
    module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
    found = []
    for node in classes:
        cls = getattr(module, node.name, None)
        if not isinstance(cls, type) or not any(k.__module__.split(".")[0] == "torch" for k in cls.__mro__):
            continue
        source = torch_source(cls)
        found += [f"{node.name}: {n}" for n in sorted(names_in_class(node))
                  if re.search(rf"(self\.|def |\b){re.escape(n)}\b", source)]
    return found


@pytest.fixture(scope="module")
def ours() -> set[str]:
    return defined_by_us()


@pytest.mark.parametrize("path", modules_outside_home(), ids=lambda p: p.relative_to(PKG).as_posix())
def test_only_torchcompat_reaches_torch_internals(path, ours):
    tree = ast.parse(path.read_text())
    found = private_imports(tree) + reached_attributes(tree, ours) + subclass_reaches(path, tree)
    assert found == [], "private names of torch (or of another library) outside elastic_harness/torchcompat"


def test_the_scanner_sees_each_kind_of_reach():
    """Fails if a rule stops seeing what it exists for (the scanner itself)."""
    src = ("import torch\nfrom torch.distributed.checkpoint._traverse import set_element\n"
           "from torch.distributed.elastic.rendezvous import dynamic_rendezvous\n"
           "x = dynamic_rendezvous._delay\ny = torch._foreach_copy_\nz = handler._state_holder\n"
           "w = getattr(handler, '_state_holder', None)\nm = 'torch._dynamo'\n")
    tree = ast.parse(src)
    found = private_imports(tree) + reached_attributes(tree, ours={"_mine"})
    assert found == ["torch.distributed.checkpoint._traverse", "'torch._dynamo'", "dynamic_rendezvous._delay",
                     "torch._foreach_copy_", "handler._state_holder",
                     "getattr(handler, '_state_holder', None)"]
    cls = ast.parse("class A(B):\n    def _monitor_workers(self):\n        return self._pcontext, self._mine\n").body[0]
    assert names_in_class(cls) == {"_monitor_workers", "_pcontext", "_mine"}


def test_every_feature_is_documented():
    from elastic_harness.torchcompat import probe

    doc = (REPO / "docs" / "torch-versions.md").read_text()
    missing = [key for key in probe.all_features() if f"`{key}`" not in doc]
    assert missing == []
