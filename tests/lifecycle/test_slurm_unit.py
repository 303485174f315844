"""Slurm and torchrun's language, the pure parts: the sbatch script, what Slurm's commands
print (recorded from Slurm 22.05 on this machine), Slurm's variables as agent defaults, and
the agent's torchrun-style options. ``test_e2e_slurm.py`` runs the script on a real Slurm.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elastic_harness import exitcodes
from elastic_harness.errors import HarnessError, SpecError
from elastic_harness.launch import slurm_env
from elastic_harness.launch.config import NodeOptions, node_options, parse_rdzv_conf, rdzv_configs
from elastic_harness.lifecycle import slurm
from elastic_harness.lifecycle.slurm_script import ScriptJob, SlurmOptions, render
from elastic_harness.spec import parse_job

pytestmark = pytest.mark.timeout(60)

JOB = "name: demo\ntask: {target: 'a.b:C'}\nnodes: {min: 1, max: 3}\nnproc_per_node: 2\ntrain: {global_batch_size: 12}\n"
SCRIPT_JOB = ScriptJob("demo", "/shared/run/lifecycle/demo-1.job.yaml", "/shared/run", "demo-1", "/home/u")


def script(job: str = JOB, **options) -> str:
    return render(parse_job(job), SCRIPT_JOB, SlurmOptions(python="/opt/venv/bin/python", **options))


def test_sbatch_script_asks_for_the_elastic_range_and_drains_before_the_limit():
    text = script(time="2:00:00", partition="gpu", extra=["--exclusive"])
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["--job-name=demo", "--nodes=1-3", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                      "--output=/shared/run/logs/slurm-%j.out", "--chdir=/home/u", "--signal=TERM@60",
                      "--partition=gpu", "--time=2:00:00", "--exclusive"]
    assert 'HOST0=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    agent = text[text.index("srun "):text.index("code=$?")]
    for part in ('--ntasks-per-node=1', '--output="$RUN_DIR/logs/agent-%n.log"', '"$PY" -m elastic_harness agent "$JOB_FILE"',
                 '--job-id "$JOB_ID"', '--rdzv-endpoint "$ENDPOINT"', '--rdzv-id "$JOB_ID-$ATTEMPT"',
                 "--nnodes 1:3", "--nproc-per-node 2", "--rdzv-backend c10d"):
        assert part in agent, part
    assert "PY=/opt/venv/bin/python" in text and 'STOP_FILE="$RUN_DIR/lifecycle/$JOB_ID.stop"' in text
    lo, hi = exitcodes.SIGNAL_CODES
    assert f'[ "$code" -eq {exitcodes.INFRA} ] || {{ [ "$code" -ge {lo} ] && [ "$code" -le {hi} ]; }}' in text
    assert subprocess.run(["bash", "-n"], input=text, text=True, timeout=10).returncode == 0


def requeue_decision(tmp_path: Path, code: int, stop: bool, attempt: int = 0) -> str:
    """Run the script's requeue decision in bash, with `scontrol` a function that says what it got."""
    text = script(max_requeues=2)
    tail = text[text.index("code=$?") + len("code=$?"):text.index("exit $code")]
    run_dir = tmp_path / f"run-{code}-{stop}-{attempt}"
    (run_dir / "lifecycle").mkdir(parents=True)
    if stop:
        (run_dir / "lifecycle" / "demo-1.stop").write_text("{}")
    prelude = (f"scontrol() {{ echo \"scontrol $*\"; }}\ncode={code}\nATTEMPT={attempt}\nSLURM_JOB_ID=7\n"
               f"STOP_FILE={run_dir}/lifecycle/demo-1.stop\n")
    return subprocess.run(["bash", "-c", prelude + tail], capture_output=True, text=True, timeout=10).stdout


