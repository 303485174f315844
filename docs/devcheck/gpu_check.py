"""Device check: the device-to-host copies of the in-memory tier and the async-save stager.

Prints one JSON object. For a model + AdamW state of ``--mb`` MB on the GPU it times (median of
5 after 2 warm-ups, synchronized): ``snapshot.write`` into a memtier slot (a mapping of a file
in /dev/shm) plain and registered with CUDA through ``Region.begin(pin=True)``;
``ReusedBufferStager.stage`` with and without pinned buffers; a plain copy into a pageable and
a pinned tensor. It also restores the slot into a perturbed state and checks it bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from elastic_harness.checkpoint.staging import ReusedBufferStager
from elastic_harness.memtier import snapshot
from elastic_harness.memtier.region import Region


def timed(fn: Callable[[], object], reps: int = 5, warm: int = 2) -> float:
    out = []
    for i in range(warm + reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warm:
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    n = mb * 2**20 // 4 // 3  # fp32 weights + two moments
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, n // 1024 // 8, bias=False) for _ in range(8)]
    model = torch.nn.Sequential(*layers).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def memtier(state: dict, model: torch.nn.Module, res: dict) -> None:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="eh-devcheck-")
    os.close(fd)
    try:
        region = Region(path)
        size = (lambda c: c.data_len + len(c.skeleton))(snapshot.capture(state)) + 2**20
        data, views = region.begin(size), snapshot.Views()
        res["memtier_write_pageable_s"] = timed(lambda: snapshot.write(snapshot.capture(state), data, 0, views))
        t = time.perf_counter()
        data = region.begin(size, pin=True)
        res["register_once_s"] = time.perf_counter() - t
        res["region_registered"] = bool(region._registered)
        views = snapshot.Views()
        res["memtier_write_registered_s"] = timed(lambda: snapshot.write(snapshot.capture(state), data, 0, views))
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        cap = snapshot.capture(state)
        skeleton = snapshot.read_skeleton(data, 0, cap.data_len, len(cap.skeleton))
        snapshot.restore_into(state, snapshot.targets(state), skeleton, data, 0)
        res["restore_bit_identical"] = all(torch.equal(want[k], v) for k, v in model.state_dict().items())
        region.close()
    finally:
        os.unlink(path)


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--mb", type=int, default=1024)
    model, opt = build(cli.parse_args().mb)
    state = {"model": model, "optim": opt}
    tensors = list(model.state_dict().values()) + [
        v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "state_bytes": nbytes}
    flat = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
    pageable, pinned = torch.empty_like(flat, device="cpu"), torch.empty_like(flat, device="cpu").pin_memory()
    res["raw_bytes"] = flat.numel() * 4
    res["raw_pageable_s"] = timed(lambda: pageable.copy_(flat))
    res["raw_pinned_s"] = timed(lambda: pinned.copy_(flat, non_blocking=True))
    memtier(state, model, res)
    for pin in (False, True):
        stager = ReusedBufferStager(pin_memory=pin)
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}

        def stage(stager: ReusedBufferStager = stager, sd: dict = sd) -> None:
            stager.stage(sd)
            stager.synchronize_staging()

        res[f"stager_pin_{pin}_s"] = timed(stage)
        stager.close()
    for k in [k for k in res if k.endswith("_s")]:
        res[k[:-2] + "_GBps"] = round((res["raw_bytes"] if k.startswith("raw") else nbytes) / res[k] / 1e9, 2)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
