"""A scheduler is one module and one line in ``lifecycle.schedulers.SCHEDULERS`` (issue 34,
item 6): its flags, its description and its part of the job record are its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.local import LocalScheduler, Supervisor
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.schedulers import SCHEDULERS
from elastic_harness.lifecycle.slurm import SlurmScheduler
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(120)


class TapeScheduler:
    """Everything a new scheduler writes: this class, then its line in ``SCHEDULERS``."""

    name = "tape"
    description = "a test scheduler that keeps what it was given"
    keeps_run_dir = True

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def add_options(parser) -> None:
        parser.add_argument_group("tape").add_argument("--label", default="", help="tape: a label to keep")

    @staticmethod
    def options(args) -> dict:
        return {"label": args.label}

    def where(self, record: JobRecord) -> str:
        return f"tape {record.details['label']}"

    def summary(self, record: JobRecord) -> dict:
        return {"label": record.details["label"]}

    def check(self) -> None:
        return None

    def submit(self, sub) -> JobRecord:
        return JobRecord(id=sub.job_id, name=sub.spec.name, scheduler=self.name, submitted=1.0,
                         total_steps=sub.spec.train.steps, run_dir=str(sub.run_dir),
                         details={"label": sub.options["label"]})

    def status(self, record):
        raise AssertionError("not asked here")

    def logs(self, record, query, out) -> None:
        raise AssertionError("not asked here")

    def stop(self, record, now: bool) -> None:
        raise AssertionError("not asked here")


def test_a_new_scheduler_is_one_class_and_one_registry_line(cli_here, monkeypatch, tmp_path):
    monkeypatch.setitem(SCHEDULERS, "tape", f"{__name__}:TapeScheduler")
    shown = " ".join(cli_here("submit", "--help").out.split())  # as argparse wraps it at any width
    assert "tape, a test scheduler that keeps what it was given" in shown and "--label" in shown
    r = cli_here("submit", MLP, "--scheduler", "tape", "--label", "L1", "--run-dir", tmp_path / "run", "--json")
    assert r.code == 0, r.err
    said = json.loads(r.out)
    assert (said["scheduler"], said["label"], said["run_dir"]) == ("tape", "L1", str(tmp_path / "run"))
    assert registry.load(said["id"], registry.state_dir()).details == {"label": "L1"}
    r = cli_here("submit", MLP, "--scheduler", "tape", "--label", "L2", "--run-dir", tmp_path / "other")
    assert r.code == 0 and "submitted to tape (tape L2, run dir" in r.err, r.err


def test_records_stay_flat_json_and_records_written_before_details_still_read(tmp_path):
    """0.2 wrote each scheduler's fields beside the common ones; 0.3 writes the same JSON."""
    common = {"id": "mlp-1", "name": "mlp", "submitted": 1.0, "total_steps": 5, "run_dir": "/r",
              "job_file": "/j.yaml", "via": "submit"}
    old = {**common, "scheduler": "slurm", "host": "", "pid": 0, "pid_start": "", "session": False,
           "slurm_job": "42", "k8s": {}}
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "mlp-1.json").write_text(json.dumps(old))
    rec = registry.load("mlp-1", tmp_path)
    assert SlurmScheduler(tmp_path).where(rec) == "Slurm job 42"
    assert json.loads(rec.to_json()) == old
    local = JobRecord(**{**common, "scheduler": "local"}, details={"host": "h", "pid": 7, "session": True})
    assert Supervisor.of(local) == Supervisor("h", 7, "", True)
    assert LocalScheduler(tmp_path).summary(local) == {"pid": 7}
    assert json.loads(local.to_json())["pid"] == 7


def test_run_registers_itself_once_by_its_supervisors_pid(tmp_path, monkeypatch):
    """`run` of a submitted job finds the record `submit` wrote (its own pid): kept as is."""
    from elastic_harness.commands.run import register_run
    from elastic_harness.lifecycle.local import supervisor_record
    from elastic_harness.spec import load_job

    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path))
    spec = load_job(MLP)
    submitted = supervisor_record(spec, tmp_path / "run", MLP, "mlp-1", os.getpid(), via="submit", session=True)
    registry.save(submitted, tmp_path)
    register_run(spec, tmp_path / "run", MLP, "mlp-1")
    assert registry.load("mlp-1", tmp_path) == submitted
    register_run(spec, tmp_path / "run", MLP, "mlp-2")  # a job started in a terminal: recorded now
    assert Supervisor.of(registry.load("mlp-2", tmp_path)).pid == os.getpid()
