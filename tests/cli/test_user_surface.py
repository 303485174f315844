"""Issue 33, the user-facing surface: ``ckpt export`` to a path it cannot write, a job that
already finished, faults that can never fire, ``logs``/``status`` that pick silently, ``run``
and ``submit`` taking the same flags, a script that does not compile, and the job a script
runs under the harness, torchrun and python. Fast: nothing trains here (checkpoints come
from ``ckpt import``, one process)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from pathlib import Path

import pytest

from elastic_harness.cli import build_parser, parse
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.registry import JobRecord
from tests.cli.test_bad_args import assert_one_line_error
from tests.conftest import JOBS, MLP
from tests.servers import tmpfs

pytestmark = pytest.mark.timeout(120)


def _legacy_weights(path: Path) -> None:
    """A torch.save file of the MLP job's model, for ``ckpt import``."""
    import torch

    from elastic_harness.spec import load_job
    from elastic_harness.tasks import load_task

    spec = load_job(MLP)
    torch.manual_seed(0)
    torch.save(load_task(spec.task.target, spec.task.args).build_model().state_dict(), path)


@pytest.fixture
def imported(cli_here, tmp_path) -> Path:
    """A run dir holding one signed checkpoint at step 10 of the MLP job (``ckpt import``)."""
    _legacy_weights(tmp_path / "w.pt")
    r = cli_here("ckpt", "import", tmp_path / "w.pt", MLP, "--run-dir", tmp_path / "run", "--step", "10")
    assert r.code == 0, r.err
    return tmp_path / "run"