def test_the_script_requeues_only_what_a_retry_can_fix(tmp_path):
    assert "scontrol requeue 7" in requeue_decision(tmp_path, 143, stop=False)
    assert "scontrol requeue 7" in requeue_decision(tmp_path, exitcodes.INFRA, stop=False)
    assert "not requeued" in requeue_decision(tmp_path, 143, stop=True), "a stop is not a preemption"
    assert requeue_decision(tmp_path, 2, stop=False) == "", "a permanent error is not retried"
    assert requeue_decision(tmp_path, 1, stop=False) == ""
    assert "giving up" in requeue_decision(tmp_path, 143, stop=False, attempt=2)


def test_script_variants_and_refusals():
    fixed = script(JOB.replace("max: 3", "max: 1") + "device: cuda\n")
    assert "#SBATCH --nodes=1\n" in fixed and "#SBATCH --gpus-per-node=2" in fixed
    etcd = script(JOB + "rendezvous: {backend: etcd, endpoint: 'etcd-0:2379'}\n")
    assert "ENDPOINT=etcd-0:2379" in etcd and "HOST0" not in etcd and "--rdzv-backend etcd" in etcd
    by_hand = render(parse_job(JOB), ScriptJob("demo", "/j.yaml", "/r", "", "/w", ("train.steps=5",)),
                     SlurmOptions(python="/p"))
    assert "JOB_ID=demo-slurm$SLURM_JOB_ID" in by_hand and "--set train.steps=5" in by_hand
    with pytest.raises(HarnessError, match="rendezvous.endpoint is empty"):
        script(JOB + "rendezvous: {backend: etcd}\n")
    with pytest.raises(HarnessError, match="white space"):
        render(parse_job(JOB), ScriptJob("demo", "/j", "/my runs/x", "", "/w"), SlurmOptions(python="/p"))
    for bad, match in ((dict(time="2 hours"), "not a Slurm time"), (dict(rdzv_port=0), "not a port"),
                       (dict(extra=["exclusive"]), "not an sbatch option"), (dict(max_requeues=-1), "negative")):
        with pytest.raises(HarnessError, match=match):
            script(**bad)


# Recorded from Slurm 22.05.8 (Debian bookworm) on this machine.
SQUEUE_RUNNING = "RUNNING|None|vm\n"
SQUEUE_REQUEUED = "PENDING|BeginTime|\n"
SCONTROL_FAILED = ("JobId=3 JobName=t UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901757 "
                   "Nice=0 Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
                   "Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=143:0 RunTime=00:00:04 "
                   "TimeLimit=UNLIMITED TimeMin=N/A NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=2\n")
SACCT = "3|FAILED|143:0\n3.batch|FAILED|143:0\n4|CANCELLED by 0|0:15\n5|COMPLETED|0:0\n"


def test_slurm_outputs_are_read():
    assert slurm.parse_squeue(SQUEUE_RUNNING) == ("RUNNING", "None", "vm")
    assert slurm.parse_squeue("") is None
    fields = slurm.parse_scontrol(SCONTROL_FAILED)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "143:0", "1")
    assert slurm.parse_sacct(SACCT, "3") == ("FAILED", "143:0") and slurm.parse_sacct(SACCT, "4") == ("CANCELLED", "0:15")
    assert slurm.parse_sacct(SACCT, "9") is None
    assert [slurm.exit_code(t) for t in ("143:0", "0:15", "0:0", "200:0", "")] == [143, 143, 0, 200, None]
    assert slurm.liveness("RUNNING").phase == "running"
    assert slurm.liveness("PENDING", reason="BeginTime") == slurm.Liveness("queued", detail="Slurm: PENDING (BeginTime)")
    assert slurm.liveness("FAILED", "143:0").exit_code == 143
    assert slurm.liveness("COMPLETED").exit_code == 0
    assert slurm.liveness("TIMEOUT", "0:0").exit_code == exitcodes.PREEMPTED
    assert slurm.liveness("CANCELLED", "0:15") == slurm.Liveness("gone", 143, "Slurm: CANCELLED")


