"""The checkpoint manager's parts (``Checkpoints.build``) on two real gloo ranks: fallback,
quarantine, agreement, retention, async + DTensor, the generation fence, storage that fails
or is not shared, progress.

One ``torch.multiprocessing`` spawn runs every scenario (each in its own directory); the
ranks write what they saw to JSON and the assertions run here. Storage faults come from
thin wrappers around the real ``LocalStorage`` (a read that fails with EACCES, a listing
that does not show another node's files), never from mocks of DCP or of the process group.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import threading
from pathlib import Path

import pytest
import torch

from tests.servers import spawn_ranks

# The ranks' run most tests read (``seen``) is computed once, on one worker (tests/lanes.py)
pytestmark = [pytest.mark.timeout(180), pytest.mark.xdist_group("ckpt-manager-ranks")]


class Events:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def emit(self, event: str, **fields) -> dict:
        self.seen.append({"event": event, **fields})
        return fields


def _manager(rank: int, root: Path, group, storage=None, manager_kw=None, **policy):
    from elastic_harness.checkpoint.collective import Ranks
    from elastic_harness.checkpoint.manager import Checkpoints
    from elastic_harness.checkpoint.progress import Ticker
    from elastic_harness.checkpoint.site import Site
    from elastic_harness.checkpoint.storage import LocalStorage
    from elastic_harness.spec import CheckpointSpec

    events = Events()
    if storage is None:
        storage = LocalStorage(root)
        storage.ensure()
    kw = dict(manager_kw or {})
    site = Site(storage, Ranks(rank, 2, group), events, {"task": "t", "job": "j"},
                ticker=Ticker(kw.pop("on_progress", None)))
    return Checkpoints.build(site, CheckpointSpec(**policy), **kw), events


class Wrapped:
    """A real LocalStorage with some reads failing (like EACCES on a bad file) or some files
    hidden from listings (like a directory that is not shared between nodes)."""

    def __init__(self, root: Path, deny=lambda name, filename: False, hide=lambda filename: False) -> None:
        from elastic_harness.checkpoint.storage import LocalStorage

        self.inner = LocalStorage(root)
        self.inner.ensure()
        self.deny, self.hide = deny, hide
        self.opened: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_read(self, name, filename):
        if self.deny(name, filename):
            raise PermissionError(errno.EACCES, "Permission denied", filename)
        self.opened[filename] = self.opened.get(filename, 0) + 1
        return self.inner.open_read(name, filename)

    def files(self, name):
        return {f: n for f, n in self.inner.files(name).items() if not self.hide(f)}

    def reader(self, name):
        reader = self.inner.reader(name)
        if self.deny(name, ".metadata"):
            def refuse(*a, **k):
                raise PermissionError(errno.EACCES, "Permission denied", ".metadata")
            reader.read_metadata = refuse
        return reader


class Counting(Wrapped):
    """A real LocalStorage that counts full listings of the root and reads of the generation
    fence (the per-save storage round trips that cost most on object stores)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings = self.fence_reads = 0

    def listing(self):
        self.listings += 1
        return self.inner.listing()

    def read_root(self, filename):
        from elastic_harness.checkpoint.fence import GENERATION_FILE

        self.fence_reads += filename == GENERATION_FILE
        return self.inner.read_root(filename)


def _state(value: float, mesh=None) -> dict:
    model = {f"w{i}": torch.full((256, 64), value) for i in range(4)}
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        model["sharded"] = DTensor.from_local(torch.full((5, 8), value), mesh, [Shard(0)], run_check=False)
    return {"model": model, "train": {"step": torch.tensor(int(value))}}


def _biggest_shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _restore(rank, root, group, storage=None, **policy) -> dict:
    import torch.distributed as dist

    from elastic_harness.errors import CheckpointError

    mgr, events = _manager(rank, root, group, storage, **policy)
    st = _state(0.0)
    try:
        loaded = mgr.restorer.restore(st)
        out = {"step": loaded.step if loaded else None, "value": float(st["model"]["w0"][0, 0])}
    except CheckpointError as e:
        out = {"error": str(e)}
    dist.barrier()
    mgr.saver.close()
    return {**out, "warnings": [e["message"] for e in events.seen if e["event"] in ("warning", "quarantine")],
            "quarantined": [(e["name"], e["kind"]) for e in events.seen if e["event"] == "quarantine"],
            "dirs": _dirs(root)}


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _save_steps(rank, root, group, steps, **policy) -> None:
    mgr, _ = _manager(rank, root, group, **policy)
    for s in steps:
        assert mgr.saver.save(s, _state(float(s)), blocking=True)
    mgr.saver.close()


