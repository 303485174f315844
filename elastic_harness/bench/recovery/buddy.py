"""``elastic-harness bench buddy``: what a buddy copy adds to a step, in one process pair.

Two ranks on loopback gloo train the recovery bench's FSDP2 MLP (``bench.recovery.launching``'s job:
dim 16, hidden 64, depth 2, AdamW, 30 samples a step) with the real in-memory tier
(``memtier.tier.MemoryTier`` on memfd slots, ``BuddyLink`` between the two ranks over its
loopback streams, ``memtier.conduit``). Blocks
of ``--block`` steps rotate through three modes, the same steps on both ranks:

- ``none``: no snapshot;
- ``snapshot``: a snapshot after every step, no copy;
- ``copy``: a snapshot after every step, sent as a buddy copy whenever no copy still moves
  (agreed in the step's vote, ``runtime.vote``, as ``runtime.hook`` does; every mode pays it).

It prints JSON: per mode the median step wall time and the training thread's CPU time per
step, the extra of ``snapshot`` over ``none`` and of ``copy`` over ``snapshot`` in ms and as
a share of the ``none`` step, the seconds a copy holds the training thread (``copy_cost_ms``:
starting it, every call that moved its bytes, landing the one received), and how many steps
sent one.
The pieces of one copy's fixed work are timed apart (``parts_ms``: the capture, the skeleton
as JSON whole, and as a copy re-encodes it with only the train position's entry changed). No
agents, no rendezvous: the per-step figures of the tier alone, apart from the launch noise of
``bench recovery --only memory-cost``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

from elastic_harness.bench import check_out, scratch_dir, spawning_into
from elastic_harness.errors import HarnessError

MODES = ("none", "snapshot", "copy")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("buddy", help="per-step cost of FSDP snapshots and buddy copies, 2 local ranks (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=900, help="timed steps, all modes together (default 900)")
    p.add_argument("--block", type=int, default=15, help="steps per mode before the next one (default 15)")
    p.add_argument("--hidden", type=int, default=64, help="MLP width (default 64: bench recovery's job)")
    p.add_argument("--depth", type=int, default=2, help="MLP depth (default 2)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_buddy)


def cmd_buddy(args: argparse.Namespace) -> int:
    if args.steps < 3 * args.block or args.block < 1 or args.hidden < 1 or args.depth < 1:
        raise HarnessError("--block, --hidden and --depth must be >= 1 and --steps >= 3 * --block")
    check_out(args.out)
    import shutil

    import torch.multiprocessing as mp

    from elastic_harness.simcluster.cluster import free_port

    scratch = scratch_dir("eh-bench-buddy-", None)
    try:
        with spawning_into(scratch):  # torch's compile cache and traceback files: not in /tmp
            mp.start_processes(_rank, args=(free_port(), str(scratch), vars(args)), nprocs=2, join=True,
                               start_method="spawn")
        ranks = [json.loads((scratch / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = summarize(ranks, args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def summarize(ranks: list[dict], args: argparse.Namespace) -> dict:
    """Pure: the JSON from both ranks' per-step samples (medians over the ranks' medians)."""
    def med(key: str, mode: str) -> float:
        return statistics.median(statistics.median(r[key][mode]) for r in ranks)

    wall = {m: med("wall", m) for m in MODES}
    mean = {m: statistics.mean(statistics.mean(r["wall"][m]) for r in ranks) for m in MODES}
    share = statistics.median(r["sent"] / max(1, len(r["wall"]["copy"])) for r in ranks)
    cpu = {m: med("cpu", m) for m in MODES}
    base = wall["none"]
    out: dict = {
        "model": {"dim": 16, "hidden": args.hidden, "depth": args.depth, "parallelism": "fsdp", "ranks": 2},
        "steps_per_mode": len(ranks[0]["wall"]["none"]), "block": args.block,
        "step_ms": {m: round(1e3 * v, 3) for m, v in wall.items()},
        "train_thread_cpu_ms": {m: round(1e3 * v, 3) for m, v in cpu.items()},
        "snapshot_extra_ms": round(1e3 * (wall["snapshot"] - base), 3),
        "copy_extra_ms": round(1e3 * (wall["copy"] - wall["snapshot"]), 3),
        "snapshot_share": round((wall["snapshot"] - base) / base, 4),
        "copy_share": round((wall["copy"] - wall["snapshot"]) / base, 4),
        "tier_share": round((wall["copy"] - base) / base, 4),
        "save_ms": {m: round(1e3 * med("save", m), 3) for m in ("snapshot", "copy")},
        "copy_cost_ms": round(1e3 * statistics.median(statistics.median(r["copy_cost"]) for r in ranks), 3),
        "copy_latency_ms": round(1e3 * statistics.median(statistics.median(r["copy_wall"]) for r in ranks), 3),
        "copies_sent_share": round(share, 3),
        # Means, not medians: when fewer than half the steps send a copy, the median step of
        # ``copy`` is one that sent none. Per copy: the mean extra over the share that sent.
        "step_mean_ms": {m: round(1e3 * v, 3) for m, v in mean.items()},
        "copy_extra_mean_ms": round(1e3 * (mean["copy"] - mean["snapshot"]), 3),
        "copy_extra_per_copy_ms": round(1e3 * (mean["copy"] - mean["snapshot"]) / max(share, 1e-9), 3),
        "parts_ms": ranks[0]["parts"],
        "method": ("2 ranks, loopback gloo, FSDP2; modes rotate in blocks of the same steps on both ranks; "
                   "medians per mode, then over the ranks; extras are differences of median step times "
                   "(the *_mean_ms ones of means; per copy: over the share of steps that sent one)"),
    }
    return out


def _rank(rank: int, port: int, root: str, opts: dict) -> None:
    import torch
    import torch.distributed as dist

    from elastic_harness.memtier.host import HostSlots

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    hosts = HostSlots.create(1, slots=4)
    try:
        model, optim, train, state, tier = _job(rank, hosts, opts)
        samples, sent = _train(rank, model, optim, train, state, tier, opts)
        tier.settle(30)
        copy_cost = list(tier.link.cost_s) if tier.link else [0.0]
        copy_wall = list(tier.link.wall_s) if tier.link else [0.0]
        parts = _parts(tier, state) if rank == 0 else {}
        dist.barrier()
        tier.close()
        Path(root, f"rank{rank}.json").write_text(json.dumps({**samples, "copy_cost": copy_cost,
                                                               "copy_wall": copy_wall, "sent": sent,
                                                               "parts": parts}))
    finally:
        hosts.close()
        dist.destroy_process_group()


def _job(rank: int, hosts, opts: dict) -> tuple:
    """The FSDP2 MLP over both ranks, its optimizer, train position and state, and the
    memory tier over this rank's slots (buddy copies kept: one rank per node)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_harness.data.sampler import DataState
    from elastic_harness.memtier.peer import Wire
    from elastic_harness.memtier.tier import MemoryTier, Place
    from elastic_harness.runtime.state import TrainState, build_state
    from elastic_harness.runtime.topology import Topology
    from elastic_harness.tasks.mlp import MLPRegression

    group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = MLPRegression(samples=1024, dim=16, hidden=opts["hidden"], depth=opts["depth"]).build_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = TrainState(DataState(0, 1024), world_size=2)
    state = build_state(model, optim, train)
    tier = MemoryTier.open(hosts.describe(), 0, Place(rank, 2, Wire.of(group, 2), 0x5EED), warn=print,
                           local_size=1, link_key=b"bench buddy, not secret", link_host="127.0.0.1")
    tier.restore(state, Topology.build(2, 1, 2, "fsdp", rank=rank))
    return model, optim, train, state, tier


