"""Bad input: one clear line naming the problem and the fix, non-zero exit, nothing lost.

Inputs refused before anything starts run in this process (``cli_here``); a checkpoint
refused at resume needs real workers, so those cases are e2e."""

from __future__ import annotations

import hashlib

import pytest

from tests.conftest import MLP, cli

pytestmark = pytest.mark.timeout(240)


def tree_digest(root) -> dict[str, str]:
    """Every checkpoint file (not the generation counter each worker generation bumps)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "generation.json"}


def assert_clear_error(r, *words):
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out
    first = r.err.strip().splitlines()[0]
    assert first.startswith("error: "), r.err
    for w in words:
        assert w in r.err, (w, r.err)


@pytest.mark.parametrize(
    "yaml_text, words",
    [
        ("name: x\ntrain: {steps: 3\n  bad: [\n", ["not valid YAML at line"]),
        ("name: x\ntrian: {steps: 3}\n", ["trian: unknown key", "did you mean 'train'"]),
        ("name: x\ncheckpoint: {writer: process}\n", ["checkpoint.writer: 'process' was removed in 0.3",
                                                      "fix: delete the key"]),
        ("name: x\ntrain: {steps: -1}\n", ["train.steps: must be > 0"]),
        ("name: x\nnodes: {min: 2, max: 1}\n", ["min (2) is greater than max (1)"]),
        ("name: x\ntask: {target: 'no_such_pkg.mod:Task'}\n", ["cannot import module 'no_such_pkg.mod'"]),
        ("name: x\ntask: {target: 'elastic_harness.tasks.mlp:Nope'}\n", ["has no attribute 'Nope'"]),
        ("name: x\ntask: {target: 'elastic_harness.tasks.mlp:MLPRegression', args: {wings: 2}}\n",
         ["rejected task.args", "wings"]),
    ],
)
def test_bad_job_files(cli_here, tmp_path, yaml_text, words):
    job = tmp_path / "job.yaml"
    job.write_text(yaml_text)
    r = cli_here("run", job, "--run-dir", tmp_path / "run")
    assert_clear_error(r, *words)
    assert not (tmp_path / "run").exists(), "nothing is created for a job that cannot start"


def test_missing_job_file(cli_here, tmp_path):
    assert_clear_error(cli_here("run", tmp_path / "nope.yaml"), "does not exist")


def test_unwritable_run_dir(cli_here, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = cli_here("run", MLP, "--run-dir", blocker / "run")
    assert_clear_error(r, "is not writable", "--run-dir")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved")
    r = cli("run", str(MLP), "--set", "train.steps=10", run_dir=run_dir)
    assert r.code == 0, r.err
    return run_dir


@pytest.mark.e2e  # each case starts real agents and workers, refused at resume
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["task.args.hidden=32"], ["does not match this model", "shape mismatches", "--fresh"]),
        (["task.args.depth=3"], ["does not match this model", "missing"]),
        (["task.target=tests.tasks:OtherMLP"], ["was written by task 'elastic_harness.tasks.mlp:MLPRegression'"]),
        (["optimizer.name=sgd"], ["does not match this model"]),
        (["train.seed=5"], ["cannot continue this job", "train.seed=0"]),
    ],
)
@pytest.mark.xdist_group("saved-run")  # computed once, on one worker
def test_foreign_checkpoint_is_refused_and_kept(saved_run, overrides, words):
    before = tree_digest(saved_run / "checkpoints")
    args = [a for o in overrides for a in ("--set", o)]
    r = cli("run", str(MLP), "--set", "train.steps=20", *args, run_dir=saved_run, timeout=120)
    assert_clear_error(r, *words)
    assert tree_digest(saved_run / "checkpoints") == before
    assert "Traceback" in "".join(p.read_text() for p in (saved_run / "logs").rglob("*.log")), \
        "the full traceback goes to the run's logs"


@pytest.mark.xdist_group("saved-run")  # computed once, on one worker
@pytest.mark.e2e  # real `run`s of a job that trained to its end (issue 33, item 3)
def test_rerunning_a_finished_job_says_so_and_refuses_a_fault_that_cannot_fire(saved_run):
    before = tree_digest(saved_run / "checkpoints")
    events = (saved_run / "events.jsonl").read_text()
    again = cli("run", str(MLP), "--set", "train.steps=10", run_dir=saved_run, timeout=120)
    assert again.code == 0, again.err
    assert "job 'mlp' already finished" in again.out and "nothing was trained" in again.out
    assert "None" not in again.out + again.err and "run dir:" not in again.out, "nothing started"
    r = cli("run", str(MLP), "--set", "train.steps=10", "--chaos", "kill-worker:1@5", run_dir=saved_run, timeout=120)
    assert_clear_error(r, "already finished at step 10", "fault kill-worker:1@5 cannot fire")
    assert tree_digest(saved_run / "checkpoints") == before
    assert (saved_run / "events.jsonl").read_text() == events, "no agent started, nothing logged"


def test_a_failing_worker_prints_its_traceback_before_it_reports(tmp_path, monkeypatch, capfd):
    """A fatal failure event makes the host stop every agent at once: whatever the worker
    has not written to its log by then is lost. So the traceback is in the log first."""
    from elastic_harness.runtime import entry, failures

    script = tmp_path / "boom.py"
    script.write_text("def inner():\n    raise RuntimeError('boom in the user script')\n\ninner()\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: boom\nscript: {{path: {script}}}\n")
    logged_when_recorded: list[str] = []
    monkeypatch.setattr(entry, "_record", lambda exc, run_dir: logged_when_recorded.append(capfd.readouterr().err))

    def no_exit(code: int, *, printed: bool = False) -> None:
        raise SystemExit((code, printed))

    monkeypatch.setattr(failures, "exit_now", no_exit)
    with pytest.raises(SystemExit) as ended:
        entry.main([str(job), str(tmp_path / "run")])
    assert ended.value.code == (1, True), "exits 1 without printing the traceback twice"
    assert len(logged_when_recorded) == 1
    assert "Traceback" in logged_when_recorded[0] and "boom in the user script" in logged_when_recorded[0]
    assert "in inner" in logged_when_recorded[0], "the user's own frame is in the log"
