"""The streaming rows of ``bench throughput`` (``--stream also|only``).

1. **Throughput.** The MLP of ``throughput.common`` trained on images stored as webdataset-layout
   tar shards (``NNNNNN.npy`` + ``NNNNNN.cls`` members, 3 x 32 x 32 uint8), both sides
   decoding each sample in the training process:
   - plain: ``throughput.stream_plain`` under ``torchrun --standalone``: an ``IterableDataset`` that reads the
     shards ``i % world == rank`` in order, ``DataLoader(batch_size=micro, num_workers=0)``,
     ``no_sync`` accumulation (what a user writes by hand; it cannot resume mid-epoch);
   - harness: this file as a script job: ``run.steps(tar_stream(shards, transform=decode))``
     (lanes, exact resume, content identity), ``data.workers: 0``; no checkpoints on either
     side, the in-memory tier off too (as the ``cheap`` row: it snapshots within a 3% budget
     of step time, a cost the plain side, which saves nothing, does not pay).
   Goal: harness / plain >= 0.97, judged on the median of the paired ratios (each repeat's
   two runs follow each other, who goes first alternates); ``cpu_paired`` is the same ratio
   in rank 0's CPU time per step, which other processes' load moves far less.
   **Costly items** (``stream_costly``): the same layout with JPEG members (``NNN.jpg``),
   each decoded and augmented as the map-style ``costly`` row does (``data.augment``),
   on ``--nproc-costly`` rank(s): the harness with ``--workers`` loader processes splitting
   the rank's lanes against the plain script loading in its training process
   (``num_workers=0``). Goal: >= 1.5, as for map-style data.
2. **Restart to the first step**, the same job resumed from a checkpoint whose stream
   position is at a shard boundary and from one deep inside a shard (the last step of a
   ``--shard-mb`` shard: the reader has to pass nearly all of it):
   wall time from ``elastic-harness run`` to rank 0's first step. Goal: mid / boundary <= 1.2.
   The tar reader walks the member headers and seeks over their data to get there
   (``data.adapters._Tar.skip``).
   Also reported: the time the lane reader alone needed to reach that position
   (``open_s``), measured in the bench process.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastic_harness import runfiles

HERE = Path(__file__).resolve()
RECORD = 3 * 32 * 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", choices=("off", "also", "only", "restart", "tput"), default="off",
                   help="streaming rows: tar shards, harness vs plain (cheap and costly items), restart "
                   "mid-shard (default off; 'restart': only the restart rows; 'tput': only the "
                   "throughput rows)")
    p.add_argument("--stream-shards", type=int, default=8, help="tar shards, throughput (default 8)")
    p.add_argument("--shard-mb", type=int, default=64, help="shard size for the restart rows (default 64)")


# ----- data ---------------------------------------------------------------------------------------
def write_shards(folder: Path, shards: int, per_shard: int, seed: int = 0, jpeg_px: int = 0) -> list[str]:
    """Tar shards of ``per_shard`` samples: ``k.npy`` (uint8 image) + ``k.cls`` (label); with
    ``jpeg_px``, ``k.jpg`` (a ``jpeg_px``-square JPEG, costly items) instead of ``k.npy``."""
    from elastic_harness.bench.throughput.data import jpeg_bytes

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(per_shard):
                if jpeg_px:
                    image = ("jpg", jpeg_bytes(rng, jpeg_px))
                else:
                    buf = io.BytesIO()
                    np.save(buf, rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
                    image = ("npy", buf.getvalue())
                for ext, data in (image, ("cls", str(int(rng.integers(10))).encode())):
                    info = tarfile.TarInfo(f"{s:04d}{k:07d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def decode(sample: dict):
    import torch

    x = torch.from_numpy(np.load(io.BytesIO(sample["npy"]))).float().div_(255.0).sub_(0.5).div_(0.25)
    return x, int(sample["cls"])


def decode_costly(sample: dict):
    from elastic_harness.bench.throughput.data import augment

    return augment(sample["jpg"]), int(sample["cls"])


def decoder(kind: str):
    """The transform of a row's shards (``--data``): ``cheap`` (npy) or ``costly`` (jpg)."""
    return {"cheap": decode, "costly": decode_costly}[kind]


