"""The checkpoint writer process (``offload``, ``writer_child``, ``arena``).

Unit tests of the pure decisions and of the recorder -> writer process -> file path against
``torch.save`` itself; a real process killed mid-request, stopped, and outliving nothing; and
one 2-rank run of the manager: an async save written by the process commits, verifies and
loads bit-identically (every item byte-identical to the thread path's), and a writer process
killed mid-save is a failed save that training survives.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from elastic_harness.checkpoint import offload
from elastic_harness.checkpoint import writer_child as proto
from elastic_harness.checkpoint.arena import MIN_SEGMENT, Arena, segment_size
from elastic_harness.checkpoint.scheduling import BackgroundThreads, can_lift
from elastic_harness.checkpoint.streams import WriteStopped, WriteWatch
from tests.conftest import REPO
from tests.servers import spawn_ranks, wait_until

pytestmark = pytest.mark.timeout(120)


def test_only_async_cpu_saves_on_plain_local_files_go_to_a_ready_process():
    assert offload.choose(True, True, False, True) == offload.PROCESS
    assert offload.choose(False, True, False, True) == offload.THREAD  # blocking: training waits anyway
    assert offload.choose(True, False, False, True) == offload.THREAD  # fsspec, wrapped filesystems
    assert offload.choose(True, True, True, True) == offload.THREAD    # CUDA: pinned staging
    assert offload.choose(True, True, False, False) == offload.THREAD  # still starting
    assert not offload.available(url_storage=True, cuda=False)
    assert not offload.available(url_storage=False, cuda=True)


def test_without_a_cached_plan_every_tensor_is_staged_and_a_placeholder_is_never_written():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from elastic_harness.checkpoint import plans
    from elastic_harness.errors import CheckpointError

    assert plans.written_elsewhere("never-saved", {"w": torch.ones(3)}) is None
    planner = plans.planner("never-saved")
    planner.set_up_planner({"w": torch.empty(3, device="meta"), "v": torch.ones(2)})
    assert torch.equal(planner.resolve_data(WriteItem(MetadataIndex("v"), WriteItemType.TENSOR)), torch.ones(2))
    with pytest.raises(CheckpointError, match="w was left out of this rank's staging copy"):
        planner.resolve_data(WriteItem(MetadataIndex("w"), WriteItemType.TENSOR))


def test_zip_crc_is_off_in_the_thread_that_serialises():
    """torch keeps the setting per thread: the control shows a fresh thread computes it."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic_harness.checkpoint.progress import without_zip_crc

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(torch.serialization.get_crc32_options).result() is True
        assert pool.submit(without_zip_crc(torch.serialization.get_crc32_options)).result() is False


def test_segments_grow_geometrically_and_fit_the_request():
    assert segment_size(10, 0) == MIN_SEGMENT
    assert segment_size(10, MIN_SEGMENT) == 2 * MIN_SEGMENT
    assert segment_size(5 * MIN_SEGMENT + 1, MIN_SEGMENT) == 5 * MIN_SEGMENT + 4096


def test_arena_buffers_own_exactly_their_bytes_and_are_found_again():
    arena = Arena()
    try:
        a = arena.alloc((3, 5), torch.float32)
        b = arena.alloc((7,), torch.int64)
        assert a.untyped_storage().nbytes() == a.nbytes  # DCP writes it without a clone
        assert arena.locate(b.data_ptr(), b.nbytes) == (0, 4096)
        assert arena.locate(a.data_ptr(), 10**12) is None
        assert [s.id for s in arena.unsent()] == [0] and arena.unsent() == []
    finally:
        arena.close()


def test_aligned_file_equals_its_input_across_chunks_and_tails(tmp_path):
    data = os.urandom(3 * 4096 + 123)
    for direct in (True, False):
        path = tmp_path / f"f{direct}"
        f = proto.AlignedFile(str(path), direct, chunk=8192)
        for at in range(0, len(data), 5000):
            f.write(memoryview(data)[at:at + 5000])
        f.close(sync=True)
        assert path.read_bytes() == data
        assert f.crc == zlib.crc32(data)


