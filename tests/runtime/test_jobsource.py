"""The job is parsed once per process and passed down (``runtime.jobsource``, ``rundir``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_harness import runfiles
from elastic_harness.errors import UsageError
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.records.rundir import handed_resolved, prepare, write_resolved
from elastic_harness.runtime import jobsource
from elastic_harness.spec import dump_job, load_job
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(60)


def env(job_path: str = "", run_dir: str = "") -> WorkerEnv:
    return WorkerEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, group_rank=0,
                     restart_count=0, max_restarts=0, run_id="", master_addr="", master_port=0,
                     job_path=job_path, run_dir=run_dir, launched=bool(job_path))


@pytest.fixture(autouse=True)
def nothing_handed(monkeypatch):
    monkeypatch.setattr(jobsource, "_HANDED", None)


def test_under_the_harness_init_takes_the_spec_the_entry_parsed(tmp_path):
    spec = load_job(MLP, ["name=handed", "train.steps=7"])
    jobsource.hand_over(spec, tmp_path)
    # the path the agent named does not exist: reading it again would fail
    got, where = jobsource.resolve_job(env(str(tmp_path / "gone.yaml"), str(tmp_path)), None, None, ())
    assert got is spec and where == tmp_path


def test_under_the_harness_its_job_wins_over_a_yaml_the_script_names(tmp_path):
    spec = load_job(MLP, ["name=harness"])
    jobsource.hand_over(spec, tmp_path)
    got, _ = jobsource.resolve_job(env("x", str(tmp_path)), str(MLP), None, ())
    assert got.name == "harness"  # docs/script-api.md: the script's YAML is read only outside run


def test_under_the_harness_an_equal_jobspec_is_accepted_a_different_one_refused(tmp_path):
    spec = load_job(MLP, ["name=harness"])
    jobsource.hand_over(spec, tmp_path)
    e = env("x", str(tmp_path))
    assert jobsource.resolve_job(e, dataclasses.replace(spec), None, ())[0] is spec
    with pytest.raises(UsageError) as refused:
        jobsource.resolve_job(e, dataclasses.replace(spec, name="other"), None, ())
    assert "'other'" in str(refused.value) and "'harness'" in str(refused.value)
    assert "\n" not in refused.value.message  # one line, then its fix


def test_without_a_handover_the_harness_job_file_is_read_once(tmp_path):
    write_resolved(tmp_path, load_job(MLP, ["name=from-file"]))
    got, where = jobsource.resolve_job(env(str(tmp_path / runfiles.RESOLVED_SPEC), str(tmp_path)), None, None, ())
    assert got.name == "from-file" and where == tmp_path


def test_outside_the_harness_a_jobspec_argument_is_honoured_with_overrides(tmp_path):
    spec = load_job(MLP)
    got, where = jobsource.resolve_job(env(), spec, tmp_path, ())
    assert got is spec and where == tmp_path
    changed, where = jobsource.resolve_job(env(), spec, None, ["train.steps=3"])
    assert changed.train.steps == 3 and dataclasses.replace(changed, train=spec.train) == spec
    assert where == Path("runs") / spec.name


def test_an_agent_handed_the_resolved_spec_does_not_rewrite_it(tmp_path):
    from elastic_harness.checkpoint.lock import Holder

    run_dir = tmp_path / "run"
    spec = load_job(MLP)
    with prepare(run_dir, spec, holder=Holder.this_process(spec.name, "job-1")):
        pass
    resolved = run_dir / runfiles.RESOLVED_SPEC
    assert resolved.read_text() == dump_job(spec)
    assert handed_resolved(resolved, run_dir) and not handed_resolved(MLP, run_dir)
    before = resolved.stat()
    other = dataclasses.replace(spec, train=dataclasses.replace(spec.train, steps=spec.train.steps + 1))
    with prepare(run_dir, other, holder=Holder.this_process(spec.name, "job-1"), record_spec=False):
        pass
    after = resolved.stat()
    assert resolved.read_text() == dump_job(spec)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_an_agent_refuses_set_over_the_owners_resolved_spec(cli_here, tmp_path):
    from elastic_harness.checkpoint.lock import Holder

    run_dir = tmp_path / "run"
    spec = load_job(MLP)
    with prepare(run_dir, spec, holder=Holder.this_process(spec.name, "job-1")):
        pass
    resolved = run_dir / runfiles.RESOLVED_SPEC
    r = cli_here("agent", resolved, "--run-dir", run_dir, "--standalone", "--set", "train.steps=3")
    assert r.code == 2, (r.code, r.out, r.err)
    assert "--set cannot change" in r.err and "Traceback" not in r.err
    assert resolved.read_text() == dump_job(spec)


@pytest.mark.e2e  # a fresh interpreter runs a script through eh.init (torch, a process group): ~5 CPU s
def test_a_plain_python_init_runs_the_jobspec_it_is_given(tmp_path):
    """``python script.py``: ``init(spec)`` honours its argument, and builds the layout once."""
    script = tmp_path / "given.py"
    script.write_text(
        "import json, sys\n"
        "import elastic_harness as eh\n"
        "from elastic_harness.spec import load_job\n"
        f"spec = load_job({str(MLP)!r}, ['name=given', 'train.steps=3'])\n"
        f"run = eh.init(spec, run_dir={str(tmp_path / 'run')!r})\n"
        "t = run.topology\n"
        "print(json.dumps([run.spec is spec, t.kind, t.dp_degree, t.dp_rank(), str(run.run_dir)]))\n"
        "run.close()\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ELASTIC_HARNESS_JOB")}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True, "ddp", 1, 0, str(tmp_path / "run")]
    assert (tmp_path / "run" / runfiles.RESOLVED_SPEC).read_text() == dump_job(load_job(MLP, ["name=given", "train.steps=3"]))