# ----- the two training scripts (this file, run as __main__) ----------------------------------------
def harness_main(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import elastic_harness as eh
    from elastic_harness.bench.throughput.common import StepClock, build_model, build_optimizer
    from elastic_harness.data import tar_stream

    torch.set_num_threads(args.threads)
    run = eh.init()
    model = DDP(build_model(args.hidden).to(run.device), device_ids=run.device_ids)
    optimizer = build_optimizer(model)
    run.register(model, optimizer)
    stream = tar_stream(json.loads(Path(args.shards).read_text()), transform=decoder(args.data),
                        lanes=args.lanes, shuffle_shards=False)
    clock = StepClock(run.rank, run.world_size)
    first = None
    for step in run.steps(stream):
        clock.tick()
        first = first or time.time()
        for x, y in step.batches():
            step.backward(F.cross_entropy(model(x), y))
            clock.count(len(y))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
    clock.finish(args.out, side="harness", first_step_unix=first)
    run.close()


def script_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=("plain", "harness"), required=True)
    p.add_argument("--shards", required=True, help="JSON list of shard paths")
    p.add_argument("--out", required=True)
    p.add_argument("--data", choices=("cheap", "costly"), default="cheap")
    for flag in ("--hidden", "--threads", "--steps", "--global-batch", "--micro-batch", "--lanes"):
        p.add_argument(flag, type=int, default=0)
    return p


# ----- the bench host -----------------------------------------------------------------------------
def _common(args: argparse.Namespace, shards: Path, out: Path, side: str, lanes: int,
            data: str = "cheap") -> list[str]:
    return ["--side", side, "--data", data, "--shards", str(shards), "--out", str(out), "--hidden", str(args.hidden),
            "--threads", str(args.threads), "--steps", str(args.steps), "--global-batch",
            str(args.global_batch), "--micro-batch", str(args.micro_batch), "--lanes", str(lanes)]


@dataclass(frozen=True)
class HarnessRun:
    """One harness run's settings: processes, steps, stream lanes, the checkpoint period (0:
    no durable saves, and the in-memory tier off too), the data's cost and loader processes."""

    nproc: int
    steps: int
    lanes: int
    every: int = 0
    data: str = "cheap"
    workers: int = 0


def _harness(args: argparse.Namespace, run_dir: Path, shards: Path, run: HarnessRun) -> dict:
    """One harness run (``run``)."""
    import yaml
    nproc, steps, lanes, every, data, workers = run.nproc, run.steps, run.lanes, run.every, run.data, run.workers

    from elastic_harness.bench.throughput import sides

    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"stamps-{steps}.json"
    job = {"name": "bench-stream", "device": "cpu", "nproc_per_node": nproc, "max_restarts": 0,
           "script": {"path": str(HERE), "args": _common(args, shards, out, "harness", lanes, data)},
           "train": {"steps": steps, "global_batch_size": args.global_batch,
                     "micro_batch_size": args.micro_batch, "log_every": 10, "seed": 0},
           "data": {"workers": workers},
           "checkpoint": {"every_steps": every, "save_final": every > 0, **({} if every else {"memory_every": 0})}}
    path = run_dir.parent / f"{run_dir.name}-{steps}.yaml"
    path.write_text(yaml.safe_dump(job))
    t0 = time.time()
    code = sides.run_bounded(sides.harness_command(path, run_dir / "run"), run_dir / "output.log",
                             sides.side_environ(dict(__import__("os").environ), run_dir),
                             timeout=sides.limit_s(args))
    _check(code, out, run_dir)
    record = json.loads(out.read_text())
    first = record.get("first_step_unix")
    record["launch_to_first_step_s"] = round(first - t0, 3) if first else None
    resumed = [e["t"] for e in _events(run_dir / "run" / runfiles.EVENTS) if e.get("event") == "resume"]
    record["resume_to_first_step_s"] = round(first - resumed[-1], 3) if first and resumed else None
    return record