def _digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----- item 1: ckpt export to a path it cannot write ------------------------------------------
@contextlib.contextmanager
def read_only_dir(path: Path):
    """A directory this process cannot write: mode 0555, or, as root (whom modes do not
    bind), a read-only tmpfs mounted there."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, "ro,size=64k"):
        yield path


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors", "sub/model.pt"])
def test_export_to_a_read_only_dir_is_one_line_and_leaves_nothing(cli_here, imported, tmp_path, name):
    before = _digest(imported)
    with read_only_dir(tmp_path / "ro") as ro:
        r = cli_here("ckpt", "export", imported, "--to", ro / name)
        assert_one_line_error(r, f"cannot write '{ro / name}'", str(ro), "fix: pass --to a path in a directory")
        assert list(ro.iterdir()) == []
    assert _digest(imported) == before, "the checkpoint is untouched"


def test_export_that_fails_while_writing_leaves_no_partial_file(cli_here, imported, tmp_path, monkeypatch):
    """A write that fails half-way (a full disk): the half-written file is removed, an existing
    file of that name is as it was, directories made for it are gone."""
    import torch

    def half_then_full(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half a model")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing "
                           "file data/0: file write failed")

    monkeypatch.setattr(torch, "save", half_then_full)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt").write_bytes(b"the previous export")
    for target in (out / "model.pt", out / "new" / "deeper" / "model.pt"):
        r = cli_here("ckpt", "export", imported, "--to", target)
        assert_one_line_error(r, f"cannot write '{target}'", "file write failed", "the checkpoint is untouched")
    assert sorted(p.name for p in out.iterdir()) == ["model.pt"]
    assert (out / "model.pt").read_bytes() == b"the previous export"


def test_export_to_sys_fails_in_the_writer_and_says_why(cli_here, imported):
    """/sys passes the access check as root and refuses the file itself (the writer's own
    failure path); for others it is refused by the check. One line either way."""
    r = cli_here("ckpt", "export", imported, "--to", "/sys/eh-model.safetensors")
    assert_one_line_error(r, "cannot write '/sys/eh-model.safetensors'")
    assert not any(p.name.startswith(".eh-model") for p in Path("/sys").iterdir())


# ----- item 3: a job that already finished; faults that can never fire -----------------------
def test_a_finished_job_says_so_and_starts_nothing(cli_here, imported):
    """The checkpoint holds step 10 of train.steps 10: nothing to train, nothing started
    (``cli_here`` fails the test if anything is launched), exit 0, no registry record."""
    before = _digest(imported)
    r = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=10")
    assert r.code == 0, r.err
    assert "job 'mlp' already finished" in r.out and "holds step 10 of train.steps 10" in r.out
    assert "nothing was trained" in r.out and "--set train.steps=20" in r.out and "--fresh" in r.out
    assert "None" not in r.out
    assert _digest(imported) == before


def test_submit_json_of_a_finished_job_answers_in_json(cli_here, imported, tmp_path, monkeypatch):
    """A script reading ``submit --json`` gets an object saying nothing was submitted, not
    an empty stdout; the note goes to stderr as without --json."""
    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path / "state"))
    r = cli_here("submit", MLP, "--run-dir", imported, "--set", "train.steps=10", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out) == {"id": None, "submitted": False, "finished": True, "run_dir": str(imported)}
    assert "already finished" in r.err


@pytest.mark.parametrize("chaos, steps, words", [
    ("kill-worker:1@5", 10, ["already finished at step 10", "fault kill-worker:1@5 cannot fire", "--fresh"]),
    ("kill-worker:1@30s", 10, ["already finished at step 10", "kill-worker:1@30s cannot fire"]),
    ("kill-worker:1@5", 20, ["fault kill-worker:1@5 cannot fire: this run resumes after step 10", "@11"]),
    ("kill-worker:1@10", 20, ["kill-worker:1@10 cannot fire: this run resumes after step 10"]),
])
def test_a_fault_that_can_never_fire_is_refused(cli_here, imported, chaos, steps, words):
    before = _digest(imported)
    r = cli_here("run", MLP, "--run-dir", imported, "--set", f"train.steps={steps}", "--chaos", chaos)
    assert_one_line_error(r, *words)
    assert _digest(imported) == before


def test_a_fault_after_the_resume_point_goes_ahead(cli_here, imported, monkeypatch):
    from elastic_harness.commands import run

    started = []
    monkeypatch.setattr(run, "launch_local", lambda spec, *a, **k: started.append(spec) or 0)
    r = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=20", "--chaos", "kill-worker:1@11")
    assert r.code == 0, r.err
    assert [f.at_step for f in started[0].chaos] == [11]
    fresh = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=10", "--fresh")
    assert fresh.code == 0 and len(started) == 2, "--fresh starts over: nothing is finished"


def test_a_fault_that_fired_in_an_earlier_run_of_the_directory_is_done_not_refused(cli_here, imported, monkeypatch):
    """A job keeps its chaos list across runs: fault 0 fired before (its marker), so keyed
    before the resume point it is not one that can never fire; fault 1 still is."""
    from elastic_harness import runfiles
    from elastic_harness.commands import run

    started = []
    monkeypatch.setattr(run, "launch_local", lambda spec, *a, **k: started.append(spec) or 0)
    (imported / runfiles.CHAOS).mkdir(exist_ok=True)
    (imported / runfiles.CHAOS / runfiles.fault_marker(0)).touch()
    r = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=20",
                 "--chaos", "kill-worker:1@5", "--chaos", "kill-worker:0@15")
    assert r.code == 0 and len(started) == 1, r.err
    refused = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=20",
                       "--chaos", "kill-worker:1@5", "--chaos", "kill-worker:0@7")
    assert_one_line_error(refused, "fault kill-worker:0@7 cannot fire")
    assert "kill-worker:1@5" not in refused.err and len(started) == 1
    done = cli_here("run", MLP, "--run-dir", imported, "--set", "train.steps=10", "--chaos", "kill-worker:1@5")
    assert done.code == 0 and "already finished" in done.out and len(started) == 1


def test_a_run_that_trained_nothing_never_prints_loss_none():
    from elastic_harness.commands.run import finished_line

    line = finished_line({"steps": 400, "first_loss": None, "final_loss": None, "restarts": 0, "world_sizes": [2]})
    assert "None" not in line and "at step 400" in line and "no step trained" in line
    assert finished_line({"steps": 4, "first_loss": 1.5, "final_loss": 0.5, "restarts": 1,
                          "world_sizes": [2]}).startswith("finished: 4 steps, loss 1.5 -> 0.5")


# ----- item 6: logs with none, status picking among many -------------------------------------
@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path / "state"))
    return tmp_path / "state"


def _job(state: Path, run_dir: Path, i: int) -> JobRecord:
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = JobRecord(id=f"mlp-{i:04d}", name="mlp", scheduler="local", submitted=1000.0 + i, total_steps=60,
                    run_dir=str(run_dir), details={"pid": 1, "host": "elsewhere"})
    registry.save(rec, state)
    return rec


def test_logs_of_a_job_without_logs_says_where_they_would_be(cli_here, state, tmp_path):
    _job(state, tmp_path / "run", 1)
    r = cli_here("logs", "mlp")
    assert r.code == 1 and r.out == "", (r.code, r.out, r.err)
    (line,) = [x for x in r.err.splitlines() if x.startswith("error: ")]
    assert "job mlp-0001 has no logs" in line and str(tmp_path / "run" / "logs") in line
    assert "elastic-harness status mlp-0001" in r.err and "Traceback" not in r.err


def test_status_by_a_name_many_jobs_share_says_which_it_shows(cli_here, state, tmp_path):
    for i in range(14):
        _job(state, tmp_path / f"run-{i}", i)
    r = cli_here("status", "mlp", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["id"] == "mlp-0013", "stdout stays JSON"
    assert "note: 14 jobs match 'mlp'; this is the newest, mlp-0013" in r.err
    assert "name another by its id (elastic-harness list" in r.err
    one = cli_here("status", "mlp-0004")
    assert one.code == 0 and "note:" not in one.err, "an id names one job: nothing to say"


# ----- item 7: run and submit take the same flags --------------------------------------------
def _options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return {o for a in sub.choices[command]._actions for o in a.option_strings}


def test_every_run_flag_is_a_submit_flag_or_says_why_not():
    from elastic_harness.commands.jobargs import RUN_ONLY

    missing = _options("run") - _options("submit") - set(RUN_ONLY)
    assert missing == set(), f"run flags submit lacks: {sorted(missing)} (add them to commands.jobargs)"
    assert set(RUN_ONLY) <= _options("run")


def test_submit_splits_a_scripts_own_arguments_as_run_does():
    a = parse(build_parser(), ["submit", "--nnodes", "1:2", "--chaos", "kill-worker:1@3", "train.py", "--lr", "3"])
    assert (a.job, a.nnodes, a.chaos, a.script_args) == ("train.py", "1:2", ["kill-worker:1@3"], ["--lr", "3"])


def test_submit_takes_runs_job_forms_and_flags(cli_here, tmp_path, monkeypatch):
    """``submit jobs/ddp_toy.py`` (its YAML beside it), ``--nnodes 1:2``, ``--nproc-per-node
    cpu``, ``--chaos``: the supervisor gets a ``run`` command that means the same job."""
    from elastic_harness.launch import config
    from elastic_harness.lifecycle import local
    from elastic_harness.lifecycle.local import run_command

    monkeypatch.setattr(config, "device_count", lambda kind: 0 if kind == "gpu" else 3)
    subs = []
    monkeypatch.setattr(local.LocalScheduler, "submit", lambda self, sub: subs.append(sub) or
                        local.supervisor_record(sub.spec, sub.run_dir, sub.job_file, sub.job_id, os.getpid(), "submit"))
    r = cli_here("submit", "--nnodes", "1:2", "--nproc-per-node", "cpu", "--chaos", "kill-worker:1@7",
                 "--run-dir", tmp_path / "run", JOBS / "ddp_toy.py", "--my-flag", "3")
    assert r.code == 0, r.err
    (sub,) = subs
    assert sub.spec.train.global_batch_size == 40, "the YAML beside the script, as run uses it"
    assert (sub.spec.nodes.min, sub.spec.nodes.max, sub.spec.nproc_per_node) == (1, 2, 3)
    assert "job: " in r.err and "ddp_toy.yaml (the YAML beside the script)" in r.err
    cmd = run_command(sub)
    script = cmd.index(str(JOBS / "ddp_toy.py"))
    assert cmd[script + 1:] == ["--my-flag", "3"], "the script's own arguments come after it"
    assert cmd[cmd.index("--chaos") + 1] == "kill-worker:1@7" and cmd.index("--chaos") < script
    rerun = parse(build_parser(), cmd[3:])  # what the supervisor parses
    assert (rerun.job, rerun.chaos, rerun.script_args) == (str(JOBS / "ddp_toy.py"), ["kill-worker:1@7"], ["--my-flag", "3"])


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_submit_to_a_cluster_refuses_what_it_cannot_honour(cli_here, tmp_path, scheduler):
    run_dir = ["--run-dir", tmp_path / "run"]
    r = cli_here("submit", MLP, "--scheduler", scheduler, "--nproc-per-node", "gpu", *run_dir)
    assert_one_line_error(r, "--nproc-per-node gpu would count this machine's devices", "as a number")
    r = cli_here("submit", MLP, "--scheduler", scheduler, "--fresh", *run_dir)
    assert_one_line_error(r, "--fresh is for --scheduler local")
    r = cli_here("submit", MLP, "--scheduler", scheduler, "--chaos", "kill-node:0@30s", *run_dir)
    assert_one_line_error(r, "fault kill-node:0@30s is fired by a local `run` supervisor")
    assert not (tmp_path / "run").exists()


# ----- item 8: a script that does not compile ------------------------------------------------
@pytest.fixture
def broken(tmp_path) -> Path:
    (tmp_path / "train.py").write_text("import helper\nimport elastic_harness as eh\n\ndef main(:\n    pass\n")
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "uses.py").write_text("import helper\nprint(helper.X)\n")
    return tmp_path


@pytest.mark.parametrize("command", [["run"], ["spec"], ["submit"], ["k8s", "render", "--flavor", "plain"]])
def test_a_script_with_a_syntax_error_is_one_line_before_anything_starts(cli_here, broken, command):
    r = cli_here(*command, broken / "train.py")
    assert_one_line_error(r, f"the script does not compile: {broken / 'train.py'}:4: invalid syntax",
                          "fix the line named")
    assert not (broken / "runs").exists()


def test_a_sibling_module_with_a_syntax_error_is_named(cli_here, broken):
    (broken / "helper.py").write_text("X = (1,\n")
    r = cli_here("run", broken / "uses.py")
    assert_one_line_error(r, "helper.py, which uses.py imports, does not compile", f"{broken / 'helper.py'}:1")
    job = broken / "job.yaml"
    job.write_text("name: x\nscript: {path: uses.py}\n")
    assert_one_line_error(cli_here("spec", job), "helper.py, which uses.py imports, does not compile")


# ----- item 9: the job of a script, three ways -----------------------------------------------
def test_a_script_runs_with_the_yaml_beside_it_every_way(cli_here, tmp_path, monkeypatch):
    """``run jobs/ddp_toy.py`` (harness), and the script's own ``eh.init(<its .yaml>)`` and
    ``eh.init()`` under torchrun or python, all get ddp_toy.yaml's job: global batch 40."""
    from elastic_harness.commands import run
    from elastic_harness.launch.env import WorkerEnv
    from elastic_harness.runtime import jobsource

    started = []
    monkeypatch.setattr(run, "launch_local", lambda spec, *a, **k: started.append(spec) or 0)
    r = cli_here("run", JOBS / "ddp_toy.py")
    assert r.code == 0, r.err
    assert f"job: {JOBS / 'ddp_toy.yaml'} (the YAML beside the script)" in r.out
    harness = started[0]
    plain = WorkerEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, group_rank=0, restart_count=0,
                      max_restarts=0, run_id="", master_addr="", master_port=0, job_path="", run_dir="",
                      launched=False)
    monkeypatch.setattr(jobsource, "_HANDED", None)
    named, _ = jobsource.resolve_job(plain, JOBS / "ddp_toy.yaml", None, ())  # eh.init(<its .yaml>)
    monkeypatch.setattr(sys, "argv", [str(JOBS / "ddp_toy.py")])
    unnamed, where = jobsource.resolve_job(plain, None, None, ())  # eh.init() with no job
    for spec in (harness, named, unnamed):
        assert (spec.name, spec.train.global_batch_size, spec.train.steps, spec.nproc_per_node) == \
               ("ddp-toy", 40, 200, 2)
    assert where == Path("runs") / "ddp-toy"
    assert harness.script.path == unnamed.script.path == str(JOBS / "ddp_toy.py")


