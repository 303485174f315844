"""The README and the docs it links to: the custom task (docs/tasks.md) runs exactly as
written, including a crash and recovery; commands, links and the script diff are real."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, cli

pytestmark = pytest.mark.timeout(240)


DOCS = ["README.md", "docs/tasks.md", "docs/your-script.md", "docs/operations.md", "docs/faults.md",
        "docs/how-it-works.md", "docs/benchmarks.md"]


def readme_files() -> dict[str, str]:
    """Code blocks preceded by ``<!-- file: NAME -->`` in docs/tasks.md (the README links it)."""
    text = (REPO / "docs" / "tasks.md").read_text()
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
    """Every `elastic-harness SUBCOMMAND` the README and its docs mention is a real subcommand."""
    from elastic_harness.cli import build_parser

    text = "\n".join((REPO / name).read_text() for name in DOCS)
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


def test_readme_and_docs_links_resolve():
    """Every relative link of the README and its docs names a file of the repo."""
    for name in DOCS:
        page = REPO / name
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{name} links to missing {target}"


def test_ci_runs_the_readmes_test_command():
    """``.ci/run`` runs the README's test command as written: what the README says of the
    suite (its command, its time) is what CI does."""
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"^bash \.ci/setup && .*$", readme, re.M)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def test_readme_is_a_newcomers_page():
    """Short, and its benchmark table has one figure per cell (the details are in docs/)."""
    text = (REPO / "README.md").read_text()
    assert len(text) < 12_000, len(text)
    table = text[text.index("| goal | measured | met |"):].split("\n\n")[0].splitlines()[2:]
    for row in table:
        goal_text, measured, met = [c.strip() for c in row.strip("|").split("|")]
        assert len(measured.split()) == 1 and met in ("yes", "no"), row


def test_the_docs_say_what_the_code_does_with_streams():
    """Issue 33: script-api.md said an IterableDataset "is not supported yet" (streaming.md
    supports one with shards), and streaming.md's Limits said ``ckpt import`` does not work
    for a streaming task (it does: tests/checkpoint/test_ckpt_import_stream.py)."""
    import torch

    from elastic_harness.data import Stream
    from elastic_harness.data.adapters import source_of
    from elastic_harness.errors import UsageError

    class Sharded(torch.utils.data.IterableDataset):
        shards = ["a", "b"]

        def open_shard(self, shard):
            yield shard

        def __iter__(self):
            raise AssertionError("read through open_shard")

    class Bare(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 1

    assert isinstance(source_of(Sharded()), Stream)
    with pytest.raises(UsageError, match="exposes no shards"):
        source_of(Bare())
    api = (REPO / "docs" / "script-api.md").read_text()
    assert "not supported yet" not in api
    assert "`IterableDataset` that exposes its `shards`" in api and "`open_shard(shard)`" in api
    limits = (REPO / "docs" / "streaming.md").read_text().split("## Limits", 1)[1]
    assert "does not work yet" not in limits and "`ckpt import` into a task that streams starts" in limits
