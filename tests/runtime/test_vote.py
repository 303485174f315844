"""The step's vote (``runtime.vote``): each field one float of the all-reduced tensor, read
back by name; the sum over the ranks is the job's vote."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from elastic_harness.runtime.vote import StepVote

pytestmark = pytest.mark.timeout(30)


def test_a_vote_goes_through_the_tensor_unchanged():
    vote = StepVote(loss_sum=12.5, drain=True, save_due=True, snapshot_every=3, copies_busy=True, stop=True,
                    copies_moving=True)
    packed = vote.pack()
    assert packed.dtype == torch.float64 and packed.shape == (len(fields(StepVote)),)
    assert StepVote.unpack(packed) == vote
    assert StepVote.unpack(StepVote().pack()) == StepVote()


def test_the_sum_over_ranks_raises_any_flag_and_keeps_rank_0s_values():
    rank0 = StepVote(loss_sum=1.5, save_due=True, snapshot_every=4)
    rank1 = StepVote(loss_sum=2.0, drain=True, copies_moving=True)
    rank2 = StepVote(loss_sum=0.5, drain=True, stop=True)
    job = StepVote.unpack(rank0.pack() + rank1.pack() + rank2.pack())
    assert job == StepVote(loss_sum=4.0, drain=True, save_due=True, snapshot_every=4, copies_busy=False,
                           stop=True, copies_moving=True)
