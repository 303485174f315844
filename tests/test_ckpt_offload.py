"""The checkpoint writer process (``offload``, ``writer_child``, ``arena``).

Unit tests of the pure decisions and of the recorder -> writer process -> file path against
``torch.save`` itself; a real process killed mid-request, stopped, and outliving nothing; and
one 2-rank run of the manager: an async save written by the process commits, verifies and
loads bit-identically (byte-identical shards to the thread path), and a writer process
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

    from tests.test_ckpt_manager import _manager, _state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    base, out = Path(root), {}
    try:
        mgr, events = _manager(rank, base / "proc", group, verify="full", keep=5)
        assert mgr.writer_process.wait_ready(30)
        assert mgr.save(1, _state(1.0), blocking=False)
        mgr.wait()
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
               "writer_gone": not Path(f"/proc/{writer.pid}").exists()}
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
    shards = sorted(p.name for p in (root / "proc" / "step-0000004").glob("*.distcp"))
    assert shards and all((root / "proc" / "step-0000004" / s).read_bytes()
                          == (root / "thread" / "step-0000004" / s).read_bytes() for s in shards)


def test_a_writer_killed_mid_save_fails_that_save_only(seen):
    (a, b), _ = seen
    assert [e[0] for e in a["events"] if e[1] == 2] == ["failure"]
    assert ["checkpoint", 3, "thread"] in a["events"]  # training went on while it restarted
    assert "step-0000002" not in a["dirs"]  # removed; the earlier one intact (and later ones made)
    assert {"step-0000001", "step-0000003", "step-0000004"} <= set(a["dirs"])
    assert a["writer_gone"] and b["writer_gone"]
