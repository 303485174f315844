"""Bring your own training, end to end: scripts, models no one here wrote, precision, data
loading, crash loops and API mistakes, through the real agent (and plain torchrun).

Every killed run must end bit-identical to its uninterrupted reference at the same world
size; resized runs within the tolerance of tests/e2e/test_e2e_core.py; with
``train.record_samples`` every epoch uses each sample exactly once (tests/audit.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_harness.checkpoint.offline import compare
from tests.audit import audit
from tests.conftest import JOBS, REPO, cli, final_ckpt, model_of
from tests.e2e.test_e2e_core import assert_close
from tests.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

TOY = JOBS / "ddp_toy.yaml"
TOY_STEPS = ["--set", "train.steps=40", "--set", "checkpoint.every_steps=10"]


def torchrun(script, *args, run_dir, timeout=300):
    """Plain torchrun (c10d on a free loopback port, 2 processes, restarts allowed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--log-dir", f"{run_dir}-torchrun-logs",
           str(script), "--run-dir", str(run_dir), *args]  # --log-dir: torchrun's default is in /tmp
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{out[-3000:]}")
    return proc.returncode, out


def events_of(run_dir, kind):
    from tests.conftest import read_jsonl

    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == kind]


@pytest.mark.compat  # .ci/compat's end-to-end set (docs/torch-versions.md)
def test_seed_script_killed_under_plain_torchrun_ends_bit_identical(tmp_path):
    ref = cli("run", str(TOY), *TOY_STEPS, "--set", "train.record_samples=true", run_dir=tmp_path / "ref")
    assert ref.code == 0, ref.err
    code, out = torchrun(JOBS / "ddp_toy.py", *TOY_STEPS, "--set", "train.record_samples=true",
                         "--set", "chaos=[{kind: kill-worker, target: 1, at_step: 25}]",
                         run_dir=tmp_path / "killed")
    assert code == 0, out[-3000:]
    (fault,) = events_of(tmp_path / "killed", "fault")
    assert fault["step"] == 25
    resumed = [e for e in events_of(tmp_path / "killed", "resume") if not e.get("fresh")]
    assert resumed and resumed[0]["step"] in (10, 20)
    (finish,) = events_of(tmp_path / "killed", "finish")
    assert finish["digest"] == ref.summary["model_digest"]
    audit(tmp_path / "killed", 2000, 40, 40)


def test_batchnorm_cnn_with_own_optimizer_scheduler_and_eval_recovers_bit_identical(tmp_path):
    job = JOBS / "cnn.yaml"
    small = ["--set", "train.steps=30", "--set", "eval.every_steps=15", "--set", "checkpoint.every_steps=10",
             "--set", "metrics.tensorboard=true"]
    ref = cli("run", str(job), *small, run_dir=tmp_path / "ref")
    assert ref.code == 0, ref.err
    killed = cli("run", str(job), *small, "--chaos", "kill-worker:0@15", run_dir=tmp_path / "killed")
    assert killed.code == 0, killed.err
    assert killed.summary["model_digest"] == ref.summary["model_digest"]
    a, b = model_of(final_ckpt(tmp_path / "killed")), model_of(final_ckpt(tmp_path / "ref"))
    assert any("num_batches_tracked" in k for k in a) and compare(a, b)["identical"]
    evals = killed.kinds("eval")
    assert [e["step"] for e in evals][-1] == 30 and {"loss", "accuracy"} <= set(evals[-1]["metrics"])
    assert any(e.get("metrics", {}).get("grad_norm") for e in killed.kinds("step"))
    assert list((tmp_path / "killed" / "tensorboard").glob("events.out.tfevents.*"))


HF = JOBS / "hf_gpt2.yaml"
HF_SMALL = ["--set", "train.steps=24", "--set", "checkpoint.every_steps=8", "--set", "eval.every_steps=0",
            "--set", "train.record_samples=true"]


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    pytest.importorskip("transformers")
    run_dir = tmp_path_factory.mktemp("hf-ref")
    r = cli("run", str(HF), *HF_SMALL, "--set", "parallelism=ddp", run_dir=run_dir)
    assert r.code == 0, r.err
    return r


