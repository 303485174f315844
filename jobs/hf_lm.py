"""A larger script of your own on elastic_harness: a Hugging Face causal LM (built from a
config, no download), your optimizer (AdamW, no weight decay on norms, biases and
embeddings), transformers' own warm-up + cosine schedule, FSDP2 or DDP, mixed precision,
gradient clipping, periodic evaluation and loader processes, all from jobs/hf_lm.yaml.

    elastic-harness run jobs/hf_lm.yaml                          # through the harness
    torchrun --nproc-per-node 2 jobs/hf_lm.py --run-dir runs/hf  # or plain torchrun

Needs the hf extra: pip install -e '.[hf]'.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_harness as eh
from elastic_harness.tasks.charlm import ByteWindows, stdlib_text


def build_model(block):
    config = transformers.GPT2Config(vocab_size=256, n_positions=block, n_embd=48, n_layer=3,
                                     n_head=3, tie_word_embeddings=True)
    return transformers.GPT2LMHeadModel(config)


def param_groups(model, weight_decay):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wte" not in n and "wpe" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def per_sample_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
    return ce.mean(dim=1)


def main():
    run = eh.init(Path(__file__).with_suffix(".yaml"), argv=sys.argv[1:])  # --run-dir, --set
    cli = argparse.ArgumentParser()
    cli.add_argument("--block", type=int, default=32)
    args = cli.parse_args(run.argv)
    model = build_model(args.block).to(run.device)
    # The job's layout decides the wrapping (one place to say it: the harness keeps buddy
    # copies and reshards in memory only when it knows the state is sharded).
    if run.spec.parallelism not in ("ddp", "fsdp"):
        raise SystemExit(f"hf_lm.py wraps the model for parallelism ddp or fsdp, the job says {run.spec.parallelism}")
    if run.spec.parallelism == "fsdp":
        # The mesh on the run's device: FSDP2's default mesh takes the GPU whenever one is
        # visible, so a CPU run on a GPU machine would ask for a GPU per rank.
        mesh = init_device_mesh(run.device.type, (run.dp_degree,))
        for layer in model.transformer.h:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model, device_ids=run.device_ids)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=3e-3, betas=(0.9, 0.95))
    total = run.spec.train.steps
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, total // 10, total)
    run.register(model, optimizer, scheduler=scheduler)

    text = stdlib_text(208_000)
    train_set = ByteWindows(text[:200_000], args.block)
    eval_set = ByteWindows(text[200_000:], args.block)
    for step in run.steps(train_set):
        for batch in step.batches():
            with run.autocast():
                loss = per_sample_loss(model, batch)
            step.backward(loss)
        step.unscale(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step.optimizer_step(optimizer)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        step.done(grad_norm=float(grad_norm))
        if step.eval_due:
            run.evaluate(eval_set, lambda b: {"loss": per_sample_loss(model, b)})
    run.close()


if __name__ == "__main__":
    main()
