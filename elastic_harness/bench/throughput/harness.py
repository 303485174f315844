"""The harness side of ``bench throughput``: the plain script's model, optimizer and data on
the public API (``elastic_harness.init``, ``run.register``, ``run.steps``,
``step.batches/backward/done``), as a user would convert ``throughput.plain``.

The bench starts it through ``elastic-harness run`` with a script job (``script.path`` =
this file), so what is measured is what users get from the harness: our agent, its step
watchdog, the run's events and TensorBoard scalars every ``train.log_every`` steps, the
harness's data order and, where the job asks, its loader processes (``data.workers``).
Steps, batch sizes, loader processes and checkpoint policy come from the job; the script's
arguments carry only what the plain script also takes (``common.parse_args``).

The time spent in ``step.done()`` is recorded too (``hook_s``): the harness's own per-step
cost, which the bench reports next to the throughput.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_harness as eh
from elastic_harness.bench.throughput.common import (
    StepClock,
    build_model,
    build_optimizer,
    parse_args,
)
from elastic_harness.bench.throughput.data import open_images


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    run = eh.init(args.job)
    if args.hsdp_shard:  # the hsdp row: the harness's mesh layout, FSDP2 over its data-parallel mesh
        from torch.distributed.fsdp import fully_shard

        from elastic_harness.runtime.mesh import fsdp_mesh

        model = fully_shard(build_model(args.hidden).to(run.device), mesh=fsdp_mesh(run.mesh))
    else:
        model = DDP(build_model(args.hidden).to(run.device), device_ids=run.device_ids)
    optimizer = build_optimizer(model)
    run.register(model, optimizer)
    clock = StepClock(run.rank, run.world_size)
    for step in run.steps(open_images(args.data, args.data_dir)):
        clock.tick()
        for x, y in step.batches():
            step.backward(F.cross_entropy(model(x), y))
            clock.count(len(y))
        clock.mark("compute")
        optimizer.step()
        optimizer.zero_grad()
        clock.mark("optimizer")
        t0 = time.perf_counter()
        step.done()
        clock.hook(time.perf_counter() - t0)
        clock.mark("hook")
    clock.finish(args.out, side="harness", accumulate=len(step.plan))
    run.close()


if __name__ == "__main__":
    main()