def test_slurm_variables_are_agent_defaults():
    assert [slurm_env.first_host(x) for x in ("vm", "a,b", "gpu[01-04,07]", "n[3-5]x,m", "rack1-[10-12]")] == \
        ["vm", "a", "gpu01", "n3x", "rack1-10"]
    spec = parse_job(JOB)
    alloc = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODEID": "0", "SLURM_RESTART_COUNT": "2"}
    opts = node_options(spec, Path("/r"), {}, alloc)
    assert (opts.rdzv_endpoint, opts.rdzv_id, opts.is_host) == ("gpu01:29400", "slurm-77-2", True)
    other = node_options(spec, Path("/r"), {}, {**alloc, "SLURM_NODEID": "1"})
    assert other.is_host is False
    elsewhere = node_options(spec, Path("/r"), {"rdzv_endpoint": "head:5000"}, {**alloc, "SLURM_NODEID": "0"})
    assert elsewhere.is_host is None, "a store on another host: torch decides, not Slurm"
    pet = node_options(spec, Path("/r"), {}, {**alloc, "PET_RDZV_ID": "k", "PET_RDZV_ENDPOINT": "w-0"})
    assert (pet.rdzv_id, pet.rdzv_endpoint) == ("k", "w-0:29400"), "PET_* over Slurm"
    assert node_options(spec, Path("/r"), {"rdzv_id": "f"}, {**alloc, "PET_RDZV_ID": "k"}).rdzv_id == "f"
    assert slurm_env.node_name(alloc) == "0" and slurm_env.rdzv_id({}) == ""


def test_torchruns_language():
    spec = parse_job(JOB + "rendezvous: {endpoint: 'h:1'}\n")
    devices = {"gpu": 0, "cpu": 4}.__getitem__
    flags = lambda **kw: node_options(spec, Path("/r"), kw, {}, devices=devices)  # noqa: E731
    assert flags(nproc_per_node="auto", nnodes="1").nproc_per_node == 4, "no GPU: one per CPU"
    assert flags(nproc_per_node="cpu", nnodes="1").nproc_per_node == 4
    assert node_options(spec, Path("/r"), {"nproc_per_node": "auto", "nnodes": "1"}, {},
                        devices={"gpu": 2, "cpu": 4}.__getitem__).nproc_per_node == 2
    with pytest.raises(SpecError, match="no GPU is visible"):
        flags(nproc_per_node="gpu")
    with pytest.raises(SpecError, match="'two' is not a whole number") as e:
        flags(nproc_per_node="two")
    assert e.value.path == "--nproc-per-node"
    with pytest.raises(SpecError, match="14 ranks at most, but train.global_batch_size is 12") as e:
        flags(nnodes="1:7")
    assert e.value.path == "--nnodes"
    standalone = node_options(spec, Path("/r"), {"standalone": True}, {}, pick_port=lambda: 4321)
    assert (standalone.rdzv_backend, standalone.rdzv_endpoint, standalone.is_host) == ("c10d", "127.0.0.1:4321", True)
    assert standalone.rdzv_id.startswith("demo-")
    assert node_options(spec, Path("/r"), {}, {"PET_STANDALONE": "1"}, pick_port=lambda: 9).rdzv_endpoint == "127.0.0.1:9"
    assert node_options(spec, Path("/r"), {}, {"PET_STANDALONE": "0"}).rdzv_endpoint == "h:1"
    conf = node_options(spec, Path("/r"), {}, {"PET_RDZV_CONF": "join_timeout=900, use_libuv=0"}).rdzv_conf
    assert conf == {"join_timeout": "900", "use_libuv": "0"}
    merged = rdzv_configs(spec, NodeOptions(Path("/r"), "h:1", "i", "c10d", 1, 1, 1, 0, rdzv_conf=conf))
    assert merged["join_timeout"] == "900" and merged["last_call_timeout"] == spec.rendezvous.last_call_timeout
    for bad in ("join_timeout", "join_timeout=soon", "=3", "read_timeout=0"):
        with pytest.raises(SpecError):
            parse_rdzv_conf(bad)


def test_the_slurm_job_is_the_agents_submission():
    """Two Slurm jobs that pin one rendezvous id hold the run dir's lock as two submissions
    (the second is refused, not joined: issue 22, long jobs item 3)."""
    assert '--submission "slurm-$SLURM_JOB_ID"' in script()