def _events(path: Path) -> list[dict]:
    from elastic_harness.events import read_events

    return read_events(path) if path.exists() else []


def _plain(args: argparse.Namespace, run_dir: Path, shards: Path, nproc: int, data: str = "cheap") -> dict:
    from elastic_harness.bench.throughput import sides

    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "stamps.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={run_dir / 'logs'}", str(HERE.with_name("stream_plain.py")),
           *_common(args, shards, out, "plain", 0, data)]
    code = sides.run_bounded(cmd, run_dir / "output.log", sides.side_environ(dict(__import__("os").environ), run_dir),
                             timeout=sides.limit_s(args))
    _check(code, out, run_dir)
    return json.loads(out.read_text())


def _check(code: int | None, out: Path, run_dir: Path) -> None:
    from elastic_harness.bench.throughput import sides
    from elastic_harness.errors import HarnessError

    if code != 0 or not out.is_file():
        raise HarnessError(f"a streaming bench run exited {code}; it said: {sides.last_line(run_dir / 'output.log')}",
                           "re-run with --keep --dir DIR to read its log")


@dataclass(frozen=True)
class StreamRow:
    name: str
    data: str  # ``decoder``'s kind
    goal: float
    costly: bool = False  # --nproc-costly ranks, the harness with --workers loader processes


STREAM_ROWS = (StreamRow("throughput", "cheap", 0.97), StreamRow("costly", "costly", 1.5, costly=True))


def measure(args: argparse.Namespace, scratch: Path, steady_rate) -> dict:
    """The streaming rows; the JSON the bench reports under ``stream`` (``steady_rate``:
    ``throughput.steady_rate``, passed in: that module imports this one)."""
    if args.stream == "restart":
        return {"restart": restart(args, scratch)}
    out = {row.name: _row(args, scratch, row, steady_rate) for row in STREAM_ROWS}
    if args.stream != "tput":
        out["restart"] = restart(args, scratch)
    return out