def test_a_yaml_beside_the_script_that_is_another_jobs_is_named_not_used(cli_here, tmp_path, monkeypatch):
    from elastic_harness.commands import run

    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "train.yaml").write_text("name: other\nscript: {path: elsewhere.py}\n")
    started = []
    monkeypatch.setattr(run, "launch_local", lambda spec, *a, **k: started.append(spec) or 0)
    r = cli_here("run", tmp_path / "train.py")
    assert r.code == 0, r.err
    assert started[0].name == "train" and started[0].train.global_batch_size != 40
    assert "job: the spec's defaults, named 'train'" in r.out
    assert "train.yaml beside it is not its job: its script.path is 'elsewhere.py'" in r.out


def test_load_job_of_a_script_says_which_commands_take_one(tmp_path):
    from elastic_harness.errors import SpecError
    from elastic_harness.spec import load_job

    with pytest.raises(SpecError, match="is a training script, not a job YAML") as e:
        load_job(JOBS / "ddp_toy.py")
    assert "`run`, `submit`, `spec` and `k8s render` also take a script" in e.value.hint


def test_errno_names_are_what_the_export_message_says():
    """The reason in ``cannot write ...`` is the OS's own words (``strerror``)."""
    from elastic_harness.checkpoint.export import _reason

    assert _reason(OSError(errno.EROFS, os.strerror(errno.EROFS))) == os.strerror(errno.EROFS)
    assert _reason(RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                                "Read-only file system")) == "Read-only file system"
    assert _reason(Exception('Error while serializing: I/O error: No space left on device (os error 28) at '
                             'path "/x/.tmp"')) == "No space left on device"


