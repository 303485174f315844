"""One replica group of ``bench inflight``'s torchft side (one process, started by
``torchft_run``): ``python -m elastic_harness.bench.inflight.torchft_worker CONFIG GROUP``.

The loop is torchft's: ``zero_grad`` asks for the step's quorum (asynchronously), the last
micro-batch's backward all-reduces through the Manager, and ``step`` applies the update only
when ``should_commit`` agrees (the Manager's step count moves then). The group's share of
the global batch and its micro-batches are the harness's (``data.sampler``), and the loss is
scaled as the harness scales it, so an update with every group is the mean over the global
batch. Each attempted step is one JSON line in ``SCRATCH/group-G.jsonl``; the fault is a
``kill`` line, then SIGKILL to the whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_harness.bench.inflight import job
from elastic_harness.bench.inflight.torchft_run import Config


def main(config_path: str, group: int) -> None:
    """Build, report ready, train from ``SCRATCH/go`` until ``steps`` commits, leave."""
    import torch

    torch.set_num_threads(1)
    scratch = Path(config_path).parent
    cfg = Config(**json.loads(Path(config_path).read_text()))
    with open(scratch / f"group-{group}.jsonl", "a", buffering=1) as log:
        parts = {**attach(cfg, group, build(cfg, group)), "log": log}
        (scratch / f"ready-{group}").touch()
        while not (scratch / "go").exists():
            time.sleep(0.01)
        train(cfg, parts, group, log)
    parts["manager"].shutdown(wait=False)
    os._exit(0)  # torchft's server threads need no join: every step is in the log


def build(cfg: Config, group: int) -> dict:
    """The model (seeded: the same in every group), and this group's data: torchft's sampler
    gives each replica group its own shard; a batch is this group's share of the step."""
    import torch
    from torchft import DistributedSampler

    from elastic_harness.data.sampler import micro_batches, rank_share
    from elastic_harness.tasks.mlp import MLPRegression

    task = MLPRegression(**job.TASK_ARGS)
    dataset = task.dataset()
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    lo, hi = rank_share(cfg.global_batch, cfg.groups, group)
    sampler = DistributedSampler(dataset, replica_rank=group, num_replica_groups=cfg.groups, group_rank=0,
                                 num_replicas=1, shuffle=True, seed=cfg.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=hi - lo, sampler=sampler, drop_last=True)
    return {"task": task, "model": model, "sampler": sampler, "loader": loader,
            "parts": micro_batches(cfg.global_batch, cfg.groups, cfg.micro_batch)}


def attach(cfg: Config, group: int, local: dict) -> dict:
    """torchft's objects as ``train_ddp.py`` makes them: a store per group, ProcessGroupGloo,
    the Manager (it heartbeats from here on), PGTransport, torchft's DDP (or the patched one,
    ``torchcompat.ftddp``) and OptimizerWrapper."""
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.optim import OptimizerWrapper

    from elastic_harness.torchcompat.ftddp import patched_torchft_ddp

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg.pg_timeout_s))
    held: dict = {}
    manager = Manager(
        pg=pg, min_replica_size=1, replica_id=f"group_{group}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=cfg.lighthouse, hostname="127.0.0.1", init_sync=False,
        load_state_dict=lambda sd: (held["ddp"].load_state_dict(sd["model"]), held["opt"].load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": held["ddp"].state_dict(), "optim": held["opt"].state_dict()},
        heartbeat_interval=timedelta(milliseconds=cfg.manager_heartbeat_ms),
        timeout=timedelta(seconds=cfg.manager_timeout_s),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=cfg.transport_timeout_s),
                                         device=torch.device("cpu")))
    ddp_class = patched_torchft_ddp() if cfg.patch_ddp_hook else DistributedDataParallel
    held["ddp"] = ddp_class(manager, local["model"])
    held["opt"] = OptimizerWrapper(manager, torch.optim.AdamW(held["ddp"].parameters(), lr=cfg.lr))
    return {**local, **held, "manager": manager, "store": store}


def batches(parts: dict) -> Any:
    """This group's batches, epoch after epoch."""
    epoch = 0
    while True:
        parts["sampler"].set_epoch(epoch)
        yield from parts["loader"]
        epoch += 1


def train(cfg: Config, parts: dict, group: int, log: Any) -> None:
    """Steps until the Manager has committed ``steps``; the victim fires where told."""
    manager = parts["manager"]
    victim = group == cfg.kill_group
    for x, y in batches(parts):
        if manager.current_step() >= cfg.steps:
            break
        record = one_step(cfg, parts, x, y, victim and cfg.kill_point == "in_step")
        log.write(json.dumps({**record, "group": group}) + "\n")
        if victim and record["committed"] and record["step"] == cfg.kill_at_step and cfg.kill_point == "after_step":
            fire(log, record["step"], "after_step")


def one_step(cfg: Config, parts: dict, x: Any, y: Any, may_fire_in_step: bool) -> dict:
    """One attempted step; what it did, as a log record."""
    from elastic_harness.data.sampler import split

    manager, ddp, opt, task = parts["manager"], parts["ddp"], parts["opt"], parts["task"]
    t0 = time.time()
    opt.zero_grad()  # starts the quorum; it forms while this group computes
    chunks = [c for c in split(list(range(len(x))), parts["parts"]) if c]
    for i, idx in enumerate(chunks):
        last = i == len(chunks) - 1
        if may_fire_in_step and last and manager.current_step() == cfg.kill_at_step:
            manager.wait_quorum()  # the next step's quorum now holds this group: its peers reduce with it
            fire(parts["log"], cfg.kill_at_step + 1, "in_step")
        with contextlib.nullcontext() if last else ddp.no_sync():
            per_sample = task.loss(ddp, (x[idx], y[idx]))
            (per_sample.sum() * (cfg.groups / cfg.global_batch)).backward()  # the last one all-reduces
    participating, participants = manager.is_participating(), manager.num_participants()
    before = manager.current_step()
    opt.step()  # should_commit(), then AdamW only when it says yes
    return {"t0": t0, "t": time.time(), "step": before + 1, "committed": manager.current_step() == before + 1,
            "micro_batches": len(chunks), "samples": len(x), "participating": participating,
            "participants": participants, "errored": bool(manager.errored())}


def fire(log: Any, step: int, where: str) -> None:
    """The fault: a ``kill`` line, then SIGKILL to this group's whole process group."""
    log.write(json.dumps({"event": "kill", "t": time.time(), "step": step, "kill_point": where}) + "\n")
    log.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
