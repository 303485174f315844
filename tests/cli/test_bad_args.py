"""Every bad argument to every command: one ``error:`` line (with a fix where one helps),
exit 2, no traceback, nothing created.

Commands run in this process through the real entry point (``cli.main``, which is what
``elastic-harness`` and ``python -m elastic_harness`` call; the ``cli_here`` fixture); none
of these inputs gets far enough to start a process. ``test_every_command_is_walked`` keeps the walk complete: a new
(sub)command without bad-argument cases here fails it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_harness.cli import build_parser
from elastic_harness.errors import SpecError
from elastic_harness.launch.config import node_options, with_port
from elastic_harness.spec import parse_job
from tests.cli.test_cli_imports import leaf_commands
from tests.conftest import MLP, Result, cli

pytestmark = pytest.mark.timeout(120)


def assert_one_line_error(r: Result, *words: str) -> None:
    assert r.code == 2, (r.code, r.out, r.err)
    assert "Traceback" not in r.err + r.out
    errors = [line for line in r.err.splitlines() if line.startswith("error: ") or ": error: " in line]
    assert len(errors) == 1, r.err
    for w in words:
        assert w in r.err, (w, r.err)


@pytest.fixture
def inputs(tmp_path: Path) -> SimpleNamespace:
    """A file that is not a directory, an empty directory, broken checkpoint files."""
    afile = tmp_path / "a-file"
    afile.write_text("just text\n")
    adir = tmp_path / "a-dir"
    adir.mkdir()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x03\x00")
    return SimpleNamespace(afile=afile, adir=adir, garbage=garbage, missing=tmp_path / "missing",
                           job=MLP)


# --- one test per case named in the issue -------------------------------------------------


def test_set_value_that_is_not_yaml(cli_here):
    for command in ("run", "spec"):
        r = cli_here(command, MLP, "--set", "train.steps=[1")
        assert_one_line_error(r, "train.steps", "'[1' is not valid YAML", "expected ',' or ']'", "fix: ")


def test_the_real_entry_point_exits_2_without_a_traceback(tmp_path):
    """The in-process calls here go through ``main``; this one is the process users run."""
    r = cli("run", str(MLP), "--set", "train.steps=[1", run_dir=tmp_path / "run", timeout=60)
    assert_one_line_error(r, "'[1' is not valid YAML")
    assert not (tmp_path / "run").exists()


def test_yaml_parse_error_keeps_pyyaml_reason():
    with pytest.raises(SpecError) as e:
        parse_job("name: x\ntrain: {steps: 3\n  bad: [\n", source="job.yaml")
    assert "job.yaml is not valid YAML at line 3, column 6: expected ',' or '}', but got ':'" in str(e.value)
    assert e.value.hint


def test_endpoint_without_port_gets_torchruns_default(tmp_path):
    spec = parse_job("name: x\ntask: {target: 'a.b:C'}\n")
    opts = node_options(spec, tmp_path, {"rdzv_endpoint": "localhost"}, {})
    assert opts.rdzv_endpoint == "localhost:29400"
    etcd = node_options(spec, tmp_path, {"rdzv_endpoint": "etcd-0", "rdzv_backend": "etcd"}, {})
    assert etcd.rdzv_endpoint == "etcd-0:2379"
    assert node_options(spec, tmp_path, {}, {"PET_RDZV_ENDPOINT": "w-0"}).rdzv_endpoint == "w-0:29400"
    assert with_port("[::1]", 29400) == "[::1]:29400" and with_port("[::1]:5", 1) == "[::1]:5"
    for bad in ("localhost:abc", "localhost:0", "localhost:70000", ":29400"):
        with pytest.raises(SpecError) as e:
            node_options(spec, tmp_path, {"rdzv_endpoint": bad}, {})
        assert e.value.path == "--rdzv-endpoint", bad


def test_node_counts_from_flags_and_env_are_checked(tmp_path):
    spec = parse_job("name: x\ntask: {target: 'a.b:C'}\nrendezvous: {endpoint: 'h:1'}")
    cases = [({"nnodes": "0"}, {}, "--nnodes"), ({"nnodes": "2:1"}, {}, "--nnodes"),
             ({}, {"PET_NPROC_PER_NODE": "two"}, "PET_NPROC_PER_NODE"),
             ({"max_restarts": -1}, {}, "--max-restarts")]
    for flags, env, source in cases:
        with pytest.raises(SpecError) as e:
            node_options(spec, tmp_path, flags, env)
        assert e.value.path == source


def test_import_of_a_corrupt_or_truncated_safetensors_file(cli_here, inputs, tmp_path):
    import torch
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(good))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    for bad in (inputs.garbage, truncated):
        r = cli_here("ckpt", "import", bad, MLP, "--run-dir", tmp_path / "run")
        assert_one_line_error(r, f"'{bad}' is not a readable .safetensors file", "fix: ")
        assert_one_line_error(cli_here("ckpt", "diff", bad, good), "is not a readable .safetensors file")
    assert not (tmp_path / "run").exists()


def test_import_of_a_missing_file_says_so(cli_here, inputs, tmp_path):
    r = cli_here("ckpt", "import", tmp_path / "model.pt", MLP, "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "model.pt' does not exist", "fix: check the path")
    assert "state_dict" not in r.err
    assert_one_line_error(cli_here("ckpt", "import", inputs.adir, MLP), "is a directory")
    assert not (tmp_path / "run").exists()


def test_import_of_a_damaged_torch_file(cli_here, tmp_path):
    import torch

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(64, 64)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    r = cli_here("ckpt", "import", truncated, MLP, "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "is not a readable torch.save file", "truncated or corrupt")


def test_spec_checks_the_task_or_says_it_did_not(cli_here):
    r = cli_here("spec", MLP, "--set", "task.target=no_such_pkg.tasks:Task")
    assert_one_line_error(r, "cannot import module 'no_such_pkg.tasks'")
    unchecked = cli_here("spec", MLP, "--set", "task.target=no_such_pkg.tasks:Task", "--no-task-check")
    assert unchecked.code == 0 and unchecked.out.splitlines()[-1].startswith("# task.target")
    assert "NOT checked" in unchecked.out
    ok = cli_here("spec", MLP)
    assert ok.code == 0 and "imports and accepts task.args" in ok.out.splitlines()[-1]
    assert parse_job(ok.out).name == "mlp"  # the verdict is a YAML comment: still a job file


# --- the walk: every command and sub-command with bad arguments ---------------------------


def bad_arguments(i: SimpleNamespace) -> dict[str, list[list]]:
    """Per command: missing required arguments, missing files, non-directories, nonsense."""
    run_dir = ["--run-dir", i.adir / "run"]
    return {
        "": [[], ["no-such-command"]],
        "run": [[], [i.missing], [i.adir], [i.job, "--nodes", "abc"], [i.job, "--nodes", "0", *run_dir],
                [i.job, "--run-dir", i.afile], [i.job, "--set", "train.steps=[1"],
                [i.job, "--nproc-per-node", "0", *run_dir]],
        "agent": [[], [i.missing], [i.job, "--rdzv-endpoint", "localhost:abc", "--rdzv-id", "x", *run_dir],
                  [i.job, "--rdzv-endpoint", "localhost", "--rdzv-id", "x", "--nnodes", "0", *run_dir],
                  [i.job, "--rdzv-endpoint", "localhost", *run_dir],
                  [i.job, "--rdzv-endpoint", "localhost", "--rdzv-id", "x", "--run-dir", i.afile / "x"],
                  [i.job, "--rdzv-endpoint", "localhost", "--rdzv-id", "x", "--endpoint-port", "70000", *run_dir],
                  [i.job, "--rdzv-endpoint", "localhost", "--rdzv-id", "x", "--nproc-per-node", "0", *run_dir]],
        "spec": [[i.missing], [i.adir], [i.afile], [i.job, "--set", "nonsense"]],
        "report": [[], [i.missing], [i.afile], [i.adir]],
        "verify": [[], [i.missing, i.missing], [i.afile, i.adir], [i.adir, i.adir, "--atol", "x"]],
        "chaos": [[], [i.missing, "kill-worker:1"], [i.afile, "kill-worker:1"], [i.adir],
                  ["--k8s", "nonsense"], ["--k8s", "kill-node:1"]],
        "ckpt": [[]],
        "ckpt ls": [[], [i.missing], [i.afile], [i.adir, "--verify", "nonsense"]],
        "ckpt verify": [[], [i.missing], [i.afile], [i.adir, "--mode", "nonsense"]],
        "ckpt export": [[i.adir], [i.missing, "--to", i.adir / "m.pt"], [i.afile, "--to", i.adir / "m.pt"],
                        [i.adir, "--to", i.adir / "m.pt"], [i.adir, "--to", "m.pt", "--step", "x"]],
        "ckpt import": [[], [i.missing, i.job], [i.garbage, i.job, *run_dir], [i.adir, i.job],
                        [i.afile, i.job, *run_dir], [i.garbage, i.missing]],
        "ckpt diff": [[i.adir], [i.missing, i.adir], [i.garbage, i.garbage], [i.afile, i.adir]],
        "ckpt trust": [[], [i.missing], [i.afile], [i.adir], [i.adir, "--key", i.missing]],
        "k8s": [[]],
        "k8s render": [[], [i.job], [i.missing, "--flavor", "plain"], [i.job, "--flavor", "nope"],
                       [i.job, "--flavor", "plain", "--out", i.afile]],
        "submit": [[], [i.missing], [i.adir], [i.job, "--scheduler", "nope"], [i.job, "--nodes", "abc", *run_dir],
                   [i.job, "--nodes", "0", *run_dir], [i.job, "--run-dir", i.afile], [i.job, "--set", "train.steps=[1"],
                   [i.job, "--scheduler", "slurm", "--time", "soon", *run_dir],
                   [i.job, "--scheduler", "slurm", "--sbatch", "exclusive", *run_dir],
                   [i.job, "--scheduler", "k8s", "--flavor", "nope"], [i.job, "--nproc-per-node", "0", *run_dir]],
        "status": [[i.missing], ["no-such-job"], [i.afile], [i.adir], ["--json", "no-such-job"]],
        "list": [["--bogus"], ["extra"]],
        "logs": [[], ["no-such-job"], [i.adir], ["x", "--rank", "1", "--node", "0"], ["x", "--since", "soon"],
                 ["x", "--rank", "abc"]],
        "stop": [[], ["no-such-job"], [i.afile], [i.adir], ["x", "--timeout", "0"]],
        "slurm": [[]],
        "slurm render": [[], [i.missing], [i.job, "--time", "soon"], [i.job, "--rdzv-port", "0"],
                         [i.job, "--set", "rendezvous.backend=etcd"], [i.job, "--run-dir", i.adir / "my runs"]],
        "bench": [[], ["nope"]],
        "bench buddy": [["--steps", "5"], ["--block", "0"], ["--depth", "0"], ["--out", i.missing / "x.json"],
                        ["--out", i.adir]],
        "bench checkpoint": [["--size", "-5"], ["--size", "lots"], ["--repeats", "0"], ["--dir", i.afile],
                             ["--dir", i.missing], ["--out", i.missing / "x.json"], ["--out", i.adir]],
        "bench recovery": [["--repeats", "0"], ["--only", "nope"], ["--dir", i.afile],
                           ["--out", i.missing / "x.json"], ["--faults", "x"], ["--churn-every", "900"],
                           ["--nodes", "1"], ["--soak-jobs", "0"]],
        "bench inflight": [["--repeats", "0"], ["--groups", "4"], ["--timeout", "0"], ["--dir", i.afile],
                           ["--dir", i.missing], ["--out", i.missing / "x.json"], ["--out", i.adir]],
        "bench rendezvous-scale": [["--nodes", "1,2"], ["--nodes", "x"], ["--idle", "0"], ["--to", "1"],
                                   ["--out", i.missing / "x.json"], ["--out", i.adir]],
        "bench rendezvous": [["--repeats", "0"], ["--nodes", "0"], ["--rounds", "x"], ["--out", i.missing / "x.json"],
                             ["--out", i.adir]],
        "bench throughput": [["--repeats", "0"], ["--only", "nope"], ["--dir", i.afile], ["--dir", i.missing],
                             ["--out", i.missing / "x.json"], ["--out", i.adir], ["--steps", "5"],
                             ["--global-batch", "48"], ["--workers", "-1"], ["--image-px", "8"]],
    }


def test_every_command_is_walked(inputs):
    walked = set(bad_arguments(inputs)) - {""}
    assert leaf_commands(build_parser()) - walked == set()


def test_every_command_answers_bad_arguments_in_one_line(cli_here, inputs, tmp_path):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    failures = []
    for command, cases in bad_arguments(inputs).items():
        for args in cases:
            argv = [*command.split(), *map(str, args)]
            r = cli_here(*argv)
            try:
                assert_one_line_error(r)
            except AssertionError as e:
                failures.append(f"elastic-harness {' '.join(argv)}: {e}")
    assert failures == []
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "nothing is created"