def _row(args: argparse.Namespace, scratch: Path, row: StreamRow, steady_rate) -> dict:
    """Both sides of one row, ``--repeats`` times, alternating who goes first."""
    from elastic_harness.bench.throughput.stats import cpu_per_step_ms

    nproc = args.nproc_costly if row.costly else args.nproc_cheap
    workers = args.workers if row.costly else 0
    per = max(args.global_batch, 2 * args.items // args.stream_shards)
    shards = scratch / f"stream-{row.name}-shards.json"
    shards.write_text(json.dumps(write_shards(scratch / f"stream-{row.name}", args.stream_shards, per,
                                              jpeg_px=args.image_px if row.costly else 0)))
    rates: dict[str, list[float]] = {"harness": [], "plain": []}
    cpu: dict[str, list[float | None]] = {"harness": [], "plain": []}
    for r in range(args.repeats):
        for side in (("harness", "plain") if r % 2 == 0 else ("plain", "harness")):
            run_dir = scratch / f"stream-{row.name}-{side}-{r}"
            rec = (_harness(args, run_dir, shards,
                            HarnessRun(nproc, args.steps, lanes=nproc * 4, data=row.data, workers=workers))
                   if side == "harness"
                   else _plain(args, run_dir, shards, nproc, data=row.data))
            rates[side].append(steady_rate(rec["stamps"], args.warmup, args.global_batch))
            cpu[side].append(cpu_per_step_ms(rec["cpu"], args.warmup))
            print(f"bench throughput: stream {row.name} {side} repeat {r}: {rates[side][-1]:.1f} samples/s",
                  file=sys.stderr, flush=True)
    return summarize_row(rates, cpu, row, nproc, workers)


def summarize_row(rates: dict[str, list[float]], cpu: dict[str, list[float | None]], row: StreamRow,
                  nproc: int, workers: int) -> dict:
    """Pure: medians, their ratio, and each repeat's paired ratio (samples/s; and CPU per step
    of rank 0, plain / harness) with their spread; the goal is judged on the paired median."""
    from elastic_harness.bench.throughput.stats import ratio, spread

    med = {s: statistics.median(v) for s, v in rates.items()}
    pairs = [ratio(h, p) for h, p in zip(rates["harness"], rates["plain"], strict=False)]
    cpu_pairs = [ratio(p, h) for h, p in zip(cpu["harness"], cpu["plain"], strict=False)]
    paired = spread(pairs)
    return {"harness_samples_per_s": round(med["harness"], 2), "plain_samples_per_s": round(med["plain"], 2),
            "ratio": round(med["harness"] / med["plain"], 4), "paired_ratios": pairs, "paired": paired,
            "cpu_paired": spread(cpu_pairs), "cpu_ms_per_step": cpu,
            "samples_per_s": {s: [round(x, 2) for x in v] for s, v in rates.items()},
            "nproc_per_node": nproc, "harness_data_workers": workers, "plain_num_workers": 0,
            "goal": f">= {row.goal}", "met": paired["median"] is not None and paired["median"] >= row.goal}


def restart(args: argparse.Namespace, scratch: Path) -> dict:
    """Resume at a shard boundary vs deep inside a ``--shard-mb`` shard (1 rank, 1 lane)."""
    from elastic_harness.data import tar_stream
    from elastic_harness.data.order import Layout, StreamOrder
    from elastic_harness.data.read import LaneReaders

    g = args.global_batch
    per = (args.shard_mb * 2**20 // (RECORD + 1536)) // g * g  # samples per shard, whole steps
    paths = write_shards(scratch / "big", 2, per, seed=1)
    shards = scratch / "big-shards.json"
    shards.write_text(json.dumps(paths))
    at = {"boundary": per // g, "mid": 2 * per // g - 1}  # steps whose end is that position
    out: dict = {"samples_per_shard": per, "shard_bytes": Path(paths[0]).stat().st_size, "runs": []}
    for r in range(max(1, min(args.repeats, 2))):
        for where in (("boundary", "mid") if r % 2 == 0 else ("mid", "boundary")):
            run_dir = scratch / f"restart-{where}-{r}"
            _harness(args, run_dir, shards, HarnessRun(1, at[where], lanes=1, every=at[where]))
            rec = _harness(args, run_dir, shards, HarnessRun(1, at[where] + 2, lanes=1, every=0))
            stream = tar_stream(paths, shuffle_shards=False)
            order = StreamOrder(0, Layout((per, per), 1, 1, 1, False))
            t0 = time.perf_counter()
            LaneReaders(stream, order).read(at[where] * g)
            out["runs"].append({"where": where, "repeat": r, "launch_to_first_step_s": rec["launch_to_first_step_s"],
                                "resume_to_first_step_s": rec["resume_to_first_step_s"],
                                "open_s": round(time.perf_counter() - t0, 4)})
            print(f"bench throughput: restart {where} repeat {r}: {out['runs'][-1]}", file=sys.stderr, flush=True)
    med = {w: statistics.median(x["launch_to_first_step_s"] for x in out["runs"] if x["where"] == w) for w in at}
    after = {w: statistics.median(x["resume_to_first_step_s"] or 0.0 for x in out["runs"] if x["where"] == w) for w in at}
    out.update(median_s=med, ratio=round(med["mid"] / med["boundary"], 4), goal="<= 1.2",
               resume_to_first_step_median_s=after)
    return out


if __name__ == "__main__":
    harness_main(script_parser().parse_args())