def test_shared_ranges_placed_like_the_file_are_written_in_place(tmp_path):
    """A range whose address and file offset agree modulo ALIGN skips the buffer (bar its
    unaligned ends); one that disagrees is copied; the file is the same either way."""
    import mmap

    shared = mmap.mmap(-1, 8 * 4096)
    shared[:] = os.urandom(len(shared))
    head = b"h" * 100  # the range then starts at file offset 100
    for direct in (True, False):
        for phase, expect_in_place in ((100, True), (164, False)):
            data = memoryview(shared)[phase:phase + 5 * 4096 + 7]
            path = tmp_path / f"f{direct}{phase}"
            f = proto.AlignedFile(str(path), direct, chunk=8192)
            f.write(memoryview(head))
            f.write(data, phase)
            f.write(memoryview(b"tail"))
            f.close(sync=True)
            assert path.read_bytes() == head + bytes(data) + b"tail"
            assert f.crc == zlib.crc32(head + bytes(data) + b"tail")
            if direct:  # the aligned middle: 4 whole blocks
                assert f.in_place == (4 * 4096 if expect_in_place else 0)
            else:  # nothing to align: written where it lies
                assert f.in_place == len(data)


def test_a_misplaced_buffer_moves_to_the_phase_its_file_wants_and_frees_its_pages():
    arena = Arena()
    try:
        a = arena.alloc((3000,), torch.float32)
        a.fill_(1.0)
        arena.misplaced(a.data_ptr(), 7 * 4096 + 192)
        moved = arena.relocate(a)
        assert moved is not None and moved.data_ptr() % 4096 == 192 and moved.shape == a.shape
        assert moved.untyped_storage().nbytes() == moved.nbytes
        assert float(a.sum()) == 0.0  # released: the kernel took its pages back
        assert arena.relocate(moved) is None  # nothing reported since
        arena.misplaced(moved.data_ptr(), 4096 + 192)  # already right
        arena.misplaced(moved.data_ptr(), 4096 + 10)  # not a phase torch.save produces
        assert arena.relocate(moved) is None
    finally:
        arena.close()


@pytest.fixture
def writer():
    arena, threads = Arena(), BackgroundThreads(lowered=False)
    proc = offload.WriterProcess(arena, threads)
    assert proc.wait_ready(30)
    yield proc
    proc.close()
    threads.shutdown()
    arena.close()


def _recipe(arena: Arena, tensors: list[torch.Tensor]) -> tuple[list, bytes]:
    rec, expected = offload.Recorder(arena), io.BytesIO()
    for t in tensors:
        torch.save(t, rec)
        torch.save(t, expected)
    return [bytes(p) if isinstance(p, bytearray) else p for p in rec.pieces], expected.getvalue()


def test_dcp_items_recorded_start_at_multiples_of_64_and_read_back():
    """DCP's own per-item routine against a recorder: each item starts 64-aligned, so the
    tensor bytes inside it are too (where the arena can place their buffers), and the item
    at its recorded (offset, length) is what torch.save wrote."""
    from torch.distributed.checkpoint.filesystem import (
        SerializationFormat,
        _StorageWriterTransforms,
        _write_item,
    )
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    arena = Arena()
    try:
        tensors = [arena.alloc((n,), torch.float32) for n in (2000, 3001, 5000)]
        for i, t in enumerate(tensors):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        rec = offload.Recorder(arena)
        results = [_write_item(_StorageWriterTransforms(), rec, t, WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR),
                               "k", SerializationFormat.TORCH_SAVE) for i, t in enumerate(tensors)]
        data, at, tensor_at = b"", 0, []
        for piece in rec.pieces:
            if isinstance(piece, tuple):
                tensor_at.append(at)
                piece = arena.segments[piece[0]].map[piece[1]:piece[1] + piece[2]]
            data += bytes(piece)
            at += len(piece)
        offsets = [r.storage_data.offset for r in results]
        assert all(o % 64 == 0 for o in offsets) and len(tensor_at) == 3 and all(a % 64 == 0 for a in tensor_at)
        for r, t in zip(results, tensors, strict=True):
            item = data[r.storage_data.offset:r.storage_data.offset + r.storage_data.length]
            assert torch.equal(torch.load(io.BytesIO(item)), t)
        assert len(data) == rec.pos == offsets[-1] + results[-1].storage_data.length  # no padding at the end
    finally:
        arena.close()


