"""Issues 22 and 33 on a live local run: what listens, and writes to the rendezvous key.

One small job (two simulated nodes, one worker each, so the rendezvous store, a store
client, gloo and rank 0's store all exist) is watched while it trains: its processes'
listening sockets are read from /proc (as ``ss -ltnp``), the rendezvous store is dialled
from this machine's non-loopback address, and through a loopback store client a pickle
that would create a file is written to the rendezvous key, then bytes that are not UTF-8,
then the key is deleted. The job must finish, and in time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from elastic_harness import jobkey
from elastic_harness.listen import is_loopback
from elastic_harness.rendezvous.sealed import StateSeal
from tests.conftest import MLP, REPO, read_jsonl
from tests.sockets import descendants, listening_sockets, non_loopback_address

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
REFUSED = "not signed with this job's key"


class Plant:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Run the job; while it trains, scan, dial and forge; then let it finish."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("live")
    run_dir, planted, job_id = tmp / "run", str(tmp / "pwned"), "sec-e2e"
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
           "--job-id", job_id, "--nodes", "2", "--set", "nodes.min=2", "--set", "nodes.max=2",
           "--set", "nproc_per_node=1", "--set", "train.steps=2500", "--set", "checkpoint.every_steps=500"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    seen: dict = {"planted": planted}
    try:
        events = run_dir / "events.jsonl"
        _wait(lambda: any(e["event"] == "step" for e in read_jsonl(events)), 180, "the first step")
        seen["sockets"] = listening_sockets(descendants(proc.pid))
        endpoint = next(e["endpoint"] for e in read_jsonl(events) if e["event"] == "start" and e.get("who") == "agent")
        port = int(endpoint.rpartition(":")[2])
        outside = non_loopback_address()
        seen["outside"] = outside
        seen["dialled"] = {p: _reachable(outside, p) for _, p, _ in seen["sockets"]} if outside else {}
        forger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        forger.set(f"torch.rendezvous.{job_id}", base64.b64encode(pickle.dumps(Plant(planted))))
        logs = [run_dir / "logs" / f"agent-{i}.log" for i in (0, 1)]
        # The first agent to read it refuses it and overwrites it at its next write, so the
        # other may never see it: at least one line, at most one per agent.
        _wait(lambda: any(REFUSED in p.read_text() for p in logs) or os.path.exists(planted)
              or proc.poll() is not None, 60, "an agent to read the forgery")
        key = f"torch.rendezvous.{job_id}"
        seal = StateSeal(jobkey.read(run_dir / jobkey.KEY_FILE), job_id)
        forger.set(key, b"\xff\xfe\x80 not UTF-8")  # ended every agent (issue 33)
        seen["garbage_overwritten"] = _wait(lambda: proc.poll() is not None and "exited" or
                                            seal.authentic(forger.get(key)) is not None and "overwritten",
                                            60, "the agents to overwrite the garbage")
        forger.delete_key(key)  # blocked the agents' end for 150 s (issue 33)
        seen["deleted_rewritten"] = _wait(lambda: proc.poll() is not None and "exited" or
                                          forger.check([key]) and "rewritten", 60, "the key to be written again")
        out, _ = proc.communicate(timeout=120)
        seen["code"], seen["out"] = proc.returncode, out
        seen["refusals"] = [p.read_text().count(REFUSED) for p in logs]
        seen["summary"] = json.loads((run_dir / "summary.json").read_text())
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return seen


@pytest.mark.xdist_group("security-live")  # the live run is watched once, on one worker
def test_live_local_run_listens_on_loopback_only(live):
    ports = live["sockets"]
    assert len(ports) >= 3, ports  # the rendezvous store, rank 0's store, gloo's pairs at least
    assert [s for s in ports if not is_loopback(s[0])] == []
    if live["outside"]:
        assert not any(live["dialled"].values()), f"reachable from {live['outside']}: {live['dialled']}"


@pytest.mark.xdist_group("security-live")  # the live run is watched once, on one worker
def test_forged_rendezvous_write_runs_nothing_and_the_job_finishes(live):
    assert not os.path.exists(live["planted"]), "the forged pickle ran"
    assert live["code"] == 0, live["out"][-2000:]
    assert live["summary"]["finished"] and live["summary"]["restarts"] == 0
    assert sum(live["refusals"]) >= 1 and max(live["refusals"]) <= 2, live["refusals"]  # rate-limited


@pytest.mark.xdist_group("security-live")  # the live run is watched once, on one worker
def test_garbage_and_a_deleted_rendezvous_key_are_repaired_while_the_job_trains(live):
    """Non-UTF-8 bytes ended the job; a deleted key blocked its end 150 s and failed it."""
    assert live["garbage_overwritten"] == "overwritten" and live["deleted_rewritten"] == "rewritten"
    assert live["code"] == 0 and live["summary"]["finished"] and live["summary"]["restarts"] == 0, live["out"][-2000:]


def test_directories_planted_at_the_jobs_next_and_final_steps_take_nothing_of_it(tmp_path):
    """Issue 33: unsigned step directories planted beside a run's checkpoints, one (with a
    pickle for ``.metadata``) at a step the resumed job will save, one at its final step:
    the job resumes from its own, writes its own checkpoints at those steps (keep=2 of its
    own), the planted ones are set aside intact, and nothing of theirs ran."""
    from elastic_harness.checkpoint import integrity
    from elastic_harness.checkpoint.storage import LocalStorage
    from tests.security.test_planted_checkpoints import plant

    run_dir, planted = tmp_path / "run", tmp_path / "pwned"

    def run(steps: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
               "--set", "nproc_per_node=2", "--set", f"train.steps={steps}", "--set", "checkpoint.every_steps=100",
               "--set", "checkpoint.keep=2"]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)

    assert run(100).returncode == 0
    storage = LocalStorage(run_dir / "checkpoints")
    plant(storage, "step-0000300", planted, step=300)
    plant(storage, "step-0000400", None, step=400)
    r = run(400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not planted.exists(), "the planted pickle ran"
    key = jobkey.read(run_dir / jobkey.KEY_FILE)
    names = sorted(storage.listing())
    assert [n for n in names if integrity.signed_by(storage, n, key).ok] == ["step-0000300", "step-0000400"], names
    aside = [n for n in names if ".bad-" in n]
    assert sorted(n.split(".bad-")[0] for n in aside) == ["step-0000300", "step-0000400"], names
    assert all((run_dir / "checkpoints" / n / ".metadata").is_file() for n in aside), "set aside, intact"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["last_checkpoint"].endswith("step-0000400"), summary
    assert summary["resumed_from_step"] == 100, "resumed from its own checkpoint, not a planted one"


PLAIN_SCRIPT = '''
import os, sys, torch, torch.distributed as dist
go, ready = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")  # its own: torch's env:// with the launcher's variables
if dist.get_rank() == 0:
    open(ready, "w").close()
flag = torch.zeros(1)
while not flag.item():  # every rank trains until rank 0 sees the go file
    flag.fill_(float(dist.get_rank() == 0 and os.path.exists(go)))
    dist.all_reduce(flag)
dist.destroy_process_group()
'''


def test_a_plain_torchrun_script_listens_on_loopback_and_its_success_is_reported(tmp_path):
    """Issue 33: a script with its own ``init_process_group`` got rank 0's store on every
    interface (torch's env:// binds the wildcard), and its exit 0 on every rank was reported
    as "job failed: agents exited with {0: 0}", exit 1."""
    script, go, ready = tmp_path / "plain.py", tmp_path / "go", tmp_path / "ready"
    script.write_text(PLAIN_SCRIPT)
    cmd = [sys.executable, "-m", "elastic_harness", "run", "--run-dir", str(tmp_path / "run"),
           "--nproc-per-node", "2", str(script), str(go), str(ready)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        _wait(lambda: ready.exists() or proc.poll() is not None, 180, "the script's process group")
        sockets = listening_sockets(descendants(proc.pid))
        go.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert len(sockets) >= 3, sockets  # the rendezvous store, rank 0's store, gloo's pairs
    assert [s for s in sockets if not is_loopback(s[0])] == [], sockets
    assert proc.returncode == 0 and "the script exited 0 on every rank" in out, out[-2000:]
