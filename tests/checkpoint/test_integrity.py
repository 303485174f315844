"""Manifest, verification, checksums taken while writing, staging, storage: one process, no group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.export import save_single_process
from elastic_harness.checkpoint.offline import load_model_tensors, locate
from elastic_harness.checkpoint.remote import FsspecStorage
from elastic_harness.checkpoint.staging import ReusedBufferStager
from elastic_harness.checkpoint.storage import LocalStorage, open_storage
from elastic_harness.checkpoint.streams import written_files
from elastic_harness.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)

INFO = {"task": "t", "step": 7, "world_size": 1}


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "train": {"step": torch.tensor(7)}}


@pytest.fixture
def saved(tmp_path):
    storage = LocalStorage(tmp_path / "ckpts")
    storage.ensure()
    manifest = save_single_process(storage, "step-0000007", state(), INFO)
    return storage, manifest


def shard_of(storage: LocalStorage, name: str) -> Path:
    return next(p for p in (Path(storage.root) / name).iterdir() if p.suffix == ".distcp")


def test_manifest_lists_every_file_with_size_and_checksum(saved):
    storage, manifest = saved
    on_disk = {f: s for f, s in storage.files("step-0000007").items() if f != layout.MANIFEST}
    assert set(manifest["files"]) == set(on_disk) and ".metadata" in on_disk
    for f, entry in manifest["files"].items():
        assert entry["size"] == on_disk[f]
        assert entry["crc32"] == integrity.checksum_of(storage, "step-0000007", f)
    assert (manifest["step"], manifest["world_size"], manifest["checksum"]) == (7, 1, "crc32")
    assert integrity.verify(storage, "step-0000007", "full").ok


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checksums_taken_while_writing_match_the_files(tmp_path):
    import torch.distributed.checkpoint as dcp

    storage = LocalStorage(tmp_path)
    writer = storage.writer("step-0000001")
    dcp.save(state(), storage_writer=writer, no_dist=True)
    seen = written_files(writer)
    shards = [f for f in storage.files("step-0000001") if f.endswith(".distcp")]
    assert shards and set(shards) <= set(seen)
    for f in shards:
        assert seen[f]["crc32"] == integrity.checksum_of(storage, "step-0000001", f)
        assert seen[f]["size"] == storage.files("step-0000001")[f]


def test_flipped_bytes_fail_full_verification_only(saved):
    storage, _ = saved
    shard = shard_of(storage, "step-0000007")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 4])
    shard.write_bytes(bytes(data))
    full = integrity.verify(storage, "step-0000007", "full")
    assert not full.ok and shard.name in full.reason and "checksum mismatch" in full.reason
    assert integrity.verify(storage, "step-0000007", "size").ok  # the documented trade-off


def test_truncated_or_missing_metadata_fails_size_verification(saved):
    storage, _ = saved
    meta = Path(storage.root) / "step-0000007" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:50])
    verdict = integrity.verify(storage, "step-0000007", "size")
    assert not verdict.ok and ".metadata has 50 bytes" in verdict.reason
    meta.unlink()
    assert integrity.verify(storage, "step-0000007", "size").reason == ".metadata is missing"
    assert not layout.scan(storage.listing(), require_manifest=True)[0].complete


def test_manifest_is_the_commit_marker(saved):
    storage, _ = saved
    (Path(storage.root) / "step-0000007" / layout.MANIFEST).unlink()
    assert integrity.verify(storage, "step-0000007", "none").reason == "manifest missing or unreadable"
    assert not layout.scan(storage.listing(), require_manifest=True)[0].complete


def test_manifests_with_sha256_still_verify(saved):
    storage, manifest = saved
    for f, entry in manifest["files"].items():
        entry.pop("crc32")
        entry["sha256"] = integrity.checksum_of(storage, "step-0000007", f, "sha256")
    storage.write_atomic("step-0000007", layout.MANIFEST, json.dumps(manifest).encode())
    assert integrity.verify(storage, "step-0000007", "full").ok
    manifest["files"][".metadata"]["sha256"] = "0" * 64
    storage.write_atomic("step-0000007", layout.MANIFEST, json.dumps(manifest).encode())
    assert "checksum mismatch" in integrity.verify(storage, "step-0000007", "full").reason


def test_staging_copies_once_and_reuses_its_buffers():
    src = state()
    stager = ReusedBufferStager(pin_memory=False)
    first = stager.stage(src)
    assert torch.equal(first["model"]["w"], src["model"]["w"])
    assert first["model"]["w"].data_ptr() != src["model"]["w"].data_ptr()
    src["model"]["w"].add_(1.0)  # training goes on after staging
    assert not torch.equal(first["model"]["w"], src["model"]["w"])
    ptr = first["model"]["w"].data_ptr()
    second = stager.stage(src)
    assert second["model"]["w"].data_ptr() == ptr  # same host buffer, new contents
    assert torch.equal(second["model"]["w"], src["model"]["w"])
    src["model"]["w"] = torch.zeros(3)  # a shape change gets a new buffer
    assert stager.stage(src)["model"]["w"].shape == (3,)
    stager.close()


def test_fsspec_storage_round_trip_in_memory():
    pytest.importorskip("fsspec")
    storage = open_storage("memory://eh-test/ckpts")
    assert isinstance(storage, FsspecStorage)
    try:
        save_single_process(storage, "step-0000003", state(3), {**INFO, "step": 3})
        assert layout.scan(storage.listing(), require_manifest=True)[0].complete
        assert integrity.verify(storage, "step-0000003", "full").ok
        loaded = load_model_tensors(storage.reader("step-0000003"))
        assert torch.equal(loaded["w"], state(3)["model"]["w"])
        assert storage.uri("step-0000003") == "memory://eh-test/ckpts/step-0000003"
        storage.remove("step-0000003")
        assert "step-0000003" not in storage.listing()
    finally:
        storage.fs.rm("/eh-test", recursive=True)


def test_credentials_in_a_url_are_refused():
    with pytest.raises(CheckpointError) as e:
        open_storage("s3://AKIAEXAMPLE:topsecret@bucket/prefix")
    assert "topsecret" not in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


def test_locate_accepts_run_dir_root_and_step_dir(saved, tmp_path):
    storage, _ = saved
    run_dir = tmp_path / "run"
    shutil.copytree(storage.root, run_dir / "checkpoints")
    for target, step in [(run_dir, None), (run_dir / "checkpoints", None),
                         (run_dir / "checkpoints" / "step-0000007", "step-0000007")]:
        loc = locate(str(target))
        assert loc.storage.root == str(run_dir / "checkpoints") and loc.step == step
    with pytest.raises(CheckpointError):
        locate(str(tmp_path / "nope"))


def test_commit_makes_metadata_and_directories_durable_before_the_manifest(tmp_path, monkeypatch):
    """fsync order at commit: .metadata's contents, the step dir, the root, then the manifest
    (written to a temp file, fsynced, renamed, and its directory fsynced)."""
    import os

    storage = LocalStorage(tmp_path / "ckpts")
    storage.ensure()
    writer = storage.writer("step-0000001")
    with pytest.warns(UserWarning, match="single process"):
        import torch.distributed.checkpoint as dcp

        dcp.save(state(), storage_writer=writer, no_dist=True)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    integrity.write_manifest(storage, "step-0000001", INFO, written_files(writer))
    step = str(tmp_path / "ckpts" / "step-0000001")
    meta, manifest = f"{step}/.metadata", f"{step}/manifest.json"
    assert synced[:3] == [meta, step, str(tmp_path / "ckpts")]
    assert synced[3].startswith(f"{step}/.manifest.json.tmp") and synced[4] == step
    assert (tmp_path / "ckpts" / "step-0000001" / "manifest.json").exists() and manifest not in synced[:3]


def test_commit_is_refused_when_a_reported_file_is_missing_or_short(saved):
    storage, manifest = saved
    reported = {f: dict(e) for f, e in manifest["files"].items()}
    reported["__1_0.distcp"] = {"size": 10, "crc32": "00000000"}  # a rank wrote it; we cannot see it
    with pytest.raises(integrity.CommitRefused, match="__1_0.distcp is missing"):
        integrity.write_manifest(storage, "step-0000007", INFO, reported)
    assert integrity.commit_problems({"a": {"size": 3}}, {"a": 2}) == ["a has 2 bytes, its writer reported 3"]
    assert integrity.commit_problems({"a": {"size": 3}}, {"a": 3, "b": 1}) == []


def test_unreadable_files_are_a_verdict_not_an_exception(saved, monkeypatch):
    import errno

    storage, _ = saved

    def denied(name, filename):
        raise PermissionError(errno.EACCES, "Permission denied", filename)

    monkeypatch.setattr(storage, "open_read", denied)
    verdict = integrity.verify(storage, "step-0000007", "full")
    assert not verdict.ok and verdict.kind == "unreadable" and "Permission denied" in verdict.reason
    assert integrity.verify(storage, "step-0000007", "size").ok  # sizes need no reads


def test_verification_shares_balance_bytes_and_rounds_bound_each_wait():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, ".metadata": 5}
    parts = integrity.shares(sizes, 2)
    assert parts == [["a", "d", ".metadata"], ["b", "c"]]  # 115 vs 110 bytes
    assert integrity.rounds_needed(sizes, parts, 50) == 3
    assert integrity.shares({"x": 1}, 3) == [["x"], [], []]


def test_share_checks_in_rounds_agree_with_a_whole_check(saved):
    storage, manifest = saved
    files = sorted(manifest["files"])
    check = integrity.ShareCheck(storage, "step-0000007", manifest, files)
    rounds = 0
    while check._todo:
        assert check.advance(1000)
        rounds += 1
    assert check.verdict.ok and rounds > 3
    shard = shard_of(storage, "step-0000007")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = integrity.ShareCheck(storage, "step-0000007", manifest, files)
    while bad.advance(1000) and bad._todo:
        pass
    assert not bad.verdict.ok and shard.name in bad.verdict.reason and bad.verdict.kind == "corrupt"


def test_a_stalled_write_is_stopped_before_anyone_touches_its_directory():
    """A writer that stalls between writes is stopped (its next write raises) and the wait
    returns only once no stream is open; progress is reported while bytes move."""
    import concurrent.futures as cf
    import io
    import threading

    from elastic_harness.checkpoint.progress import await_write
    from elastic_harness.checkpoint.streams import WriteStopped, WriteWatch, _WatchedFS

    class Inner:
        def create_stream(self, path, mode):
            import contextlib

            return contextlib.nullcontext(io.BytesIO())

    watch = WriteWatch()
    fs = _WatchedFS(Inner(), watch)
    resume = threading.Event()
    outcome = {}

    def writer():
        with fs.create_stream("f", "wb") as s:
            s.write(b"x" * 10)
            resume.wait(30)  # stalls (a slow disk between two writes)
            try:
                s.write(b"y")
            except WriteStopped as e:
                outcome["stopped"] = e
                raise

    def come_back():  # the stall ends once the writer has been told to stop (a slow disk recovers)
        while not watch.stopped:
            resume.wait(0.01)
        resume.set()

    ticks = []
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(writer)
        threading.Thread(target=come_back, daemon=True).start()
        err = await_write(fut, watch, stall_s=0.5, tick=lambda: ticks.append(1))
    assert isinstance(err, TimeoutError) and "stopped it" in str(err)
    assert watch.quiet and "stopped" in outcome and ticks