def scenario_verify_fallback(rank, root, group) -> dict:
    """Newest: flipped bytes; next: truncated .metadata; next: .metadata deleted."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2, 3, 4], keep=5, async_save=False)
    if rank == 0:
        _flip(_biggest_shard(root / "step-0000004"))
        _truncate(root / "step-0000003" / ".metadata")
        (root / "step-0000002" / ".metadata").unlink()
    dist.barrier()
    return _restore(rank, root, group, keep=5)


def scenario_load_failure_fallback(rank, root, group) -> dict:
    """verify=none: corruption is only found by loading, which must fall back too."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2, 3], keep=5, async_save=False)
    if rank == 0:
        _truncate(root / "step-0000003" / ".metadata")
        _truncate(_biggest_shard(root / "step-0000002"))
    dist.barrier()
    return _restore(rank, root, group, keep=5, verify="none")


def scenario_nothing_usable(rank, root, group) -> dict:
    import torch.distributed as dist

    _save_steps(rank, root, group, [1], async_save=False)
    if rank == 0:
        _flip(_biggest_shard(root / "step-0000001"))
    dist.barrier()
    return _restore(rank, root, group)


def scenario_nothing_loads(rank, root, group) -> dict:
    """verify=none and the only checkpoint fails to load: maybe the code's fault, not the
    checkpoint's, so it stays where it is (set aside only once an older one loads)."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1], async_save=False)
    if rank == 0:
        _truncate(_biggest_shard(root / "step-0000001"))
    dist.barrier()
    return _restore(rank, root, group, verify="none")


def scenario_async_retention(rank, root, group) -> dict:
    """Async saves with a DTensor; keep newest 2 plus every 3rd; a crashed save's leftovers go."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(2))
    if rank == 0:
        (root / "step-0000000").mkdir(parents=True)
        (root / "step-0000000" / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    mgr, events = _manager(rank, root, group, keep=2, keep_every=3, async_save=True)
    started = [mgr.saver.save(s, _state(float(s), mesh), blocking=False) for s in range(1, 8)]
    mgr.saver.wait()
    again = mgr.saver.save(7, _state(7.0, mesh), blocking=False)
    mgr.saver.close()
    st = _state(0.0, mesh)
    loaded, _ = _manager(rank, root, group)
    step = loaded.restorer.restore(st).step
    loaded.saver.close()
    dist.barrier()
    return {"started": started, "again": again, "step": step, "dirs": _dirs(root),
            "sharded": st["model"]["sharded"].to_local().unique().tolist(),
            "skipped": [(e["step"], e["reason"]) for e in events.seen if e["event"] == "skipped"],
            "checkpoints": [(e["step"], e["asynchronous"]) for e in events.seen if e["event"] == "checkpoint"]}


def scenario_quarantine_then_save_again(rank, root, group) -> dict:
    """Issue 11 item 1: failed checkpoints are set aside, saves over their steps happen, a
    save over a complete step is an event, and retention counts only good checkpoints."""
    import torch.distributed as dist

    from elastic_harness.checkpoint import integrity
    from elastic_harness.checkpoint.storage import LocalStorage

    _save_steps(rank, root, group, [1, 2, 3], keep=3, async_save=False)
    if rank == 0:
        _flip(_biggest_shard(root / "step-0000003"))
        _truncate(root / "step-0000002" / ".metadata")
    dist.barrier()
    mgr, events = _manager(rank, root, group, keep=3, async_save=False)
    loaded = mgr.restorer.restore(_state(0.0))
    saved = [mgr.saver.save(s, _state(float(s)), blocking=True) for s in (2, 3)]
    again = mgr.saver.save(3, _state(3.0), blocking=True)
    saved.append(mgr.saver.save(4, _state(4.0), blocking=True))
    mgr.saver.wait()
    mgr.saver.close()
    dist.barrier()
    good = [d for d in _dirs(root) if d.startswith("step-") and "." not in d
            and integrity.verify(LocalStorage(root), d, "full").ok]
    return {"loaded": loaded.step, "saved": saved, "again": again, "dirs": _dirs(root), "good": good,
            "quarantined": [(e["name"], e["kind"], e["moved_to"]) for e in events.seen if e["event"] == "quarantine"],
            "skipped": [(e["step"], e["reason"]) for e in events.seen if e["event"] == "skipped"]}


def scenario_unreadable_shard(rank, root, group) -> dict:
    """EACCES while verifying the newest checkpoint: fall back like corruption, on all ranks."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2], async_save=False)
    dist.barrier()
    storage = Wrapped(root, deny=lambda name, f: name == "step-0000002" and f.endswith(".distcp"))
    return _restore(rank, root, group, storage)


def scenario_metadata_unreadable_on_one_rank(rank, root, group) -> dict:
    """Rank 1 cannot read step 2's .metadata: every rank falls back together, none hangs."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2], async_save=False)
    dist.barrier()
    deny = (lambda name, f: name == "step-0000002" and f == ".metadata") if rank == 1 else (lambda n, f: False)
    return _restore(rank, root, group, Wrapped(root, deny=deny), verify="size")


def scenario_not_shared(rank, root, group) -> dict:
    """Each rank has its own directory (a checkpoint.dir not shared between nodes)."""
    return _restore(rank, root / f"rank{rank}", group)


def scenario_join(rank, root, group) -> dict:
    """Two generations join in turn: every rank gets rank 0's, as written; then rank 0 cannot
    write the file, and every rank raises with rank 0's words."""
    from elastic_harness.checkpoint import collective, fence
    from elastic_harness.errors import CheckpointError

    storage = Wrapped(root)
    joined = [collective.join_generation(storage, "j", rank=rank, world_size=2, group=group) for _ in range(2)]
    on_disk = fence.read(storage.inner)

    def refuse(name, data):
        raise PermissionError(errno.EACCES, "Permission denied", name)

    storage.write_root = refuse
    try:
        collective.join_generation(storage, "j", rank=rank, world_size=2, group=group)
        error = ""
    except CheckpointError as e:
        error = str(e)
    return {"joined": [[g.number, g.token] for g in joined], "on_disk": [on_disk.number, on_disk.token],
            "error": error}


def scenario_commit_needs_every_reported_file(rank, root, group) -> dict:
    """Rank 0 cannot see rank 1's shard: the save is not committed (no manifest blesses it)."""
    storage = Wrapped(root, hide=lambda f: f.startswith("__1_"))
    mgr, events = _manager(rank, root, group, storage, async_save=False)
    ok = mgr.saver.save(1, _state(1.0), blocking=False)
    mgr.saver.close()
    return {"ok": ok, "dirs": _dirs(root),
            "failures": [e["message"] for e in events.seen if e["event"] == "failure"]}


def scenario_fence(rank, root, group) -> dict:
    """An old generation cannot commit once a newer one has started: not a save it begins
    afterwards, nor one that was being written when the new generation started."""
    from elastic_harness.checkpoint import fence

    storage = Wrapped(root)
    inner_writer = storage.inner.writer

    def writer_then_new_generation(name):  # another generation starts while step 6 is written
        if rank == 0 and name == "step-0000006":
            fence.bump(storage.inner, "j")
        return inner_writer(name)

    storage.writer = writer_then_new_generation
    old, old_events = _manager(rank, root, group, storage, async_save=True)
    old.restorer.restore(_state(0.0))
    started = old.saver.save(6, _state(6.0), blocking=False)
    old.saver.wait()
    new, _ = _manager(rank, root, group)
    new.restorer.restore(_state(0.0))
    refused = old.saver.save(5, _state(5.0), blocking=True)
    committed = new.saver.save(7, _state(7.0), blocking=True)
    new.saver.wait()
    old.saver.close()
    new.saver.close()
    return {"started": started, "refused": refused, "committed": committed, "dirs": _dirs(root),
            "manifests": sorted(p.parent.name for p in root.glob("*/manifest.json")),
            "events": [(e["event"], e.get("step")) for e in old_events.seen if e["event"] in ("fenced", "failure")]}


def scenario_fenced_before_its_first_save(rank, root, group) -> dict:
    """A newer generation started before the old one's next (blocking) save: refused at the
    commit, an event and not an error, and what it wrote goes with the new one's retention."""
    from elastic_harness.errors import CheckpointError

    old, old_events = _manager(rank, root, group, async_save=False)
    old.restorer.restore(_state(0.0))
    new, _ = _manager(rank, root, group, async_save=False)
    new.restorer.restore(_state(0.0))
    try:
        refused = old.saver.save(3, _state(3.0), blocking=True)
    except CheckpointError as e:
        refused = str(e)
    committed = new.saver.save(4, _state(4.0), blocking=True)
    new.saver.wait()
    old.saver.close()
    new.saver.close()
    return {"refused": refused, "committed": committed, "dirs": _dirs(root),
            "events": [(e["event"], e.get("step")) for e in old_events.seen if e["event"] in ("fenced", "failure")]}


def scenario_joins_at_its_first_save(rank, root, group) -> dict:
    """A generation that restored nothing (the survivors that finished the step in flight in
    place) enters the fence at its first save: it commits, and the generation before it, which
    restored, is fenced from then on."""
    from elastic_harness.checkpoint import fence

    old, old_events = _manager(rank, root, group, async_save=False)
    old.restorer.restore(_state(0.0))
    before = fence.read(Wrapped(root).inner)
    new, _ = _manager(rank, root, group, async_save=False)  # no restore: its state went on in place
    committed = new.saver.save(4, _state(4.0), blocking=True)
    after = fence.read(Wrapped(root).inner)
    refused = old.saver.save(5, _state(5.0), blocking=False)
    old.saver.close()
    new.saver.close()
    return {"committed": committed, "refused": refused, "bumped": after.number - before.number,
            "manifests": sorted(p.parent.name for p in root.glob("*/manifest.json")),
            "events": [(e["event"], e.get("step")) for e in old_events.seen if e["event"] in ("fenced", "failure")]}


def scenario_round_trips_per_save(rank, root, group) -> dict:
    """Issue 34: a save (sync or async, with retention purging) lists the root once and reads
    the fence once, on rank 0; the other ranks do neither."""
    storage = Counting(root)
    mgr, events = _manager(rank, root, group, storage, keep=2)
    mgr.restorer.restore(_state(0.0))
    counts = {}
    for kind, steps in (("sync", (1, 2, 3)), ("async", (4, 5, 6))):
        storage.listings = storage.fence_reads = 0
        for s in steps:
            assert mgr.saver.save(s, _state(float(s)), blocking=kind == "sync")
            mgr.saver.wait()
        counts[kind] = (storage.listings, storage.fence_reads)
    mgr.saver.close()
    return {"counts": counts, "dirs": _dirs(root)}


def scenario_split_verification_and_progress(rank, root, group) -> dict:
    """Verification is shared by the ranks in small rounds; on_progress fires while bytes move."""
    ticks = {"n": 0}
    kw = {"on_progress": lambda: ticks.__setitem__("n", ticks["n"] + 1), "verify_round_bytes": 16 << 10}
    storage = Wrapped(root)
    counts = {}
    for what in ("save", "restore"):  # a manager each: progress calls are throttled to 1/s
        mgr, _ = _manager(rank, root, group, storage, manager_kw=kw, async_save=False)
        ticks["n"] = 0
        mgr.saver.save(1, _state(1.0), blocking=True) if what == "save" else mgr.restorer.restore(_state(0.0))
        counts[what] = ticks["n"]
        mgr.saver.close()
    return {"ticks": counts, "opened": storage.opened}


class _Blocking:
    """A DCP filesystem whose first write blocks until ``release`` is set: a stuck disk."""

    def __init__(self, inner, release: threading.Event, entered: threading.Event) -> None:
        self.inner, self.release, self.entered = inner, release, entered

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def create_stream(self, path, mode):
        import contextlib

        @contextlib.contextmanager
        def stream():
            with self.inner.create_stream(path, mode) as s:
                yield _BlockingStream(s, self) if "w" in mode else s

        return stream()


class _BlockingStream:
    def __init__(self, stream, fs: _Blocking) -> None:
        self.stream, self.fs = stream, fs

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, data):
        if not self.fs.entered.is_set():
            self.fs.entered.set()
            assert self.fs.release.wait(60), "the test never released the write"
        return self.stream.write(data)


