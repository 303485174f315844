"""Issue 33: checkpoint directories planted by someone who can write the checkpoint root.

- ``.metadata`` is read with an unpickler that admits only DCP's metadata types
  (``checkpoint.safe_metadata``): a planted pickle runs nothing, even once it is signed
  (what the old bulk ``ckpt trust`` did to it), while every real DCP metadata still reads
  exactly as torch's own reader reads it;
- ``ckpt trust`` signs one named step, after showing it, and never a pickle it refuses;
- a planted unsigned directory neither takes a ``keep`` slot nor the name of a step the
  job saves: the job's own checkpoint is written (the planted one is set aside, intact).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import zlib
from pathlib import Path

import pytest
import torch

from tests.servers import spawn_ranks

pytestmark = pytest.mark.timeout(120)
KEY = b"k" * 32


class Plant:
    """Unpickling this creates ``path``: proof that code ran."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant(storage, name: str, planted: Path | None, step: int = 0) -> None:
    """A complete, unsigned step directory (a real DCP checkpoint and a manifest that matches
    it); with ``planted``, its ``.metadata`` replaced by a pickle that creates that file and
    the manifest's sizes and checksums recomputed, as anyone who can write the root can."""
    from elastic_harness.checkpoint.export import save_single_process

    save_single_process(storage, name, {"model": {"w": torch.full((4,), 7.0)}}, {"task": "t", "step": step})
    if planted is None:
        return
    root = Path(storage.root) / name
    evil = pickle.dumps(Plant(planted))
    (root / ".metadata").write_bytes(evil)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][".metadata"].update(size=len(evil), crc32=f"{zlib.crc32(evil):08x}",
                                          sha256=hashlib.sha256(evil).hexdigest())
    (root / "manifest.json").write_text(json.dumps(manifest))