def _train(rank: int, model, optim, train, state, tier, opts: dict) -> tuple[dict, int]:
    """The warm-up, then the timed steps, the modes rotating in blocks: per mode the wall,
    training-thread CPU and save seconds of every step, and how many timed steps sent a copy."""
    import torch
    import torch.distributed as dist

    from elastic_harness.runtime.vote import StepVote

    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(15, 16, generator=gen), torch.randn(15, 1, generator=gen)
    samples = {k: {m: [] for m in MODES} for k in ("wall", "cpu", "save")}
    sent, warmup = 0, 30
    for i in range(warmup + opts["steps"]):
        mode = MODES[(i // opts["block"]) % 3] if i >= warmup else "copy"
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        # the step's vote, as ``runtime.hook`` starts it: copies busy or moving anywhere
        totals = StepVote(float(loss.detach()), copies_busy=tier.busy(), copies_moving=tier.moving()).pack()
        work = dist.all_reduce(totals, async_op=True)
        optim.step()
        optim.zero_grad()
        work.wait()
        vote = StepVote.unpack(totals)
        train.step += 1
        train.data = train.data.advance(30)
        s0 = time.perf_counter()
        if mode != "none":
            send = mode == "copy" and not vote.copies_busy
            tier.save(train.step, state, send=send, settled=not vote.copies_moving)
            sent += int(send and i >= warmup)
        s1 = time.perf_counter()
        if i >= warmup:
            samples["wall"][mode].append(s1 - t0)
            samples["cpu"][mode].append(time.thread_time() - c0)
            if mode != "none":
                samples["save"][mode].append(s1 - s0)
    return samples, sent


def _parts(tier, state) -> dict:
    """The fixed pieces of one copy's work, timed apart (median of 50, ms)."""
    import pickle

    from elastic_harness.memtier import peer, snapshot

    cap = snapshot.capture(state)

    def timed(fn) -> float:
        xs = []
        for _ in range(50):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        return round(1e3 * statistics.median(xs), 4)

    encoder = peer.SkeletonEncoder()
    moved = {**cap.parts, "train": pickle.dumps({"moved": 1})} if "train" in cap.parts else dict(cap.parts)
    flip = [cap.parts, moved]

    def per_copy() -> None:  # as a copy: only the train position's entry changed since the last
        flip.reverse()
        encoder.encode(flip[0])

    return {"capture": timed(lambda: snapshot.capture(state)),
            "skeleton_json": timed(lambda: peer.encode_skeleton(snapshot.unpack(cap.skeleton))),
            "skeleton_json_per_copy": timed(per_copy),
            "skeleton_json_bytes": len(peer.encode_skeleton(snapshot.unpack(cap.skeleton))),
            "data_bytes": cap.data_len}