def scenario_stuck_async_write_is_not_removed(rank, root, group) -> dict:
    """An async write stuck in the disk: the manager gives up on it (WriterStuck) but never
    removes the directory while the write can still land there."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from elastic_harness.checkpoint.progress import WriterStuck
    from elastic_harness.checkpoint.storage import LocalStorage
    from elastic_harness.checkpoint.streams import watch_writer, write_watch

    own = dist.new_group(backend="gloo")  # DCP's own collectives finish on it after the test
    release, entered = threading.Event(), threading.Event()
    storage = LocalStorage(root)
    storage.ensure()
    writers = []

    def blocking_writer(name):
        w = FileSystemWriter(storage.uri(name), sync_files=True, overwrite=False)
        w.fs = _Blocking(w.fs, release, entered)
        writers.append(watch_writer(w))
        return writers[-1]

    storage.writer = blocking_writer
    mgr, events = _manager(rank, root, own, storage, manager_kw={"stall_s": 1.0}, async_save=True)
    assert mgr.saver.save(1, _state(1.0), blocking=False)
    try:
        mgr.saver.wait()
        raised = None
    except WriterStuck as e:
        raised = str(e)
    present_while_stuck = (root / "step-0000001").is_dir()
    release.set()
    watch = write_watch(writers[0])
    assert watch.stopped
    deadline = threading.Event()
    for _ in range(600):  # the released write lands, the next one raises WriteStopped
        if watch.quiet:
            break
        deadline.wait(0.05)
    dist.barrier()
    return {"raised": raised, "present_while_stuck": present_while_stuck, "quiet": watch.quiet,
            "present_after": (root / "step-0000001").is_dir(),
            "manifest": (root / "step-0000001" / "manifest.json").exists(),
            "events": [e["event"] for e in events.seen]}


def scenario_async_save_meets_no_peer(rank, root, group) -> dict:
    """An async save returns on a rank before any other rank began its own: the copy is all it
    does on the calling thread; the agreement that the step may be written, DCP's planning and
    the write meet the other ranks in the background. Rank 1 saves only once rank 0's save
    returned (a barrier on the default group): a save that met its peers on the calling thread
    would leave both ranks waiting until the checkpoint group's timeout."""
    import torch.distributed as dist

    ckpt = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=20))
    mgr, events = _manager(rank, root, ckpt, async_save=True)
    returned = []
    for s in (1, 2, 3):  # from the 2nd on, the cached plans: each rank copies only its share
        if rank == 1:
            dist.barrier()
        returned.append(mgr.saver.save(s, _state(float(s)), blocking=False))
        if rank == 0:
            dist.barrier()
    mgr.saver.wait()
    copied = mgr.saver._stager.copied  # the last save's copy: one of the two ranks' shares
    mgr.saver.close()
    return {"returned": returned, "copied": copied, "dirs": _dirs(root),
            "checkpoints": [e["step"] for e in events.seen if e["event"] == "checkpoint"]}