def test_an_agents_own_fix_is_not_followed_by_a_second_one(tmp_path):
    """An exit-2 error from an agent or worker that names its fix (a HarnessError) is shown
    with that fix alone; an error in the job's code gets the fix that names it (and where
    its traceback is)."""
    from elastic_harness.commands.run import _error

    own = _error(2, "etcd refused the job's credentials\n  fix: check rendezvous.etcd_user", tmp_path, True)
    assert str(own).count("fix:") == 1 and "etcd_user" in str(own)
    bare = _error(2, "ValueError: bad sample", tmp_path, True)
    assert str(bare).count("fix:") == 1 and "fix the error in the code" in str(bare) and "traceback is in" in str(bare)


def _every_parser(parser):
    yield parser
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for sub in action.choices.values():
                yield from _every_parser(sub)


def test_no_help_shows_rest_markup_and_k8s_flavor_names_every_flavor():
    """`k8s render --help` showed reST double backticks (its description is the module's
    docstring), and its --flavor help said "pytorchjob or plain" without trainjob."""
    from elastic_harness.k8s import FLAVORS

    helps = {p.prog: p.format_help() for p in _every_parser(build_parser())}
    assert len(helps) > 20
    assert [prog for prog, text in helps.items() if "``" in text] == []
    flavor = next(a for a in _every_parser(build_parser()) if a.prog.endswith("k8s render"))
    (action,) = [a for a in flavor._actions if "--flavor" in a.option_strings]
    assert all(name in action.help for name in FLAVORS), action.help
