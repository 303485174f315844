"""Run-dir and checkpoint-dir locks: who holds them, sharing within a job, stale holders,
object storage, ``rundir.prepare`` and ``--fresh`` with a checkpoint dir outside the run dir.

Locks are real files (or objects in fsspec's in-memory store); a "crashed holder" is a
record naming a process that has exited, a holder "on another host" is a record naming
another host. No waiting: heartbeats are driven by calling ``beat()`` with a given clock.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid

import pytest

from elastic_harness.checkpoint import fence, lock
from elastic_harness.checkpoint.storage import LocalStorage, open_storage
from elastic_harness.errors import CheckpointError, RunDirError

pytestmark = pytest.mark.timeout(60)


def holder(rdzv: str, job: str = "mlp", **kw) -> lock.Holder:
    h = lock.Holder.this_process(job, rdzv)
    return lock.Holder(**{**h.__dict__, **kw})


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def store(tmp_path):
    s = LocalStorage(tmp_path / "dir")
    s.ensure()
    return s


def test_decide_covers_free_shared_stale_and_held():
    me = holder("job-b")
    alive, dead = (lambda r: True), (lambda r: False)
    assert lock.decide(None, me, 100.0, alive).action == "take"
    here = holder("job-a").record(beat=100.0)
    assert lock.decide(here, me, 100.0, alive).action == "refuse"
    assert lock.decide(here, me, 100.0, dead) == lock.Decision("takeover", f"pid {here['pid']} is no longer running on {me.host}")
    same_job = holder("job-b").record(beat=100.0)
    assert lock.decide(same_job, me, 100.0, alive).action == "join"
    far = {**holder("job-a").record(beat=100.0), "host": "elsewhere"}
    assert lock.decide(far, me, 100.0 + lock.STALE_S - 1, dead).action == "refuse"  # pid unknowable there
    d = lock.decide(far, me, 100.0 + lock.STALE_S + 1, alive)
    assert d.action == "takeover" and "no heartbeat for" in d.reason
    assert lock.decide({}, me, 0.0, alive).action == "takeover"  # garbled file


def test_second_job_is_refused_naming_the_first_and_same_job_shares(store):
    first = lock.Lease.acquire(store, holder("mlp-1111"), beat_s=3600)
    try:
        with pytest.raises(lock.LockHeld) as e:
            lock.Lease.acquire(store, holder("other-2222", job="other"), beat_s=3600)
        assert "job 'mlp' (rendezvous id mlp-1111, pid" in str(e.value)
        agent = lock.Lease.acquire(store, holder("mlp-1111"), beat_s=3600)  # another agent, same job
        assert first.owner and not agent.owner
        agent.release()
        assert lock.read_record(store)["rdzv_id"] == "mlp-1111"  # a joiner leaves it in place
    finally:
        first.release()
    assert lock.read_record(store) is None
    first.release()  # twice is fine


def test_a_crashed_holder_is_taken_over_not_waited_for(store):
    crashed = holder("old-1", pid=dead_pid(), pid_start="")
    store.write_root(lock.LOCK_FILE, json.dumps(crashed.record(beat=0.0)).encode())
    lease = lock.Lease.acquire(store, holder("new-2"), beat_s=3600)
    try:
        assert lease.owner and "is no longer running" in lease.took_over and "old-1" in lease.took_over
        assert lock.read_record(store)["rdzv_id"] == "new-2"
    finally:
        lease.release()


def test_a_reused_pid_does_not_keep_a_lock_alive(store):
    reused = holder("old-1", pid_start="1")  # our own live pid, but another start time
    store.write_root(lock.LOCK_FILE, json.dumps(reused.record(beat=0.0)).encode())
    lease = lock.Lease.acquire(store, holder("new-2"), beat_s=3600)
    lease.release()
    assert lease.took_over


def test_heartbeats_renew_and_a_job_keeps_its_lock_when_its_owner_dies(store):
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    owner = lock.Lease.acquire(store, holder("job-1"), beat_s=3600, clock=clock)
    now[0] += 30
    owner.beat()
    assert lock.read_record(store)["beat"] == 1030.0
    gone = holder("job-1", pid=dead_pid(), pid_start="")
    store.write_root(lock.LOCK_FILE, json.dumps(gone.record(beat=now[0])).encode())  # owner crashed
    member = lock.Lease.acquire(store, holder("job-1"), beat_s=3600, clock=clock)
    assert member.owner and member.took_over  # the job keeps its lock
    other = lock.Lease.acquire(LocalStorage(store.root), holder("job-2", host="elsewhere"), beat_s=3600,
                               clock=lambda: now[0] + lock.STALE_S + 5, alive=lambda r: False)
    member.beat()  # another job took it over (from its view we were stale): ours is lost
    assert member.lost and member.lost["rdzv_id"] == "job-2"
    for lease in (owner, member, other):
        lease.release()


def test_locks_on_object_storage_read_back_what_they_wrote():
    pytest.importorskip("fsspec")
    store = open_storage(f"memory://eh-lock-{uuid.uuid4().hex[:8]}/ckpts")
    try:
        first = lock.Lease.acquire(store, holder("a-1"), beat_s=3600)
        with pytest.raises(lock.LockHeld):
            lock.Lease.acquire(store, holder("b-2", job="b"), beat_s=3600)
        first.release()
        assert lock.read_record(store) is None
        second = lock.Lease.acquire(store, holder("b-2", job="b"), beat_s=3600)
        second.release()
    finally:
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(store._path, recursive=True)


def test_generation_fence_is_pure_about_who_may_commit(store):
    g1 = fence.bump(store, "j")
    assert fence.read(store) == g1 and fence.superseded(g1, fence.read(store)) == ""
    g2 = fence.bump(store, "j")
    assert g2.number == g1.number + 1
    assert "newer worker generation (2)" in fence.superseded(g1, fence.read(store))
    assert fence.superseded(None, g2) == ""  # a manager that never restored is not fenced


# ----- rundir.prepare ----------------------------------------------------------------------------
def spec_with(**checkpoint):
    from elastic_harness.spec import load_job

    return load_job("jobs/mlp.yaml", [f"checkpoint.{k}={v}" for k, v in checkpoint.items()])


def test_prepare_locks_the_run_dir_for_one_job(tmp_path):
    from elastic_harness.records.rundir import owner, prepare

    spec = spec_with()
    with prepare(tmp_path / "run", spec, holder=holder("mlp-1")) as claim:
        assert owner(claim.path)["rdzv_id"] == "mlp-1"
        with pytest.raises(RunDirError) as e:
            prepare(tmp_path / "run", spec, holder=holder("mlp-2"))
        assert "is in use by job 'mlp' (rendezvous id mlp-1" in str(e.value) and "fix:" in str(e.value)
        prepare(tmp_path / "run", spec, holder=holder("mlp-1")).release()  # an agent of the same job
    assert owner(tmp_path / "run") is None


def test_an_outside_checkpoint_dir_is_locked_too(tmp_path):
    from elastic_harness.records.rundir import prepare

    spec = spec_with(dir=str(tmp_path / "shared-ckpts"))
    with prepare(tmp_path / "a", spec, holder=holder("a-1")):
        with pytest.raises(CheckpointError) as e:
            prepare(tmp_path / "b", spec, holder=holder("b-2"))  # another run dir, same checkpoints
        assert f"checkpoint.dir '{tmp_path / 'shared-ckpts'}' is in use by job" in str(e.value)
    assert not (tmp_path / "b" / lock.LOCK_FILE).exists()  # nothing left held after the refusal


def test_fresh_moves_an_outside_local_checkpoint_dir_aside(tmp_path):
    from elastic_harness.records.rundir import prepare

    ckpts = tmp_path / "elsewhere" / "ckpts"
    (ckpts / "step-0000010").mkdir(parents=True)
    (ckpts / "step-0000010" / "manifest.json").write_text("{}")
    spec = spec_with(dir=str(ckpts))
    with prepare(tmp_path / "run", spec, fresh=True, holder=holder("r-1"), clock=lambda: 0.0) as claim:
        assert claim.checkpoint_root == str(ckpts)
        assert sorted(p.name for p in ckpts.iterdir()) == [lock.LOCK_FILE]  # only our lock stays
        (aside,) = tmp_path.joinpath("elsewhere").glob("ckpts.old-*")
        assert (aside / "step-0000010" / "manifest.json").exists()  # moved, not deleted


def test_fresh_refuses_an_object_store_prefix_that_holds_checkpoints(tmp_path):
    pytest.importorskip("fsspec")
    from elastic_harness.records.rundir import owner, prepare

    url = f"memory://eh-fresh-{uuid.uuid4().hex[:8]}/ckpts"
    store = open_storage(url)
    try:
        spec = spec_with(dir=url)
        prepare(tmp_path / "run", spec, fresh=True, holder=holder("r-1")).release()  # empty: fine
        store.write_atomic("step-0000010", "manifest.json", b"{}")
        with pytest.raises(CheckpointError) as e:
            prepare(tmp_path / "run", spec, fresh=True, holder=holder("r-2"))
        assert "--fresh cannot move the 1 checkpoints" in str(e.value) and "new prefix" in str(e.value)
        assert owner(tmp_path / "run") is None and lock.read_record(store) is None  # released
    finally:
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(store._path, recursive=True)


def test_a_submission_whose_lock_another_live_job_took_over_knows_it_at_once_and_for_good(tmp_path):
    """A frozen submission's lock, taken over by another job while it looked gone: when it
    comes back, the run directory's claim says so before its heartbeat's next beat
    (``Claim.lost(now=True)``: read before a worker generation starts), names the holder,
    and stays lost (issue 42: it bumped the generation fence and shut the holder out)."""
    from elastic_harness.records.rundir import Claim

    store = LocalStorage(tmp_path / "run")
    store.ensure()
    now = [1000.0]
    mine = lock.Lease.acquire(store, holder("job-a"), beat_s=3600, clock=lambda: now[0])
    claim = Claim(tmp_path / "run", str(tmp_path / "run" / "checkpoints"), [mine])
    assert claim.lost() == claim.lost(now=True) == ""
    other = lock.Lease.acquire(LocalStorage(store.root), holder("job-b", host="elsewhere"), beat_s=3600,
                               clock=lambda: now[0] + lock.STALE_S + 5, alive=lambda r: False)
    assert claim.lost() == "", "the heartbeat has not looked yet"
    why = claim.lost(now=True)
    assert "lost the lock" in why and "job-b" in why and "stopped without saving" in why and "\n  fix: " in why
    other.release()  # the other job ends: the lock is free again, but this submission stays stopped
    assert claim.lost() == why and mine.check() is not None
    mine.release()
