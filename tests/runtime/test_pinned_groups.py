"""An operation pinned to a generation of a live group (``torchcompat.groups.pinned``): the
checkpoint saver's background threads. One launched once that generation was left is
refused, not launched on the next generation, whose members never take part in it (a
worker kept in place hung at a join that way, its save half-way). One real gloo backend of
one rank per generation, in this process."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import torch
import torch.distributed as dist

from elastic_harness.torchcompat import groups

pytestmark = pytest.mark.timeout(60)


def generation(store: dist.Store, n: int) -> groups.Inner:
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"g{n}", store), 0, 1, dt.timedelta(seconds=30))
    return groups.Inner({"cpu": gloo}, frozenset())


@pytest.fixture
def ckpt_group():
    store = dist.HashStore()
    lineage = groups.Lineage("ckpt", "ckpt", 0, 1, spans_world=True)
    lineage.raises = True  # the checkpoint group's: a save fails rather than commit
    group = groups.make_group(lineage, generation(store, 0))
    return lineage, group, store


def broadcast(group) -> torch.Tensor:
    t = torch.arange(3.0)
    group.broadcast([t]).wait()
    return t


def test_a_pinned_operation_runs_in_its_own_generation_on_any_thread(ckpt_group):
    lineage, group, _ = ckpt_group
    pinned = groups.pinned(group, broadcast)
    done = []
    thread = threading.Thread(target=lambda: done.append(pinned(group)))
    thread.start()
    thread.join(30)
    assert torch.equal(done[0], torch.arange(3.0))
    assert (lineage.broken, lineage.skipped) == (None, 0)


def test_a_pinned_operation_launched_after_a_reformation_is_refused_and_the_new_generation_is_untouched(ckpt_group):
    lineage, group, store = ckpt_group
    pinned = groups.pinned(group, broadcast)  # a save begun in generation 0
    lineage.leave("a peer left")
    newest = groups.make_group(lineage, generation(store, 1))
    with pytest.raises(RuntimeError, match="re-formed"):
        pinned(group)
    assert (lineage.broken, lineage.skipped) == (None, 0), "the refusal is the old save's, not the new generation's"
    assert torch.equal(broadcast(newest), torch.arange(3.0)), "an operation not pinned runs on the new generation"
    assert torch.equal(groups.pinned(newest, broadcast)(newest), torch.arange(3.0))


def test_a_group_that_is_not_live_is_left_as_it_is():
    fn = broadcast
    assert groups.pinned(object(), fn) is fn