def scenario_async_save_rank_0_cannot_look(rank, root, group) -> dict:
    """Rank 0 cannot list the step's directory when an async save starts (its agreement runs in
    the background): that save is a failure event on rank 0, nothing is written, the caller
    is not stopped (one failure), and the next save is written."""
    class Blind(Wrapped):
        def files(self, name):
            if name == "step-0000002":
                raise PermissionError(errno.EACCES, "Permission denied", name)
            return super().files(name)

    mgr, events = _manager(rank, root, group, Blind(root) if rank == 0 else None, async_save=True)
    returned = [mgr.saver.save(s, _state(float(s)), blocking=False) for s in (2, 3)]
    mgr.saver.wait()
    mgr.saver.close()
    return {"returned": returned, "dirs": _dirs(root),
            "failures": [(e["step"], e["asynchronous"], e["message"]) for e in events.seen if e["event"] == "failure"],
            "checkpoints": [e["step"] for e in events.seen if e["event"] == "checkpoint"]}


SCENARIOS = [scenario_verify_fallback, scenario_load_failure_fallback, scenario_nothing_usable,
             scenario_nothing_loads, scenario_async_retention, scenario_quarantine_then_save_again, scenario_unreadable_shard,
             scenario_metadata_unreadable_on_one_rank, scenario_not_shared, scenario_join,
             scenario_commit_needs_every_reported_file, scenario_fence, scenario_fenced_before_its_first_save,
             scenario_joins_at_its_first_save,
             scenario_round_trips_per_save,
             scenario_split_verification_and_progress, scenario_stuck_async_write_is_not_removed,
             scenario_async_save_meets_no_peer, scenario_async_save_rank_0_cannot_look]


