"""Background checkpoint threads yield the CPU to training and are lifted for waits
(``checkpoint.scheduling``); save plans are cached per manager (``checkpoint.plans``).

The thread classes are the kernel's (``sched_getscheduler`` of real threads); the manager
checks run on two real gloo ranks, the write observed from inside DCP's own ``write_data``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from elastic_harness.checkpoint.scheduling import (
    IDLE,
    NORMAL,
    BackgroundThreads,
    can_lift,
    choose_class,
)
from tests.checkpoint.test_ckpt_manager import Events  # the manager tests' event recorder
from tests.servers import spawn_ranks

# The ranks' run its tests read (``ranks``) is computed once, on one worker (tests/lanes.py)
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("ckpt-scheduling-ranks")]
needs_idle = pytest.mark.skipif(not can_lift(), reason="this process cannot leave SCHED_IDLE again")


@pytest.mark.parametrize(("has_idle", "lift", "want"), [
    (True, True, IDLE), (True, False, NORMAL), (False, False, NORMAL)])
def test_background_class(has_idle, lift, want):
    """A thread that could not be lifted again would make waits on it starve: stay normal."""
    assert choose_class(has_idle, lift) == want


@needs_idle
def test_threads_idle_while_nobody_waits_and_normal_while_someone_does():
    threads = BackgroundThreads(lowered=True)
    release = threading.Event()
    try:
        running = [threads.write(release.wait, 30), threads.commit(release.wait, 30)]
        assert set(_classes(threads, 2).values()) == {os.SCHED_IDLE}
        with threads.foreground():
            with threads.foreground():  # nested waits
                assert set(threads.classes().values()) == {os.SCHED_OTHER}
            assert set(threads.classes().values()) == {os.SCHED_OTHER}
        assert set(threads.classes().values()) == {os.SCHED_IDLE}
    finally:
        release.set()
        threads.shutdown()
    assert all(f.result(10) for f in running)


def test_threads_not_lowered_stay_normal():
    threads = BackgroundThreads(lowered=False)
    release = threading.Event()
    try:
        threads.write(release.wait, 30)
        assert set(_classes(threads, 1).values()) == {os.SCHED_OTHER}
    finally:
        release.set()
        threads.shutdown()


def _classes(threads: BackgroundThreads, n: int) -> dict[int, int]:
    """The classes once ``n`` threads have started (they start on their first task)."""
    ready = threading.Event()
    for _ in range(200):
        if len(threads.classes()) >= n:
            break
        ready.wait(0.01)
    return threads.classes()


# --- through the manager, on two gloo ranks ------------------------------------------------


def _observed_storage(root: Path, seen: dict, entered: threading.Event):
    """A real LocalStorage whose DCP writer notes its thread's class when the write starts;
    the write of ``seen['hold']`` then says so (``entered``), waits (bounded) until a waiter
    lifted its thread, and notes the class again."""
    from elastic_harness.checkpoint.storage import LocalStorage

    storage = LocalStorage(root)
    storage.ensure()
    make = storage.writer

    def writer(name):
        w = make(name)
        inner = w.write_data

        def write_data(plan, planner):
            seen.setdefault(name, []).append(os.sched_getscheduler(0))
            if name == seen.get("hold"):
                entered.set()
                for _ in range(3000):  # the main thread is about to wait on this save
                    if os.sched_getscheduler(0) == os.SCHED_OTHER:
                        break
                    threading.Event().wait(0.01)
                seen[name].append(os.sched_getscheduler(0))
            return inner(plan, planner)

        w.write_data = write_data
        return w

    storage.writer = writer
    return storage


def _state(value: float, extra: bool = False) -> dict:
    model = {f"w{i}": torch.full((64, 32), value) for i in range(3)}
    if extra:  # the plan changes: a cached plan must not be reused blindly
        model["added"] = torch.full((7,), value)
    return {"model": model}


def _ranks(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from elastic_harness.checkpoint.collective import Ranks
    from elastic_harness.checkpoint.manager import Checkpoints
    from elastic_harness.checkpoint.site import Site
    from elastic_harness.spec import CheckpointSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    seen: dict = {"hold": "step-0000001"}
    entered = threading.Event()
    storage = _observed_storage(Path(root), seen, entered)
    events = Events()
    mgr = Checkpoints.build(Site(storage, Ranks(rank, 2, group), events, {"task": "t", "job": "j"}),
                            CheckpointSpec(keep=5, async_save=True))
    try:
        mgr.saver.save(1, _state(1.0), blocking=False)  # async: nobody waits on it ...
        assert entered.wait(60), "the write of step 1 never started"
        mgr.saver.save(2, _state(2.0), blocking=False)  # ... until the next save: the held write is lifted
        after_wait = sorted(set(mgr.saver.threads.classes().values()))
        mgr.saver.save(3, _state(3.0), blocking=True)
        mgr.saver.save(4, _state(4.0, extra=True), blocking=False)
        mgr.saver.save(5, _state(5.0, extra=True), blocking=False)
        mgr.saver.wait()
        back = _state(0.0, extra=True)
        loaded = mgr.restorer.restore(back)
        values = sorted({float(t.unique()) for t in back["model"].values()})
    finally:
        mgr.saver.close()
        dist.destroy_process_group()
    out = {"seen": {k: v for k, v in seen.items() if k != "hold"}, "after_wait": after_wait,
           "saved": [(e["step"], e["blocking_s"], e["waited_s"]) for e in events.seen if e["event"] == "checkpoint"],
           "lowered": mgr.saver.threads.lowered, "loaded": loaded.step, "values": values}
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("sched"))


@needs_idle
def test_async_writes_run_idle_until_waited_on_and_blocking_saves_normal(ranks):
    for r in ranks:
        assert r["lowered"] is True
        seen = r["seen"]
        assert seen["step-0000001"] == [os.SCHED_IDLE, os.SCHED_OTHER], \
            "idle while nobody waited (training keeps the CPU), lifted by the next save's wait"
        assert r["after_wait"] == [os.SCHED_IDLE], "and lowered it again after"
        assert seen["step-0000003"] == [os.SCHED_OTHER], "a blocking save is waited on throughout"
    saved = {step: (blocking, waited) for step, blocking, waited in ranks[0]["saved"]}
    assert sorted(saved) == [1, 2, 3, 4, 5]
    assert saved[2][1] > 0, "step 2's save waited for step 1's held write ..."
    assert all(blocking >= waited for blocking, waited in saved.values()), "... and its blocking_s counts that wait"


def test_cached_plans_follow_a_changed_state(ranks):
    for r in ranks:
        assert r["loaded"] == 5 and r["values"] == [5.0]
