"""A script job's own Python files: the script, and the modules beside it that it imports.

``local_files(script)`` finds them by reading imports, not by running anything (``ast``):
every ``import x`` / ``from x import y`` anywhere in the script (inside functions and ``try``
blocks too) whose top name ``x`` is a file ``x.py`` or a package directory ``x/`` beside the
script, then the same in each file found, transitively. A package directory is taken whole
(its ``.py`` files, without ``__pycache__`` and hidden directories): its own relative imports
need no reading. Python puts the script's directory first on ``sys.path`` (and so does
``runtime.entry``), so these are the files its imports load.

Used twice: ``run``/``submit``/``spec`` compile each file before any worker starts
(``check_compiles``: a syntax error is one line with file and line, not a crash loop), and
``k8s render`` ships them in the job's ConfigMap beside the script.

Limits: imports the code builds at run time (``importlib.import_module(name)``,
``__import__``) and files the script reads (data, configs) are not found; put those in the
image. Imports and reads only; pure otherwise. Imports nothing of ours but ``errors``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from elastic_harness.errors import HarnessError

# A directory taken whole is not expected to hold more than this many Python files.
MAX_FILES = 500


def imported_tops(source: bytes | str, filename: str = "<script>") -> set[str]:
    """Pure: the top-level names of the absolute imports in ``source`` (``a`` for ``import
    a.b`` and ``from a.b import c``). Relative imports name the package, not a sibling."""
    tree = ast.parse(source, filename)
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def local_files(script: Path) -> list[Path]:
    """The script and every Python file beside it that it imports, transitively (module
    doc), as paths relative to the script's directory, the script first. A file that does
    not parse is kept and not read further (``check_compiles`` names its error)."""
    root = script.parent
    found: dict[Path, None] = {Path(script.name): None}
    todo = [Path(script.name)]
    while todo:
        rel = todo.pop(0)
        try:
            tops = imported_tops((root / rel).read_bytes(), str(root / rel))
        except (SyntaxError, ValueError, OSError):
            continue
        for name in sorted(tops):
            for new in _files_of(root, name):
                if new not in found:
                    found[new] = None
                    todo.append(new)
    return list(found)


def _files_of(root: Path, name: str) -> list[Path]:
    """The files module ``name`` is beside ``root``: ``name.py``, or a package directory's."""
    if (root / f"{name}.py").is_file():
        return [Path(f"{name}.py")]
    folder = root / name
    if not folder.is_dir():
        return []
    files = sorted(p.relative_to(root) for p in folder.rglob("*.py")
                   if not any(part == "__pycache__" or part.startswith(".") for part in p.relative_to(root).parts))
    if len(files) > MAX_FILES:
        raise HarnessError(f"the script imports '{name}', a directory beside it with {len(files)} Python "
                           f"files (more than {MAX_FILES})", "install that package in the image (or the "
                           "environment) instead of keeping it beside the script")
    return files


def check_compiles(script: Path) -> list[Path]:
    """Compile the script and the files it imports from beside it (``local_files``); the
    first that does not compile is a ``HarnessError`` naming file:line and Python's reason.
    Returns the files (relative to the script's directory)."""
    files = local_files(script)
    for rel in files:
        path = script.parent / rel
        try:
            compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        except SyntaxError as e:
            where = f"{path}:{e.lineno}" if e.lineno else str(path)
            what = "the script" if rel == Path(script.name) else f"{rel}, which {script.name} imports,"
            raise HarnessError(f"{what} does not compile: {where}: {e.msg}",
                               "fix the line named; nothing was started") from None
        except (ValueError, OSError) as e:  # null bytes; unreadable
            raise HarnessError(f"{path}: cannot be compiled: {e}", "fix the file; nothing was started") from None
    return files