def _real_state() -> dict:
    """What a job's state dict holds: a model with buffers, an optimizer with state, a
    scheduler, and plain extras of the kinds scripts register."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 4)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.StepLR(optim, 3)
    return {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
            "extra": {"name": "x", "none": None, "pair": (1, 2.5), "flags": [True, False],
                      "ints": torch.arange(3), "half": torch.ones(2, dtype=torch.bfloat16),
                      "mask": torch.zeros(2, dtype=torch.bool)}}


def test_real_metadata_reads_as_torch_reads_it(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from elastic_harness.checkpoint.safe_metadata import SafeFileSystemReader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(_real_state(), checkpoint_id=str(tmp_path), no_dist=True)
    ours, torchs = SafeFileSystemReader(tmp_path).read_metadata(), dcp.FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and len(ours.state_dict_metadata) > 20
    assert ours.storage_data == torchs.storage_data and ours.planner_data == torchs.planner_data
    assert ours.storage_meta.save_id == torchs.storage_meta.save_id and ours.storage_meta.load_id


@pytest.mark.parametrize("payload", [
    "plant", "dict", "eval", "garbage", "persistent"])
def test_a_planted_metadata_runs_nothing(tmp_path, payload):
    from elastic_harness.checkpoint.safe_metadata import (
        SafeFileSystemReader,
        UnsafeMetadata,
        fsspec_reader,
    )

    planted = tmp_path / "pwned"

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "x" if obj == "p" else None

    if payload == "persistent":
        buf = io.BytesIO()
        Persistent(buf).dump(["p"])
        data = buf.getvalue()
    else:
        data = {"plant": pickle.dumps(Plant(planted)), "dict": pickle.dumps({"a": 1}),
                "eval": b"cbuiltins\neval\n(V__import__('os').system('touch " + str(planted).encode() + b"')\ntR.",
                "garbage": b"\x80\x04not a pickle"}[payload]
    (tmp_path / ".metadata").write_bytes(data)
    for reader in (SafeFileSystemReader(tmp_path), fsspec_reader(str(tmp_path))):
        with pytest.raises(UnsafeMetadata):
            reader.read_metadata()
    assert not planted.exists(), "the planted pickle ran"


def _manager_scenarios(rank: int, port: int, root: str) -> None:
    """One rank: (1) a planted pickle signed with the job's key (what bulk ``ckpt trust``
    did) is not run on resume; (2) unsigned directories planted at a step the job will
    save and far ahead neither stop its saves nor take its ``keep`` slots."""
    import datetime as dt

    import torch.distributed as dist

    from elastic_harness.checkpoint import integrity
    from elastic_harness.checkpoint.collective import Ranks
    from elastic_harness.checkpoint.manager import Checkpoints
    from elastic_harness.checkpoint.site import Site
    from elastic_harness.checkpoint.storage import LocalStorage
    from elastic_harness.spec import CheckpointSpec
    from tests.checkpoint.test_ckpt_manager import Events

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=60))
    out: dict = {}

    def manager(where: Path):
        storage = LocalStorage(where)
        storage.ensure()
        events = Events()
        site = Site(storage, Ranks(0, 1, dist.group.WORLD), events, {"task": "t", "job": "j"}, key=KEY)
        return storage, Checkpoints.build(site, CheckpointSpec(async_save=False, verify="size", keep=2)), events

    def state(v: float) -> dict:
        return {"model": {"w": torch.full((4,), v)}, "train": {"step": torch.tensor(int(v))}}

    try:
        storage, mgr, _ = manager(Path(root) / "trusted")
        for step in (1, 2):
            mgr.saver.save(step, state(float(step)), blocking=True)
        mgr.saver.close()
        storage.remove("step-0000002")
        plant(storage, "step-0000002", Path(root) / "pwned-trusted", step=2)
        out["trusted"] = integrity.trust(storage, "step-0000002", KEY).ok  # as `ckpt trust RUN_DIR` did
        storage, mgr, events = manager(Path(root) / "trusted")
        target = state(0.0)
        out["loaded"], out["value"] = mgr.restorer.restore(target).step, float(target["model"]["w"][0])
        out["set_aside"] = [(e["name"], e["kind"]) for e in events.seen if e["event"] == "quarantine"]
        mgr.saver.close()

        storage, mgr, events = manager(Path(root) / "slots")
        plant(storage, "step-0000003", None, step=3)  # the step this job saves next
        plant(storage, "step-9999999", None, step=9999999)  # far ahead: the newest there is
        for step in (1, 2, 3):
            out[f"saved{step}"] = mgr.saver.save(step, state(float(step)), blocking=True)
        mgr.saver.close()
        out["listing"] = sorted(storage.listing())
        out["ours"] = sorted(n for n in out["listing"] if integrity.signed_by(storage, n, KEY).ok)
        out["events"] = [(e["event"], e.get("name"), e.get("kind")) for e in events.seen
                         if e["event"] in ("quarantine", "skipped")]
    finally:
        dist.destroy_process_group()
        (Path(root) / "rank0.json").write_text(json.dumps(out))


def test_planted_directories_run_nothing_and_take_nothing_of_the_jobs(tmp_path):
    (out,) = spawn_ranks(_manager_scenarios, tmp_path, nprocs=1)
    assert not (tmp_path / "pwned-trusted").exists(), "a signed planted .metadata ran on resume"
    assert out["trusted"] and out["loaded"] == 1 and out["value"] == 1.0, out
    assert out["set_aside"] == [["step-0000002", "unloadable"]], out["set_aside"]
    assert out["saved3"], "the job's own checkpoint of step 3 was not written"
    assert out["ours"] == ["step-0000002", "step-0000003"], out  # keep=2 of the job's own
    assert "step-9999999" in out["listing"], "a planted directory is not the job's to delete"
    aside = [n for n in out["listing"] if n.startswith("step-0000003.bad-")]
    assert len(aside) == 1 and (tmp_path / "slots" / aside[0] / ".metadata").is_file(), out["listing"]
    assert ["quarantine", "step-0000003", "unsigned"] in out["events"], out["events"]
    assert not [e for e in out["events"] if e[0] == "skipped"], out["events"]


def test_ckpt_trust_shows_one_step_and_never_signs_a_pickle_it_refuses(cli_here, tmp_path):
    from elastic_harness import jobkey
    from elastic_harness.checkpoint import integrity
    from elastic_harness.checkpoint.storage import LocalStorage

    run_dir = tmp_path / "run"
    storage = LocalStorage(run_dir / "checkpoints")
    storage.ensure()
    key = jobkey.ensure(run_dir / jobkey.KEY_FILE)
    plant(storage, "step-0000120", tmp_path / "pwned", step=120)
    plant(storage, "step-0000130", None, step=130)
    r = cli_here("ckpt", "verify", run_dir)
    assert "ckpt trust RUN_DIR --step N" in r.out and "ckpt trust DIR'" not in r.out, r.out
    r = cli_here("ckpt", "trust", run_dir, "--step", 120, "--yes")
    assert r.code == 2 and "not a DCP metadata type" in r.err and "nothing was signed" in r.err, r.err
    assert not (tmp_path / "pwned").exists() and not integrity.signed_by(storage, "step-0000120", key).ok
    r = cli_here("ckpt", "trust", run_dir, "--step", 130, "--yes")
    assert r.code == 0 and "model.w" in r.out and "tensor [4] float32" in r.out and "sha256 " in r.out, r.out
    assert integrity.signed_by(storage, "step-0000130", key).ok
    assert not integrity.signed_by(storage, "step-0000120", key).ok, "one step at a time"
    assert integrity.trust(storage, "step-0000120", key).ok  # as the old bulk `ckpt trust` did
    r = cli_here("ckpt", "export", run_dir, "--step", 120, "--to", tmp_path / "m.pt")
    assert r.code == 2 and "not a DCP metadata type" in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "m.pt").exists()


def _layouts(rank: int, port: int, root: str) -> None:
    """Four ranks: FSDP2 (1-D), HSDP (replicate x shard) and tensor parallel x FSDP models
    with their optimizer state, each saved by DCP; rank 0 reads every ``.metadata`` with
    the restricted reader and with torch's own."""
    import datetime as dt

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from elastic_harness.checkpoint.safe_metadata import SafeFileSystemReader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=dt.timedelta(seconds=60))
    out: dict = {}

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))

    def save(name: str, m: torch.nn.Module) -> None:
        optim = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(torch.randn(4, 8)).sum().backward()
        optim.step()
        msd, osd = get_state_dict(m, optim)
        dcp.save({"model": msd, "optim": osd, "extra": {"note": "x", "step": 3}},
                 checkpoint_id=str(Path(root) / name))

    try:
        save("fsdp", fully_shard(model(), mesh=init_device_mesh("cpu", (4,))))
        save("hsdp", fully_shard(model(), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        save("tp", fully_shard(tp, mesh=mesh["dp"]))
        if rank == 0:
            for name in ("fsdp", "hsdp", "tp"):
                ours = SafeFileSystemReader(Path(root) / name).read_metadata()
                torchs = dcp.FileSystemReader(Path(root) / name).read_metadata()
                out[name] = (ours.state_dict_metadata == torchs.state_dict_metadata
                             and ours.storage_data == torchs.storage_data and len(ours.storage_data) >= 8)
    finally:
        dist.destroy_process_group()
        (Path(root) / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.e2e  # four forked gloo ranks, three sharded saves: a few seconds
@pytest.mark.timeout(240)
def test_sharded_layouts_metadata_reads_as_torch_reads_it(tmp_path):
    out = spawn_ranks(_layouts, tmp_path, nprocs=4)[0]
    assert out == {"fsdp": True, "hsdp": True, "tp": True}, out


def test_the_allowlist_is_types_and_torch_values_only():
    """Every global a ``.metadata`` may name is a class, a dtype, or the layout lookup:
    nothing that runs code of an attacker's choosing."""
    from elastic_harness.checkpoint import safe_metadata

    table = safe_metadata.allowed()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in table
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in table
    for (module, name), obj in table.items():
        assert isinstance(obj, (type, torch.dtype)) or obj is safe_metadata._layout, (module, name)
    assert not {m for m, _ in table} & {"os", "posix", "subprocess", "sys", "io"}
