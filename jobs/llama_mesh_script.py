"""Your own script on a mesh layout: the harness hands out the DeviceMesh, the script applies
its own tensor-parallel plan and FSDP2 (docs/layouts.md).

    elastic-harness run jobs/llama_mesh_script.yaml
"""

import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import elastic_harness as eh
from elastic_harness.runtime.mesh import check_plan, fsdp_mesh
from elastic_harness.tasks.llama import TinyLlamaLM

PLAN = {"layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel()}


def main():
    run = eh.init(Path(__file__).with_suffix(".yaml"), argv=sys.argv[1:])
    lm = TinyLlamaLM(block_size=32, dim=64, layers=2, heads=4, hidden=128, max_chars=200_000)
    torch.manual_seed(run.spec.train.seed)  # the same initial weights on every rank
    model = lm.build_model().to(run.device)
    check_plan(model, PLAN, "llama_mesh_script.py")  # torch only warns on a name it cannot find
    parallelize_module(model, run.mesh["tp"], PLAN)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh(run.mesh))
    fully_shard(model, mesh=fsdp_mesh(run.mesh))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.register(model, optimizer)
    for step in run.steps(lm.dataset()):
        for batch in step.batches():  # this data-parallel rank's share; a tensor group's ranks read the same
            step.backward(lm.loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
    run.close()


if __name__ == "__main__":
    main()
