"""Distributed evaluation over a deterministic split: exact means, whatever the world size.

Data-parallel rank ``r`` of ``D`` (``runtime.topology``; the world size under ``ddp`` and
``fsdp``) evaluates the contiguous share ``[floor(r*N/D), floor((r+1)*N/D))`` of the
evaluation set, in the same number of batches on every rank (FSDP and DDP run collectives
inside forward, so batch counts must match). The ranks of a tensor-parallel group evaluate
the same share: summed over every process, their sums and counts grow alike, so the means
stay exact. ``fn(batch)`` returns per-sample
values ``{metric: tensor of shape [B]}``; their sums and the sample count are all-reduced,
so each metric is the exact mean over all ``N`` samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.data.sampler import micro_batches, rank_share, split
from elastic_harness.errors import HarnessError


class EvaluateError(RuntimeError):
    """The user's evaluation code raised (the message names what and where)."""


def eval_batches(n: int, dp_size: int, dp_rank: int, batch_size: int) -> list[list[int]]:
    """Pure: this data-parallel rank's evaluation batches (dataset indices)."""
    if n < dp_size:
        raise HarnessError(
            f"the evaluation set has {n} samples, fewer than the {dp_size} ranks",
            "use a larger evaluation set or fewer ranks",
        )
    lo, hi = rank_share(n, dp_size, dp_rank)
    return split(list(range(lo, hi)), micro_batches(n, dp_size, batch_size))


def reduce_metrics(sums: dict[str, float], count: int, group: Any = None) -> dict[str, float]:
    """All-reduce per-metric sums and the sample count; return the means."""
    names = sorted(sums)
    totals = torch.tensor([*(sums[k] for k in names), float(count)], dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    n = float(totals[-1])
    return {k: float(totals[i]) / n for i, k in enumerate(names)}


def run_eval(dataset: Any, fn: Callable[[Any], dict[str, torch.Tensor]], batches: list[list[int]],
             collate: Callable, to_device: Callable[[Any], Any]) -> tuple[dict[str, float], int]:
    """This rank's per-metric sums and sample count."""
    sums: dict[str, float] = {}
    count = 0
    for chunk in batches:
        values = fn(to_device(collate([dataset[i] for i in chunk])))
        if not isinstance(values, dict) or not values:
            raise HarnessError(
                f"evaluate returned {type(values).__name__}, not a dict of per-sample tensors",
                "return e.g. {'loss': per_sample_loss} with one value per sample",
            )
        for name, v in values.items():
            v = torch.as_tensor(v).detach()
            if v.ndim != 1 or v.shape[0] != len(chunk):
                raise HarnessError(
                    f"evaluate's '{name}' has shape {tuple(v.shape)}, expected ({len(chunk)},): "
                    "one value per sample",
                    "return per-sample values (e.g. reduction='none'), not a batch mean",
                )
            sums[name] = sums.get(name, 0.0) + float(v.double().sum())
        count += len(chunk)
    return sums, count
