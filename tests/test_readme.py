"""The README's custom task runs exactly as written, including a crash and recovery."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, cli

pytestmark = pytest.mark.timeout(240)


def readme_files() -> dict[str, str]:
    """Code blocks preceded by ``<!-- file: NAME -->`` in README.md."""
    text = (REPO / "README.md").read_text()
    pattern = re.compile(r"<!-- file: (\S+) -->\s*```\w*\n(.*?)```", re.S)
    return {name: body for name, body in pattern.findall(text)}


@pytest.mark.e2e
def test_readme_custom_task_trains_and_recovers(tmp_path):
    files = readme_files()
    assert set(files) == {"my_task.py", "parity.yaml"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    r = cli("run", "parity.yaml", "--chaos", "kill-worker:0@70", run_dir=tmp_path / "run",
            cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert r.code == 0, r.err
    s = r.summary
    assert s["finished"] and s["steps"] == 150 and s["restarts"] == 1
    assert s["final_loss"] < s["first_loss"]
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-worker"]


def test_readme_commands_exist():
    """Every `elastic-harness SUBCOMMAND` the README mentions is a real subcommand."""
    from elastic_harness.cli import build_parser

    text = (REPO / "README.md").read_text()
    mentioned = set(re.findall(r"elastic-harness ([a-z0-9]+)", text))
    choices = set(build_parser()._subparsers._group_actions[0].choices)
    assert mentioned <= choices, mentioned - choices


def test_readme_script_diff_matches_the_shipped_scripts():
    """The README's before/after of the DDP toy: every removed line is in the plain script,
    every added line in the converted one, in that order (the diff cannot go stale)."""
    text = (REPO / "README.md").read_text()
    (diff,) = re.findall(r"```diff\n(.*?)```", text, re.S)
    before = (REPO / "jobs/ddp_toy_plain.py").read_text().splitlines()
    after = (REPO / "jobs/ddp_toy.py").read_text().splitlines()
    for sign, lines in (("-", before), ("+", after)):
        wanted = [line[1:] for line in diff.splitlines() if line.startswith(sign)]
        position = 0
        for line in wanted:
            assert line in lines[position:], f"README diff line not in its script: {sign}{line}"
            position = lines.index(line, position) + 1