def _ranks(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    out = {}
    try:
        for fn in SCENARIOS:
            out[fn.__name__] = fn(rank, Path(root) / fn.__name__, group)
    finally:
        dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("manager"))


def test_corrupt_newer_checkpoints_fall_back_are_set_aside_and_ranks_agree(seen):
    a, b = (r["scenario_verify_fallback"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    warnings = "\n".join(a["warnings"])
    assert "skipping step-0000004: __" in warnings and "checksum mismatch" in warnings
    assert "skipping step-0000003: .metadata has" in warnings
    assert "ignoring incomplete checkpoint step-0000002" in warnings
    assert a["quarantined"] == [["step-0000004", "corrupt"], ["step-0000003", "corrupt"]]
    assert b["quarantined"] == []  # rank 0 narrates
    dirs = a["dirs"]
    assert [d for d in dirs if ".bad-" not in d] == ["step-0000001", "step-0000002"]
    assert sorted(d.split(".bad-")[0] for d in dirs if ".bad-" in d) == ["step-0000003", "step-0000004"]


def test_unverified_corruption_is_caught_by_loading(seen):
    a, b = (r["scenario_load_failure_fallback"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    assert any(w.startswith("skipping step-0000003: loading failed") for w in a["warnings"])
    assert any(w.startswith("skipping step-0000002: loading failed") for w in a["warnings"])
    assert [k for _, k in a["quarantined"]] == ["unloadable", "unloadable"]


def test_no_usable_checkpoint_is_an_error_not_a_silent_fresh_start(seen):
    for r in seen:
        assert "none of the 1 checkpoints" in r["scenario_nothing_usable"]["error"]
        assert "--fresh" in r["scenario_nothing_usable"]["error"]


def test_a_checkpoint_is_set_aside_for_failing_to_load_only_if_an_older_one_loads(seen):
    a, b = (r["scenario_nothing_loads"] for r in seen)
    assert "none of the 1 checkpoints" in a["error"] and "none of the 1 checkpoints" in b["error"]
    assert a["quarantined"] == [] and a["dirs"] == ["step-0000001"]
    assert any("left in place" in w for w in a["warnings"])


def test_async_saves_retention_and_dtensor_round_trip(seen):
    a, b = (r["scenario_async_retention"] for r in seen)
    assert a["started"] == [True] * 7
    # Step 7 exists: the copy was staged (True), and the background found the step complete
    # before anything was written: a skipped event, no second checkpoint of it.
    assert a["again"] is b["again"] is True
    assert a["skipped"] == [[7, "a complete checkpoint step-0000007 already exists"]]
    assert a["checkpoints"] == [[s, True] for s in range(1, 8)]
    assert a["dirs"] == ["step-0000003", "step-0000006", "step-0000007"]  # leftover step-0 gone too
    assert a["step"] == b["step"] == 7 and a["sharded"] == b["sharded"] == [7.0]


def test_saves_over_quarantined_steps_happen_and_retention_keeps_good_ones(seen):
    a, b = (r["scenario_quarantine_then_save_again"] for r in seen)
    assert a["loaded"] == b["loaded"] == 1
    assert [q[:2] for q in a["quarantined"]] == [["step-0000003", "corrupt"], ["step-0000002", "corrupt"]]
    assert all(q[2] and ".bad-" in q[2] for q in a["quarantined"])
    assert a["saved"] == b["saved"] == [True, True, True]  # steps 2, 3 (over set-aside ones), 4
    assert a["again"] is b["again"] is False
    assert a["skipped"] == [[3, "a complete checkpoint step-0000003 already exists"]]
    assert a["good"] == ["step-0000002", "step-0000003", "step-0000004"]  # keep=3 good ones
    assert len([d for d in a["dirs"] if ".bad-" in d]) == 2  # set aside, not deleted, not counted


def test_unreadable_shard_falls_back_like_corruption(seen):
    a, b = (r["scenario_unreadable_shard"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    assert a["quarantined"] == [["step-0000002", "unreadable"]]
    assert any("unreadable" in w and "Permission denied" in w for w in a["warnings"])


def test_a_rank_that_cannot_read_metadata_stays_in_step(seen):
    a, b = (r["scenario_metadata_unreadable_on_one_rank"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    assert a["quarantined"] == [["step-0000002", "unloadable"]]


def test_ranks_that_do_not_share_the_directory_are_refused(seen):
    for r in seen:
        err = r["scenario_not_shared"]["error"]
        assert "rank 1 on" in err and "cannot see the checkpoint directory" in err and "fix:" in err


def test_every_rank_joins_the_generation_rank_0_wrote_or_raises_its_error(seen):
    a, b = (r["scenario_join"] for r in seen)
    assert a["joined"] == b["joined"] and [n for n, _ in a["joined"]] == [1, 2]
    assert a["joined"][-1] == a["on_disk"] == b["on_disk"] and len(a["on_disk"][1]) == 32
    for r in (a, b):
        assert "cannot write" in r["error"] and "generation.json: Permission denied" in r["error"]


def test_commit_requires_every_file_the_ranks_reported(seen):
    a, b = (r["scenario_commit_needs_every_reported_file"] for r in seen)
    assert a["ok"] is b["ok"] is False
    assert a["dirs"] == []  # the uncommitted directory was removed after every writer stopped
    (msg,) = a["failures"]
    assert "__1_0.distcp is missing" in msg and "shared by every node" in msg


def test_a_superseded_generation_cannot_commit(seen):
    a, b = (r["scenario_fence"] for r in seen)
    assert a["started"] is b["started"] is True  # step 6 was being written ...
    assert a["refused"] is b["refused"] is False
    assert a["committed"] is b["committed"] is True
    assert a["events"] == [["fenced", 6], ["fenced", 5]]  # ... and refused at commit: events, not failures
    assert a["manifests"] == ["step-0000007"] and "step-0000005" not in a["dirs"]


def test_a_generation_superseded_before_a_blocking_save_is_fenced_not_failed(seen):
    a, b = (r["scenario_fenced_before_its_first_save"] for r in seen)
    assert a["refused"] is b["refused"] is False
    assert a["committed"] is b["committed"] is True
    assert a["events"] == [["fenced", 3]]
    assert a["dirs"] == ["step-0000004"]


def test_a_generation_that_restored_nothing_enters_the_fence_at_its_first_save(seen):
    a, b = (r["scenario_joins_at_its_first_save"] for r in seen)
    assert a["committed"] is b["committed"] is True
    assert a["bumped"] == 1, "the save bumped the generation before it wrote"
    assert a["refused"] is b["refused"] is False and a["events"] == [["fenced", 5]]
    assert a["manifests"] == ["step-0000004"]


def test_a_save_lists_the_root_once_and_reads_the_fence_once(seen):
    a, b = (r["scenario_round_trips_per_save"] for r in seen)
    assert a["counts"] == {"sync": [3, 3], "async": [3, 3]}  # (listings, fence reads) for 3 saves
    assert b["counts"] == {"sync": [0, 0], "async": [0, 0]}
    assert a["dirs"] == ["step-0000005", "step-0000006"]  # retention still purged


def test_an_async_save_returns_before_its_peers_began_theirs(seen):
    a, b = (r["scenario_async_save_meets_no_peer"] for r in seen)
    assert a["returned"] == b["returned"] == [True, True, True]
    assert a["checkpoints"] == [1, 2, 3] and a["dirs"] == ["step-0000001", "step-0000002", "step-0000003"]
    # The last save copied each tensor on one rank only (the cached plans, no agreement first):
    # four 256x64 float32 tensors and the 8-byte step, split between the two ranks.
    assert a["copied"] + b["copied"] == 4 * 256 * 64 * 4 + 8 and min(a["copied"], b["copied"]) > 0


def test_an_async_save_rank_0_cannot_prepare_is_a_failure_and_training_goes_on(seen):
    a, b = (r["scenario_async_save_rank_0_cannot_look"] for r in seen)
    assert a["returned"] == b["returned"] == [True, True]
    ((step, asynchronous, message),) = a["failures"]
    assert step == 2 and asynchronous is True and "cannot prepare" in message and "Permission denied" in message
    assert b["failures"] == []  # rank 0 narrates
    assert a["checkpoints"] == [3] and a["dirs"] == ["step-0000003"]


def test_verification_is_split_over_ranks_and_progress_is_reported(seen):
    a, b = (r["scenario_split_verification_and_progress"] for r in seen)
    for r in (a, b):
        assert r["ticks"]["save"] >= 1 and r["ticks"]["restore"] >= 1
        assert any(f.endswith(".distcp") for f in r["opened"])  # each rank checksummed a share
        assert max(r["opened"].values()) > 1  # in several rounds (16 KB each)
    # and not the same files (rank 0 also reads .metadata back at commit, for its signed sha256)
    assert not (set(a["opened"]) & set(b["opened"])) - {".metadata"}


def test_a_stuck_async_write_is_abandoned_but_its_directory_left_alone(seen):
    for r in (x["scenario_stuck_async_write_is_not_removed"] for x in seen):
        assert r["raised"] and "could not be stopped" in r["raised"]
        assert r["present_while_stuck"] and r["present_after"] and not r["manifest"]
        assert r["quiet"]  # once released, the writer stopped instead of writing on
        assert "checkpoint" not in r["events"]


def test_a_failed_save_is_one_short_line_naming_each_ranks_cause():
    """Issue 33: DCP's CheckpointException repr (each rank's FrameSummary list, 461
    characters) was the terminal's failure line; now each cause once, with its ranks."""
    import io
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from elastic_harness.checkpoint.failure_text import detail, one_line
    from elastic_harness.commands.support.progress import Progress

    def wrapped(e):
        try:
            raise e
        except OSError as caught:
            return caught, traceback.extract_tb(caught.__traceback__)

    full = OSError(errno.ENOSPC, "No space left on device")
    err = CheckpointException("failed", {0: wrapped(full), 1: wrapped(OSError(errno.ENOSPC, "No space left on device")),
                                         2: wrapped(PermissionError(errno.EACCES, "Permission denied"))})
    assert len(repr(err)) > 300 and "FrameSummary" in repr(err)
    line = one_line(err)
    assert line == ("ranks 0,1: OSError: [Errno 28] No space left on device; "
                    "rank 2: PermissionError: [Errno 13] Permission denied")
    assert "Traceback" in detail(err)
    assert one_line(ValueError("bad\nsecond line")) == "ValueError: bad" and one_line(KeyError()) == "KeyError"
    out = io.StringIO()
    progress = Progress(60, out=out)
    for n in (1, 2, 3):  # a streak of failed saves: the first is said, the limit's error says the rest
        progress.update({"t": float(n), "event": "failure", "consecutive": n, "message": f"checkpoint failed {n}"})
    assert out.getvalue().splitlines() == ["failure: checkpoint failed 1"]


def test_a_short_write_on_a_full_disk_is_named_as_the_full_disk():
    """On a full disk one rank's write raises ENOSPC while torch's file writer on another
    reports only a position mismatch; with the storage (almost) out of space both are the full
    disk, one cause. With space left the writer's own words stay: it is not guessed."""
    from torch.distributed.checkpoint.api import CheckpointException

    from elastic_harness.checkpoint.failure_text import one_line

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    err = CheckpointException("failed", {0: (OSError(errno.ENOSPC, "No space left on device"), []),
                                         1: (short, [])})
    assert one_line(err, free_bytes=0) == "ranks 0,1: OSError: [Errno 28] No space left on device"
    assert one_line(short, free_bytes=4096) == "OSError: [Errno 28] No space left on device"
    assert "unexpected pos" in one_line(err, free_bytes=10 << 30)
    assert "unexpected pos" in one_line(short)  # a storage that cannot tell: nothing guessed



def test_a_generation_travels_as_three_integers_and_back():
    from elastic_harness.checkpoint.collective import generation_ints, generation_of
    from elastic_harness.checkpoint.fence import Generation

    for token in ("f" * 32, "0" * 32, "80" + "0" * 14 + "7f" + "f" * 14):
        g = Generation(7, token)
        assert generation_of(generation_ints(g)) == g
    assert generation_of(generation_ints(None)) is None


def test_failed_saves_end_the_job_by_time_not_by_three_in_a_row():
    from elastic_harness.checkpoint.manager import give_up

    assert not give_up(3, failing_s=0.3, limit_s=120.0), "a disk full for 0.3 s is ridden out"
    assert not give_up(50, failing_s=119.0, limit_s=120.0)
    assert give_up(51, failing_s=120.0, limit_s=120.0)
    assert not give_up(2, failing_s=3600.0, limit_s=120.0), "three at least, however slow the saves"
    assert give_up(3, failing_s=0.0, limit_s=0.0) and not give_up(2, failing_s=0.0, limit_s=0.0), "0: the 3rd"