def test_process_writes_what_torch_save_writes_from_shared_memory(writer, tmp_path):
    staged = writer.arena.alloc((300, 70), torch.float32)
    staged.copy_(torch.randn(300, 70))
    pieces, expected = _recipe(writer.arena, [staged, torch.arange(5)])
    assert any(isinstance(p, tuple) for p in pieces)  # the tensor's bytes were not copied
    watch = WriteWatch()
    record = writer.write([(str(tmp_path / "a.distcp"), "a.distcp", pieces)], True, watch)
    assert (tmp_path / "a.distcp").read_bytes() == expected
    assert record == {"a.distcp": {"size": len(expected), "crc32": f"{zlib.crc32(expected):08x}"}}
    assert watch.counter.bytes == len(expected) and watch.quiet is False


def test_errors_keep_their_errno_and_a_stop_leaves_the_file_unfinished(writer, tmp_path):
    pieces = [b"x" * 100]
    with pytest.raises(OSError) as e:
        writer.write([(str(tmp_path / "no" / "dir" / "f"), "f", pieces)], True, WriteWatch())
    assert e.value.errno == errno.ENOENT
    proto.set_u64(writer.ctl, proto.STOP, writer._req + 1)  # the parent's stop() lands first
    with pytest.raises(WriteStopped):
        writer.write([(str(tmp_path / "g"), "g", pieces)], True, WriteWatch())
    assert (tmp_path / "g").stat().st_size == 0
    assert writer.write([(str(tmp_path / "h"), "h", pieces)], True, WriteWatch())["h"]["size"] == 100


def test_a_killed_process_fails_the_request_and_is_replaced(writer, tmp_path):
    dead = writer.proc.pid
    os.kill(dead, signal.SIGKILL)
    with pytest.raises(OSError, match="writer process died"):
        writer.write([(str(tmp_path / "f"), "f", [b"x"])], True, WriteWatch())
    assert not writer.ready()  # restarts it, not ready yet
    assert writer.wait_ready(30) and writer.proc.pid != dead
    assert writer.write([(str(tmp_path / "g"), "g", [b"y"])], True, WriteWatch())["g"]["size"] == 1


@pytest.mark.skipif(not can_lift(), reason="this process cannot leave SCHED_IDLE again")
def test_the_writer_process_is_idle_until_someone_waits():
    arena, threads = Arena(), BackgroundThreads(lowered=True)
    proc = offload.WriterProcess(arena, threads)
    try:
        pid = proc.proc.pid
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        with threads.foreground():
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    finally:
        proc.close()
        threads.shutdown()
        arena.close()


