"""The training script of ``bench recovery --only soak``: steps that stop
legitimately, on nodes that are alive, for as long as the job runs.

``soak_script.py SAVE_EVERY SAVE_S EVAL_EVERY EVAL_S PAUSE_EVERY PAUSE_S``: every
``SAVE_EVERY`` steps every rank spends ``SAVE_S`` in a synchronous write of its own (an
announced phase, as a blocking save is: ``run.phase``); every ``EVAL_EVERY`` steps a slow
evaluation (``run.evaluate`` over 8 batches of ``EVAL_S / 8`` seconds each); every
``PAUSE_EVERY`` steps the last rank pauses ``PAUSE_S`` without saying so (a slow node: its
peers wait for it in the next collective). None of this is a failure: the bench counts the
verdicts and hangs the agents report anyway (false detections).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_harness as eh


def main() -> None:
    run = eh.init()
    save_every, save_s, eval_every, eval_s, pause_every, pause_s = (float(a) for a in sys.argv[1:7])
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.register(model, optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = TensorDataset(x, torch.tanh(x[:, :8]))
    held_out = TensorDataset(x[:64], torch.tanh(x[:64, :8]))

    def slow_metric(batch):
        time.sleep(eval_s / 8)
        xb, yb = batch
        return {"mse": ((model.module(xb) - yb) ** 2).mean(dim=1)}

    for step in run.steps(data):
        for xb, yb in step.batches():
            step.backward(nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
        n = run.step
        if save_every and n % int(save_every) == 0:
            with run.phase("a synchronous save of the script's own", save_s + 60):
                time.sleep(save_s)
        if eval_every and n % int(eval_every) == 0:
            run.evaluate(held_out, slow_metric)
        if pause_every and n % int(pause_every) == 0 and run.rank == run.world_size - 1:
            time.sleep(pause_s)
    run.close()


if __name__ == "__main__":
    main()
