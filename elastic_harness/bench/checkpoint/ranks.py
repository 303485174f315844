"""What each process of ``bench checkpoint`` does (spawned by ``bench.checkpoint.main``).

Three processes on loopback gloo. Ranks 0 and 1 are the "training job": they hold a state
of ``size`` bytes sharded over a 2-rank mesh (FSDP-style DTensors: weights and two optimizer
moments) and measure saves; all three load it back resharded. Every timing is the slowest
participating rank's, after a barrier. Measurements of one repeat are interleaved, in an
order that rotates between repeats, so disk speed drifting (3-7x here) hits all alike.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh

from elastic_harness.bench.checkpoint.common import sharded, timed
from elastic_harness.bench.checkpoint.train import save_phase, train_phase
from elastic_harness.checkpoint.safe_metadata import SafeFileSystemReader as reader

N_MATRICES, COLS = 8, 1024


def rows_for(size: int) -> int:
    """Rows per matrix so that 3 x N_MATRICES fp32 matrices of COLS columns hold ``size`` bytes."""
    return max(6, size // (4 * COLS * 3 * N_MATRICES))


def full_state(rows: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        part: {f"layer{i}.weight": torch.randn(rows, COLS, generator=g) for i in range(N_MATRICES)}
        for part in ("model", "exp_avg", "exp_avg_sq")
    }


def drop_cache(path: Path) -> None:
    """Evict our own files from the page cache so loads read the disk (no global drop)."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(rank: int, cfg: dict) -> None:
    """mp.spawn entry. ``cfg``: port, size, repeats, every, steps, dir, threads."""
    torch.set_num_threads(cfg["threads"])
    timeout = dt.timedelta(seconds=600)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=3, timeout=timeout)
    try:
        results = run_all(rank, cfg)
        if rank == 0:
            Path(cfg["dir"], "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_all(rank: int, cfg: dict) -> dict:
    root, repeats = Path(cfg["dir"]), cfg["repeats"]
    mesh2, mesh3 = DeviceMesh("cpu", torch.arange(2)), DeviceMesh("cpu", torch.arange(3))
    g2 = mesh2.get_group() if rank < 2 else None
    ckpt_group = dist.new_group([0, 1], backend="gloo", timeout=dt.timedelta(seconds=600))
    rows = rows_for(cfg["size"])
    full = full_state(rows)
    samples: dict[str, list[float]] = {}
    if not cfg["train_only"]:
        if rank < 2:
            save_phase(rank, full, mesh2, g2, ckpt_group, root, repeats, samples)
        dist.barrier()
        load_phase(rank, full, mesh2, mesh3, g2, root, repeats, samples)
        dist.barrier()
    if rank < 2:
        train_phase(rank, cfg, g2, ckpt_group, root, samples)
    dist.barrier()
    return {"samples": samples, "state_bytes": 3 * N_MATRICES * rows * COLS * 4, "rows": rows}


def load_phase(rank: int, full: dict, mesh2: DeviceMesh, mesh3: DeviceMesh, g2: Any, root: Path,
               repeats: int, samples: dict) -> None:
    """2 -> 2 (same layout), 2 -> 3 (resharded), 2 -> 2 into another layout (rows saved,
    columns loaded) DCP loads, and the seeds' torch.load."""
    src, legacy = root / "load-src", root / "legacy.pt"
    same = sharded(full, mesh2, rank, 2, fill=False) if rank < 2 else None
    more = sharded(full, mesh3, rank, 3, fill=False)
    # the same 2 ranks, another layout: rows (FSDP2's dim 0) saved, columns (a tensor-parallel
    # split of dim 1) loaded, as a change from (shard 2) to (tensor 2) asks of DCP
    across = sharded(full, mesh2, rank, 2, fill=False, dim=1) if rank < 2 else None
    world = dist.group.WORLD

    def prep() -> None:
        if rank == 0:
            drop_cache(src)
            drop_cache(legacy)
        dist.barrier()

    def one(kind: str) -> None:
        prep()
        if kind == "load_resharded_2to3":
            t = timed(lambda: dcp.load(more, storage_reader=reader(src), process_group=world), world)
        elif rank < 2 and kind == "load_same_layout_2to2":
            t = timed(lambda: dcp.load(same, storage_reader=reader(src), process_group=g2), g2)
        elif rank < 2 and kind == "load_layout_change_2to2":
            t = timed(lambda: dcp.load(across, storage_reader=reader(src), process_group=g2), g2)
        elif rank < 2:  # the seeds' way: every rank reads the whole file, keeps its part
            t = timed(lambda: _legacy_load(legacy, same), g2)
        else:
            t = 0.0
        samples.setdefault(kind, []).append(t)

    kinds = ["load_same_layout_2to2", "load_resharded_2to3", "load_layout_change_2to2", "baseline_load"]
    for r in range(repeats):
        for kind in kinds[r % 4:] + kinds[:r % 4]:
            one(kind)
    _check_loaded(rank, full, more, across)


def _check_loaded(rank: int, full: dict, more: dict, across: dict | None) -> None:
    """The resharded loads returned this rank's part of the saved values."""
    ok = all(torch.equal(more[p][n].to_local(), full[p][n].chunk(3)[rank]) for p in full for n in full[p])
    assert ok, "resharded load returned wrong values"
    ok = rank == 2 or all(torch.equal(across[p][n].to_local(), full[p][n].chunk(2, dim=1)[rank])
                          for p in full for n in full[p])
    assert ok, "the load into another layout returned wrong values"


def _legacy_load(path: Path, into: dict) -> None:
    whole = torch.load(path, map_location="cpu", weights_only=True)
    for part, tensors in into.items():
        for name, d in tensors.items():
            local = d.to_local()
            start = d.device_mesh.get_coordinate()[0] * ((d.shape[0] + 1) // 2)
            local.copy_(whole[part][name][start:start + local.shape[0]])
