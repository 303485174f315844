"""``--help`` and ``spec`` answer without importing torch (a fresh import takes seconds).

One fresh interpreter imports the CLI and runs each command line in turn, reporting after
each whether ``torch`` is in ``sys.modules``: the first line that imports it is named.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from elastic_harness.cli import build_parser
from tests.conftest import MLP, REPO

pytestmark = pytest.mark.timeout(120)


def leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set[str]:
    """Every command and sub-command, as 'ckpt import'."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set().union(*(leaf_commands(p, (*prefix, name)) for name, p in action.choices.items()))
    return {" ".join(prefix)}


RUNNER = """
import contextlib, io, json, sys
from elastic_harness.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps({"argv": argv, "code": code, "torch": "torch" in sys.modules,
                      "traceback": "Traceback" in err.getvalue(), "out": out.getvalue()[-300:]}))
"""


def test_help_and_spec_do_not_import_torch():
    helps = [[*c.split(), "--help"] for c in sorted(leaf_commands(build_parser()))]
    lines = [["--help"], *helps, ["spec"], ["spec", str(MLP), "--no-task-check"],
             ["spec", str(MLP), "--set", "train.steps=[1"]]
    out = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(lines)], cwd=REPO,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["argv"] for r in results] == lines
    assert [r["argv"] for r in results if r["torch"]] == []
    assert [r["code"] for r in results] == [0] * (len(lines) - 1) + [2]
    assert not any(r["traceback"] for r in results)
    assert "NOT checked" in results[-2]["out"]
