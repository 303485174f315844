"""Issue 23, a user's first week: mistakes that must be one line (exit 2, nothing started)
instead of a traceback, a crash loop or a silent run. Fast: no job trains here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import JOBS, MLP, REPO
from tests.test_bad_args import assert_one_line_error

pytestmark = pytest.mark.timeout(120)


def test_checkpoint_dir_that_is_a_file_is_one_line(cli_here, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run", "--set", f"checkpoint.dir={afile}")
    assert_one_line_error(r, f"checkpoint.dir '{afile}' is a file, not a directory")
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run", "--set", f"checkpoint.dir={afile}/sub")
    assert_one_line_error(r, f"checkpoint.dir '{afile}/sub' is not writable: '{afile}' is a file, not a directory")
    r = cli_here("run", MLP, "--run-dir", afile)
    assert_one_line_error(r, f"run directory '{afile}' is a file")
    assert not (tmp_path / "run").exists(), "nothing was created"


def test_checkpoint_dir_that_cannot_be_created_is_one_line(cli_here, tmp_path):
    """/sys refuses mkdir even to root (the tests may run as root, where modes do not bind)."""
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run", "--set", "checkpoint.dir=/sys/eh-checkpoints")
    assert_one_line_error(r, "checkpoint.dir '/sys/eh-checkpoints'")


def test_path_mistakes_answer_before_torch_is_imported(tmp_path):
    """Checked before the task (and torch) is imported: they answer at once."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    code = textwrap.dedent(f"""
        import sys
        from elastic_harness.cli import main
        codes = [main(["run", {str(MLP)!r}, "--run-dir", {str(tmp_path / 'run')!r},
                       "--set", "checkpoint.dir={afile}"]),
                 main(["verify", {str(tmp_path / 'missing')!r}, {str(tmp_path / 'missing2')!r}])]
        print(codes, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.stdout.strip() == "[2, 2] False", (out.stdout, out.stderr)


def test_a_build_model_that_raises_is_one_line_from_the_host(cli_here, tmp_path):
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run", "--set", "task.target=tests.tasks:BrokenModel")
    assert_one_line_error(r, "build_model() raised ValueError: hidden size must be even, got 7", "tests/tasks.py:")
    assert not (tmp_path / "run").exists(), "no worker was started"


def test_script_init_with_a_bad_override_is_one_line(tmp_path):
    """`python jobs/ddp_toy.py --set train.stpes=20`: eh.init answers as `run` does."""
    r = subprocess.run([sys.executable, str(JOBS / "ddp_toy.py"), "--set", "train.stpes=20",
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["error: job spec error: train.stpes: unknown key",
                                             "  fix: did you mean 'steps'?"]
    assert not (tmp_path / "run").exists()
