"""Issue 23, a user's first week: mistakes that must be one line (exit 2, nothing started)
instead of a traceback, a crash loop or a silent run. Fast: no job trains here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.cli.test_bad_args import assert_one_line_error
from tests.conftest import JOBS, MLP, REPO

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


@pytest.mark.e2e  # runs the real jobs/ddp_toy.py in a fresh interpreter (it imports torch first): ~5 CPU s
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


# ----- mistakes that trained to the end silently (issue 23, items 1 and 2) -------------------
def _model_and_optimizer():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_an_unregistered_scheduler_over_the_registered_optimizer_is_found():
    import torch

    from elastic_harness.errors import UsageError
    from elastic_harness.runtime.registration import check_schedulers, unregistered_schedulers

    model, opt = _model_and_optimizer()
    assert unregistered_schedulers(opt, []) == [], "none built: nothing searched, nothing found"
    warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=10)
    with pytest.raises(UsageError, match=r"LR scheduler \(LinearLR\) steps the registered optimizer") as e:
        check_schedulers(opt, [None])
    assert "scheduler=scheduler" in e.value.hint
    check_schedulers(opt, [warm])
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 100)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[10])
    assert unregistered_schedulers(opt, [seq]) == [], "SequentialLR saves its parts"
    assert unregistered_schedulers(opt, [warm]) == [cos, seq]
    assert unregistered_schedulers(opt, [None, {"extra": 1}, seq]) == []
    _, other = _model_and_optimizer()
    torch.optim.lr_scheduler.StepLR(other, 5)  # another optimizer's: not ours to judge
    check_schedulers(opt, [seq])


def test_a_dropped_scheduler_is_not_counted():
    import torch

    from elastic_harness.runtime.registration import unregistered_schedulers

    model, opt = _model_and_optimizer()

    def build_and_drop():
        torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=10)

    build_and_drop()
    assert unregistered_schedulers(opt, []) == []


def test_replicas_that_differ_are_named():
    import torch

    from elastic_harness.runtime.registration import distributed, parameters_digest, replicas_differ

    a, _ = _model_and_optimizer()
    b, _ = _model_and_optimizer()
    b.load_state_dict(a.state_dict())
    assert not distributed(a) and not distributed(torch.compile(a))
    same = parameters_digest(a)
    assert replicas_differ(a, lambda d: [d, same, same]) == []
    with torch.no_grad():
        b[0].bias[0] += 1e-6
    assert replicas_differ(a, lambda d: [d, parameters_digest(b), d]) == [1]


# ----- torchrun's habits (issue 23) ----------------------------------------------------------
def test_run_splits_a_scripts_own_arguments_as_torchrun_does():
    from elastic_harness.cli import build_parser, parse

    parser = build_parser()
    a = parse(parser, ["run", "--nproc-per-node", "cpu", "--nnodes", "1:3", "--set", "train.steps=5",
                       "train.py", "--lr", "3", "--set", "mine"])
    assert (a.job, a.nproc_per_node, a.nnodes) == ("train.py", "cpu", "1:3")
    assert a.script_args == ["--lr", "3", "--set", "mine"], "after the script: the script's"
    assert a.set == ["train.steps=5", "mine"], "and --set among them counts, as under python (eh.init(argv=))"
    b = parse(parser, ["run", "job.yaml", "--set", "train.steps=5", "--nodes", "2"])
    assert (b.job, b.set, b.nodes, b.script_args) == ("job.yaml", ["train.steps=5"], 2, [])
    c = parse(parser, ["run", "--run-dir", "x.py", "job.yaml"])
    assert (c.job, c.run_dir) == ("job.yaml", "x.py"), "an option's value is not the script"


def test_flags_after_a_script_are_taken_as_python_takes_them(cli_here, tmp_path, monkeypatch):
    """`run jobs/ddp_toy.py --set train.steps=5 --run-dir X` runs the job `python jobs/ddp_toy.py
    --set train.steps=5 --run-dir X` runs (not the YAML's 200 steps in runs/ddp-toy)."""
    from elastic_harness.commands import run

    started = []
    monkeypatch.setattr(run, "launch_local", lambda spec, run_dir, *a, **k: started.append((spec, run_dir)) or 0)
    r = cli_here("run", JOBS / "ddp_toy.py", "--set", "train.steps=5", "--run-dir", tmp_path / "X", "--lr", "3")
    assert r.code == 0, r.err
    ((spec, run_dir),) = started
    assert (spec.train.steps, run_dir) == (5, (tmp_path / "X").resolve())
    assert spec.script.args == ["--set", "train.steps=5", "--run-dir", str(tmp_path / "X"), "--lr", "3"], \
        "the script still gets every argument, as under python"
    r = cli_here("run", "--run-dir", tmp_path / "Y", JOBS / "ddp_toy.py", "--run-dir", tmp_path / "X")
    assert_one_line_error(r, "two run directories", "give --run-dir once")
    r = cli_here("run", JOBS / "ddp_toy.py", "--job", MLP)
    assert_one_line_error(r, f"--job {MLP} after the script", f"elastic-harness run {MLP}")
    assert len(started) == 1 and not (tmp_path / "Y").exists()


def test_run_of_a_script_without_yaml_uses_the_defaults_and_flags(tmp_path):
    import os

    from elastic_harness.cli import build_parser, parse
    from elastic_harness.commands.run import load_with_flags

    script = tmp_path / "my train.py"
    script.write_text("print('hi')\n")
    args = parse(build_parser(), ["run", "--nnodes", "2:4", "--nproc-per-node", "cpu",
                                  "--set", "train.steps=7", str(script), "--epochs", "3"])
    spec = load_with_flags(args)
    assert spec.name == "my-train" and spec.script.path == str(script.resolve())
    assert spec.script.args == ["--epochs", "3"] and spec.train.steps == 7
    assert (spec.nodes.min, spec.nodes.max, spec.nproc_per_node) == (2, 4, os.cpu_count() or 1)


def test_run_flags_in_torchruns_words_are_checked(cli_here, tmp_path, monkeypatch):
    from elastic_harness.launch import config

    monkeypatch.setattr(config, "device_count", lambda kind: 0 if kind == "gpu" else 3)
    r = cli_here("run", MLP, "--nproc-per-node", "gpu", "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "no GPU is visible", "use a number, cpu or auto")
    r = cli_here("run", MLP, "--nproc-per-node", "two", "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "--nproc-per-node", "write a number, or gpu, cpu or auto")
    r = cli_here("run", MLP, "--nnodes", "3:2", "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "min (3) is greater than max (2)")
    r = cli_here("run", tmp_path / "missing.py")
    assert_one_line_error(r, "script", "missing.py' does not exist")
    assert not (tmp_path / "run").exists()


# ----- k8s render of a script job (issue 23, item 5) ------------------------------------------
@pytest.mark.parametrize("flavor", ["plain", "pytorchjob"])
def test_k8s_render_ships_a_scripts_text_in_the_configmap(flavor, capsys, monkeypatch):
    import yaml

    from elastic_harness.cli import main
    from elastic_harness.spec import parse_job

    monkeypatch.chdir(REPO)
    assert main(["k8s", "render", "jobs/ddp_toy.yaml", "--flavor", flavor]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["data"]["ddp_toy.py"] == (JOBS / "ddp_toy.py").read_text()
    shipped = parse_job(cm["data"]["job.yaml"])
    assert shipped.script.path == "/etc/elastic-harness/ddp_toy.py", "where the pods mount the ConfigMap"
    mounts = [m for d in docs for c in _containers(d) for m in c.get("volumeMounts", []) if m["name"] == "job"]
    assert mounts and {m["mountPath"] for m in mounts} == {"/etc/elastic-harness"}


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    templates = [spec.get("template")] + [r.get("template") for r in spec.get("pytorchReplicaSpecs", {}).values()]
    return [c for t in templates if t for c in t["spec"]["containers"]]


def test_k8s_render_of_a_script_it_cannot_find_says_where_to_run(cli_here, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: mine\nscript: {path: elsewhere/train.py}\n")
    r = cli_here("k8s", "render", job, "--flavor", "plain")
    assert_one_line_error(r, "script.path 'elsewhere/train.py' does not exist",
                          "the pods get the script from the job's ConfigMap", "fix: run this from the directory")


# ----- ckpt import of a migrating user's rank-0 file (issue 23) ------------------------------
def _legacy_file(path, optimizer="adamw", epoch=3):
    import torch

    from elastic_harness.spec import load_job
    from elastic_harness.tasks import load_task

    spec = load_job(MLP)
    task = load_task(spec.task.target, spec.task.args)
    torch.manual_seed(5)
    model = task.build_model()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x = torch.stack([task.dataset()[i][0] for i in range(4)])
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(), "epoch": epoch}, path)
    return model, opt


def _saved(step_dir, tmp_path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp_path / "flat.pt"))
    return torch.load(tmp_path / "flat.pt", weights_only=False)


def test_ckpt_import_keeps_the_optimizer_state_and_the_named_epoch(cli_here, tmp_path):
    import torch

    model, opt = _legacy_file(tmp_path / "legacy.pt")
    r = cli_here("ckpt", "import", tmp_path / "legacy.pt", MLP, "--run-dir", tmp_path / "run", "--epoch", "1")
    assert r.code == 0, r.err
    assert "optimizer state of 6 parameters, step 34" in r.out  # 1024 samples / 30 per step
    (step_dir,) = (tmp_path / "run" / "checkpoints").glob("step-*")
    assert step_dir.name == "step-0000034"
    sd = _saved(step_dir, tmp_path)
    assert int(sd["train"]["step"]) == 34 and int(sd["train"]["cursor"]) == 1024, "epoch 1 starts at sample 1024"
    for i, (name, _) in enumerate(model.named_parameters()):
        theirs = opt.state_dict()["state"][i]
        assert torch.equal(sd["optim"]["state"][name]["exp_avg"], theirs["exp_avg"]), name
        assert torch.equal(sd["optim"]["state"][name]["exp_avg_sq"], theirs["exp_avg_sq"]), name
    assert sd["optim"]["param_groups"][0]["lr"] == 0.01, "the job's settings, not the file's"


def test_ckpt_import_without_a_position_says_what_the_file_holds(cli_here, tmp_path):
    _legacy_file(tmp_path / "legacy.pt")
    r = cli_here("ckpt", "import", tmp_path / "legacy.pt", MLP, "--run-dir", tmp_path / "run")
    assert r.code == 0 and "step 0)" in r.out
    assert "note: the file says epoch 3; this import starts at step 0" in r.out
    r = cli_here("ckpt", "import", tmp_path / "legacy.pt", MLP, "--run-dir", tmp_path / "run2", "--epoch", "3")
    assert_one_line_error(r, "the imported position (step 102) leaves nothing to train: train.steps is 60")


def test_ckpt_import_refuses_an_optimizer_state_that_does_not_fit(cli_here, tmp_path):
    import torch

    _legacy_file(tmp_path / "sgd.pt", optimizer="sgd")
    r = cli_here("ckpt", "import", tmp_path / "sgd.pt", MLP, "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "the file's optimizer is another kind than the job's", "optimizer.name")
    _legacy_file(tmp_path / "legacy.pt")
    f = torch.load(tmp_path / "legacy.pt", weights_only=True)
    state = f["optimizer"]["state"]
    state[0], state[1] = state[1], state[0]  # saved over the parameters in another order
    torch.save(f, tmp_path / "shuffled.pt")
    r = cli_here("ckpt", "import", tmp_path / "shuffled.pt", MLP, "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "the file's optimizer state for parameter 0", "'0.weight' (shape (64, 16))")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_script_api_page_names_what_exists():
    """docs/script-api.md's table names attributes a script can read: each must exist."""
    import re

    from elastic_harness.runtime.session import Run
    from elastic_harness.runtime.step import Step

    text = (REPO / "docs" / "script-api.md").read_text()
    named = set(re.findall(r"`(run|step)\.(\w+)", text))
    assert {("run", "spec"), ("step", "number"), ("run", "steps")} <= named
    for owner, attr in named:
        cls = Run if owner == "run" else Step
        assert hasattr(cls, attr) or attr in _instance_attrs(cls), f"{owner}.{attr}"
    assert "map-style" in text and "stdout.log" in text and "train.steps" in text


def _instance_attrs(cls) -> set[str]:
    import inspect
    import re

    return set(re.findall(r"self\.(\w+)", inspect.getsource(cls.__init__)))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_names_faults_that_did_not_fire_and_a_node_that_never_joined(tmp_path):
    """add-node one step before the end: the new agent (seconds to start) cannot join before
    the job finishes. `run` says so, and the fault that never came, and exits 0 without
    waiting out the shutdown grace for that node."""
    from tests.conftest import cli

    r = cli("run", str(MLP), "--set", "train.steps=12", "--set", "nodes.max=2", "--set", "checkpoint.every_steps=0",
            "--chaos", "add-node@11", "--chaos", "kill-node:0@900s", run_dir=tmp_path / "run")
    assert r.code == 0, r.err[-3000:]
    assert "warning: 1 scheduled fault(s) did not fire: kill-node:0@900s (the run ended after step 12)" in r.err
    assert "note: node 1 had not joined the job when it finished (it was stopped)" in r.err
    assert [e["kind"] for e in r.kinds("fault")] == ["add-node"]


def test_submit_checks_the_paths_too(cli_here, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    r = cli_here("submit", MLP, "--run-dir", tmp_path / "run", "--set", f"checkpoint.dir={afile}")
    assert_one_line_error(r, f"checkpoint.dir '{afile}' is a file, not a directory")
    assert not (tmp_path / "run").exists()


def test_spec_of_a_script_job_checks_the_script_not_an_empty_task(cli_here, monkeypatch):
    monkeypatch.chdir(REPO)
    ok = cli_here("spec", "jobs/ddp_toy.yaml")
    assert ok.code == 0 and ok.out.splitlines()[-1] == "# valid; script.path 'ddp_toy.py' exists and compiles", ok.err
    r = cli_here("spec", MLP, "--set", "task.target=tests.tasks:BrokenModel")
    assert_one_line_error(r, "build_model() raised ValueError")