_ORPHAN = """
import os, sys, time
from elastic_harness.checkpoint.arena import Arena
from elastic_harness.checkpoint.offload import WriterProcess
from elastic_harness.checkpoint.scheduling import BackgroundThreads, can_lift
p = WriterProcess(Arena(), BackgroundThreads.here())
assert p.wait_ready(30)
print(p.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_writer_dies_with_its_worker_and_leaves_nothing_in_dev_shm():
    shm = set(os.listdir("/dev/shm"))
    worker = subprocess.Popen([sys.executable, "-c", _ORPHAN], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[2] == b"-S"
        assert os.sched_getscheduler(child) == os.SCHED_IDLE or not BackgroundThreads.here().lowered
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()
    wait_until(lambda: not Path(f"/proc/{child}").exists() or _zombie(child), 30, "the writer to die")
    assert set(os.listdir("/dev/shm")) - shm == set()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ----- two ranks, the real manager -------------------------------------------------------
def _ranks(rank: int, port: int, root: str) -> None:
    import datetime as dt

    import torch.distributed as dist

    from tests.checkpoint.test_ckpt_manager import _manager, _state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    base, out = Path(root), {}
    try:
        mgr, events = _manager(rank, base / "proc", group, verify="full", keep=5, writer="process")
        assert mgr.writer_process.wait_ready(30)
        assert mgr.save(1, _state(1.0), blocking=False)
        mgr.wait()
        first_copied = mgr._stager.copied
        writer = mgr.writer_process.proc
        if rank == 0:  # a writer stopped mid-save, then killed: the save fails on every rank
            os.kill(writer.pid, signal.SIGSTOP)
        assert mgr.save(2, _state(2.0), blocking=False)
        if rank == 0:
            os.kill(writer.pid, signal.SIGKILL)
        mgr.wait()
        assert mgr.save(3, _state(3.0), blocking=False)  # the thread writes while it restarts
        mgr.wait()
        assert mgr.writer_process.wait_ready(30)
        assert mgr.save(4, _state(4.0), blocking=False)
        mgr.wait()
        last_write = mgr.writer_process.last_write
        copied = (first_copied, mgr._stager.copied)
        mgr.close()
        thread, _ = _manager(rank, base / "thread", group, async_save=False)
        assert thread.save(4, _state(4.0), blocking=True)
        thread.close()
        loader, _ = _manager(rank, base / "proc", group, verify="full")
        into = _state(0.0)
        loaded = loader.restore(into)
        loader.close()
        out = {"events": [(e["event"], e.get("step"), e.get("writer")) for e in events.seen],
               "loaded": loaded.step, "equal": all(torch.equal(into["model"][k], _state(4.0)["model"][k])
                                                   for k in into["model"]),
               "dirs": sorted(p.name for p in (base / "proc").iterdir()),
               "writer_gone": not Path(f"/proc/{writer.pid}").exists(), "last_write": last_write, "copied": copied}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("offload")
    return spawn_ranks(_ranks, root), root


def test_process_written_saves_commit_verify_and_load_bit_identically(seen):
    (a, b), root = seen
    assert ["checkpoint", 1, "process"] in a["events"] and ["checkpoint", 4, "process"] in a["events"]
    assert a["loaded"] == b["loaded"] == 4 and a["equal"] and b["equal"]
    proc, thread = _items(root / "proc" / "step-0000004"), _items(root / "thread" / "step-0000004")
    assert proc == thread and len(proc) == 5  # the 4 tensors and the step


def _items(step_dir: Path) -> dict:
    """Every item's bytes, as ``.metadata`` locates them."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata()
    return {(i.fqn, tuple(i.offset or ())): (step_dir / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            for i, info in meta.storage_data.items()}


def test_later_saves_write_the_tensors_from_shared_memory_in_place(seen):
    """The first save taught the arena where each tensor lands in its file; by the fourth,
    the tensors' bytes (bar each one's unaligned ends) skip the writer's copy."""
    (a, b), _ = seen
    for r in (a, b):
        assert r["last_write"]["in_place"] >= 2 * (256 * 64 * 4 - 4096)  # its two of the four tensors
        assert r["last_write"]["copied"] < r["last_write"]["in_place"] / 8


def test_once_plans_are_cached_each_rank_stages_only_what_it_writes(seen):
    """The first save copies every tensor; later ones only the two (of four replicated)
    tensors DCP has this rank write, plus the step."""
    (a, b), _ = seen
    tensor, step = 256 * 64 * 4, 8
    for r in (a, b):
        assert r["copied"] == [4 * tensor + step, 2 * tensor + step] or r["copied"] == [4 * tensor + step, 2 * tensor]


def test_a_writer_killed_mid_save_fails_that_save_only(seen):
    (a, b), _ = seen
    assert [e[0] for e in a["events"] if e[1] == 2] == ["failure"]
    assert ["checkpoint", 3, "thread"] in a["events"]  # training went on while it restarted
    assert "step-0000002" not in a["dirs"]  # removed; the earlier one intact (and later ones made)
    assert {"step-0000001", "step-0000003", "step-0000004"} <= set(a["dirs"])
    assert a["writer_gone"] and b["writer_gone"]
