"""The resize tolerance (docs/tolerance.md) is a claim about short spans: what the doc states
is what the code checks, and what it states about the arithmetic holds on the MLP task."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from elastic_harness.commands.report import DEFAULT_ATOL, DEFAULT_RTOL, within
from elastic_harness.tasks.mlp import MLPRegression

DOC = Path(__file__).resolve().parents[2] / "docs" / "tolerance.md"
G, MICRO, LR = 30, 8, 0.01  # jobs/mlp.yaml


def test_the_doc_states_the_tolerance_the_code_checks():
    text = DOC.read_text()
    assert f"atol={DEFAULT_ATOL:g}, rtol={DEFAULT_RTOL:g}" in text
    for claim in ("bit for bit", "60 steps", "1500 steps", "short span", "Adam", "Dropout"):
        assert claim in text, claim


def train(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """The harness's arithmetic for one step in one process: each rank's share of the G
    samples in micro-batches, the loss sum scaled by W/G, the ranks' gradients summed and
    averaged (DDP), AdamW. Only the summation order depends on ``world_size``."""
    task = MLPRegression()
    x, y = task.dataset().tensors
    torch.manual_seed(0)
    model = task.build_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    share = math.ceil(G / world_size)
    for step in range(steps):
        idx = [(step * G + i) % len(x) for i in range(G)]
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            mine = idx[rank * share:(rank + 1) * share]
            model.zero_grad()
            for m in range(0, len(mine), MICRO):
                b = mine[m:m + MICRO]
                (task.loss(model, (x[b], y[b])).sum() * world_size / G).backward()
            for t, p in zip(total, params, strict=True):
                t += p.grad
        for t, p in zip(total, params, strict=True):
            p.grad = t / world_size
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def one_thread():
    """A tiny model: one thread is ten times faster than several on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_resized_runs_stay_within_the_tolerance_for_a_short_span(one_thread):
    """60 steps (the MLP job's length) at 1 rank and at 3: close, not equal. (At 4 ranks the
    shares, 8+8+8+6, are exactly the 1-rank run's micro-batches: bit-identical here.)"""
    one, three = train(1, 60), train(3, 60)
    assert any(not torch.equal(one[k], three[k]) for k in one), "the sums should differ in rounding"
    assert within(three, one, DEFAULT_ATOL, DEFAULT_RTOL)


def test_adam_amplifies_the_rounding_of_a_zero_gradient():
    """One parameter whose gradient terms cancel exactly: its computed gradient is rounding
    noise that depends on how the terms were split among ranks. SGD moves it by that noise;
    Adam, which normalises the gradient, by up to lr a step."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, generator=g)
    terms = torch.cat([a, -a])[torch.randperm(128, generator=g)]

    def gradient(world_size: int) -> torch.Tensor:
        parts = [terms[r::world_size].sum() for r in range(world_size)]
        return sum(parts[1:], parts[0])

    assert gradient(1) != gradient(3), "the cancellation should leave different rounding"

    def drift(optimizer: type, world_size: int) -> float:
        p = torch.nn.Parameter(torch.zeros(()))
        opt = optimizer([p], lr=LR)
        for _ in range(20):
            p.grad = gradient(world_size).clone()
            opt.step()
        return p.item()

    sgd = abs(drift(torch.optim.SGD, 1) - drift(torch.optim.SGD, 3))
    adam = abs(drift(torch.optim.Adam, 1) - drift(torch.optim.Adam, 3))
    assert sgd < DEFAULT_ATOL < 100 * DEFAULT_ATOL < adam
    assert drift(torch.optim.Adam, 3) == drift(torch.optim.Adam, 3)  # same size: the same drift
