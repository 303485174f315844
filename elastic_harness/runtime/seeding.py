"""Seed torch's generators often (every step, every loaded item) without paying for it.

``torch.manual_seed`` also seeds every accelerator backend. A backend that is not
initialized (all of them on a CPU machine: CUDA, XPU, MTIA) queues the seed for later and
records ``traceback.format_stack()`` with it, reading every frame's source through
``linecache`` (one ``stat`` per frame): 0.5 ms per call from a shallow stack on the
reference machine, several ms from inside a training loop's generators. The harness seeds
once per step and once per loaded item (``runtime.loader``), so on small steps that was
most of its overhead against a plain DDP script (``bench throughput``).

``seed_torch`` has ``torch.manual_seed``'s effect on the generators the harness can use:
the CPU generator, and CUDA's, directly when CUDA is initialized, queued by torch (the slow
way, kept for exactness) when CUDA could still start in this process. It does not seed
MPS, XPU, MTIA or custom (privateuse1) devices, which the harness does not run on
(``device: auto|cpu|cuda``). A process forked from one that used CUDA (a loader process)
cannot use CUDA, and ``torch.manual_seed`` skips it there too. A torch built without CUDA
(the CPU wheels) skips those checks altogether: they were a third of a seed's cost per item.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from elastic_harness.torchcompat.nn import cuda_in_bad_fork

_CUDA_BUILT = torch.backends.cuda.is_built()  # fixed for the process (and its forks)


def seed_torch(seed: int) -> None:
    """Seed the CPU generator and, where it is or may become usable, CUDA's."""
    torch.default_generator.manual_seed(seed)
    if not _CUDA_BUILT:
        return
    cuda = torch.cuda
    if cuda.is_initialized() or (not cuda_in_bad_fork() and cuda.is_available()):
        cuda.manual_seed_all(seed)


def step_seed(seed: int, step: int, rank: int) -> int:
    """Per-step, per-rank RNG seed: randomness needs no checkpointing and replays exactly."""
    return ((seed * 1_000_003 + step) * 10_007 + rank) % (2**63 - 1)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators (``seed_torch``: ``torch.manual_seed``'s effect,
    without its cost every step)."""
    seed_torch(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