def test_hugging_face_model_task_path_ddp_killed_bit_identical(hf_reference, tmp_path):
    r = cli("run", str(HF), *HF_SMALL, "--set", "parallelism=ddp", "--chaos", "kill-worker:1@13",
            run_dir=tmp_path)
    assert r.code == 0, r.err
    assert r.summary["model_digest"] == hf_reference.summary["model_digest"]
    tensors = model_of(final_ckpt(tmp_path))
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(tensors)  # tied, both names
    audit(tmp_path, 6249, 16, 24)


def test_hugging_face_model_task_path_resized_2_to_3_within_tolerance(hf_reference, tmp_path):
    common = [*HF_SMALL, "--set", "parallelism=ddp"]
    stopped = cli("run", str(HF), *common, "--chaos", "preempt:0@10", run_dir=tmp_path)
    assert stopped.code == 143, stopped.err
    resumed = cli("run", str(HF), *common, "--nproc-per-node", "3", run_dir=tmp_path)
    assert resumed.code == 0, resumed.err
    (resume,) = resumed.kinds("resume")
    assert (resume["saved_world_size"], resume["world_size"]) == (2, 3)
    assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(hf_reference.run_dir)))
    assert audit(tmp_path, 6249, 16, 24)["world_sizes"][24] == 3


def test_hugging_face_script_fsdp_bf16_loader_processes_killed_bit_identical(tmp_path):
    pytest.importorskip("transformers")
    job = JOBS / "hf_lm.yaml"
    small = ["--set", "train.steps=16", "--set", "checkpoint.every_steps=8", "--set", "eval.every_steps=8",
             "--set", "train.record_samples=true"]
    ref = cli("run", str(job), *small, run_dir=tmp_path / "ref")
    assert ref.code == 0, ref.err
    killed = cli("run", str(job), *small, "--chaos", "kill-worker:0@11", run_dir=tmp_path / "killed")
    assert killed.code == 0, killed.err
    assert killed.summary["model_digest"] == ref.summary["model_digest"]
    assert killed.kinds("eval") and killed.kinds("step")[-1]["lr"] is not None
    audit(tmp_path / "killed", 6249, 16, 16)


def test_a_crash_loop_stops_after_two_attempts_with_one_line(tmp_path):
    r = cli("run", str(JOBS / "mlp.yaml"), "--set", "task.target=tests.tasks:Poisoned",
            "--set", "task.args={poison: 700}", "--set", "max_restarts=3", run_dir=tmp_path)
    assert r.code == 2, r.err
    assert "Traceback" not in r.err
    (line,) = [x for x in r.err.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: crash loop") and "sample 700 is corrupt" in line
    attempts = {e["restart"] for e in r.kinds("failure") if e.get("signature")}
    assert attempts == {0, 1}, "stopped after the second identical failure, not after max_restarts"


@pytest.mark.parametrize("mistake, words", [
    ("no-step-hook", "did not call step.done()"),
    ("stray-optimizer", "not parameters of the registered model"),
    ("bad-evaluate", "crash loop"),
    ("unwrapped", "not wrapped for data parallelism"),
    ("unregistered-scheduler", "an LR scheduler (LinearLR) steps the registered optimizer but was not registered"),
])
def test_api_mistakes_in_a_script_are_one_line(tmp_path, mistake, words):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: mistake\nscript: {{path: {REPO / 'tests/scripts/mistakes.py'}, "
                   f"args: [--mistake, {mistake}]}}\nnproc_per_node: 2\n"
                   "train: {steps: 4, global_batch_size: 4, micro_batch_size: 2}\n")
    r = cli("run", str(job), run_dir=tmp_path / "run")
    assert r.code == 2, (r.code, r.err)
    (line,) = [x for x in r.err.splitlines() if x.startswith("error: ")]
    assert "Traceback" not in r.err and words in line
    if mistake == "bad-evaluate":  # a bug in evaluate repeats: stopped on the second attempt
        assert "evaluate raised ZeroDivisionError" in r.err
