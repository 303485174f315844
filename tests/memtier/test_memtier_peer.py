"""Restoring replicated (DDP) state at another world size: from a rank's own memory, from a
peer's, or from storage (``memtier.choose``, ``memtier.peer``, ``MemoryTier.restore``).

In one process the other rank is played back: its gathers' contributions are given, and
what one rank sends is recorded and handed to the receiving rank. One test runs two real
processes over gloo (the transfer into a slot's memory, and a real DDP model).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from elastic_harness.data.sampler import DataState
from elastic_harness.memtier import snapshot
from elastic_harness.memtier.choose import MEMORY, PEER, STORAGE, Offer, choose
from elastic_harness.memtier.host import HostSlots, slot_paths
from elastic_harness.memtier.peer import (
    Rules,
    Wire,
    decode_offers,
    decode_skeleton,
    encode_offers,
    encode_skeleton,
    portable,
    restore_rules,
)
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.tier import MemoryTier, Place
from elastic_harness.runtime.state import TrainState, build_state
from elastic_harness.runtime.topology import Topology
from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)

D, E = b"a" * 32, b"b" * 32


def rep(step, world, rank, digest=D):
    return Offer(step, world, rank, digest, True)


def ddp(world, rank):
    """A DDP job's layout, one rank per node."""
    return Topology.build(world, 1, world, "ddp", rank=rank)


def replicated_layout(kind, model, state):
    """Does the tier restore this job's state as a replica (``peer.restore_rules``)?"""
    layout = Topology.build(2, 2, 1, kind)
    return restore_rules(layout, 2, portable(layout, model, state)).replicated


# ----- the decision ------------------------------------------------------------------------

def test_a_lost_node_restores_every_survivor_from_its_own_memory():
    # 4 ranks (2 nodes) snapshotted step 35; node 1 is lost, the survivors are ranks 0, 1 now.
    plan = choose([[rep(35, 4, 0), rep(34, 4, 0)], [rep(35, 4, 1)]], world_size=2, replicated=True)
    assert (plan.source, plan.step, plan.holders, plan.senders(2)) == (MEMORY, 35, (0, 1), {})
    # The survivor node became group 1: its ranks are 2 and 3 now; the new node's 0 and 1 receive.
    plan = choose([[], [], [rep(35, 4, 0)], [rep(35, 4, 1)]], world_size=4, replicated=True)
    assert (plan.source, plan.step, plan.holders) == (PEER, 35, (2, 3))
    assert plan.senders(4) == {0: 2, 1: 3}  # spread over the holders


def test_the_newest_step_any_rank_holds_wins_and_its_holders_send_it():
    # A rank was killed after snapshotting 35 on one rank only: 35 is a full replica all the same.
    plan = choose([[rep(34, 2, 0)], [rep(35, 2, 1), rep(34, 2, 1)], []], world_size=3, replicated=True)
    assert (plan.source, plan.step, plan.holders, plan.senders(3)) == (PEER, 35, (1,), {0: 1, 2: 1})
    # Same world size, everyone's own newest: the plain same-layout path (no transfer).
    plan = choose([[rep(35, 2, 0)], [rep(35, 2, 1)]], world_size=2, replicated=True)
    assert (plan.source, plan.step, plan.same_layout) == (MEMORY, 35, True)


def test_sharded_state_never_restores_across_world_sizes():
    fsdp = [[Offer(35, 4, 0, D, False)], [Offer(35, 4, 1, D, False)]]
    assert choose(fsdp, world_size=2, replicated=False).source == STORAGE
    # Not replicated now (FSDP), whatever the snapshots say: storage.
    assert choose([[rep(35, 4, 0)], [rep(35, 4, 1)]], world_size=2, replicated=False).source == STORAGE
    # Same world size, every rank its own shard: memory, as before.
    same = [[Offer(35, 2, 0, D, False)], [Offer(35, 2, 1, E, False)]]
    assert choose(same, world_size=2, replicated=False).source == MEMORY


def test_any_doubt_about_the_newest_step_means_storage():
    disagree = choose([[rep(35, 4, 0)], [rep(35, 4, 1, E)]], world_size=2, replicated=True)
    assert disagree.source == STORAGE and "layout" in disagree.reason
    mixed = choose([[rep(35, 4, 0)], [Offer(35, 4, 1, D, False)]], world_size=2, replicated=True)
    assert mixed.source == STORAGE  # never an older step instead: it would be older than the newest
    assert choose([[], []], world_size=2, replicated=True).source == STORAGE
    assert choose([[rep(35, 4, 0)]], world_size=2, replicated=True).source == STORAGE  # offers of 1 rank


def test_offers_travel_as_int64_and_bad_ones_are_none():
    offers = [rep(35, 4, 3), Offer(2**40, 1, 0, bytes(range(32)), False)]
    values = encode_offers(offers)
    assert all(isinstance(v, int) and -2**63 <= v < 2**63 for v in values)
    assert decode_offers(values) == offers
    assert len(encode_offers([])) == len(values) and decode_offers(encode_offers([])) == []
    assert decode_offers(values[:-1]) == [] and decode_offers([99] + values[1:]) == []


# ----- the skeleton as JSON ----------------------------------------------------------------

def _state(steps: int = 3, extra=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    train = TrainState(DataState(0, 100), world_size=2)
    for i in range(steps):
        _train_step(model, optim, i)
        sched.step()
    train.step, train.data = steps, train.data.advance(30 * steps)
    return build_state(model, optim, train, scheduler=sched, extra=extra), model, optim


def _train_step(model, optim, i):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad()


def test_a_skeleton_round_trips_through_json_exactly():
    state, *_ = _state()
    skeleton = snapshot.unpack(snapshot.capture(state).skeleton)
    back = decode_skeleton(encode_skeleton(skeleton))
    assert back == skeleton  # tuples stay tuples, int keys int keys, dtypes dtypes
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)
    assert set(back["optim"]["state"]) == {0, 1, 2, 3}


def test_decoding_builds_nothing_but_plain_values():
    with pytest.raises(snapshot.Unsupported):
        encode_skeleton({"x": {1, 2}})  # a set: not sent (the sender falls back, below)
    for bad in ['{"dt":"load"}', '{"dt":"__class__"}', '{"x":1}', '{"r":[0,4,"float32",[-1]]}',
                '{"d":[[1.5,2]]}', '{"r":[0,4,"float32"]}']:
        with pytest.raises(ValueError):
            decode_skeleton(bad.encode())


# ----- a restore, two ranks played back ----------------------------------------------------

class Recorder:
    """One rank's side of the wire: ``others`` are the other rank's gather contributions;
    ``sent`` collects what it sends, ``inbox`` feeds what it receives."""

    def __init__(self, rank: int, others: list, inbox: list | None = None) -> None:
        self.rank, self.others, self.inbox, self.sent = rank, list(others), list(inbox or []), []

    def wire(self) -> Wire:
        def gather(values):
            other = self.others.pop(0)
            return [other, values] if self.rank == 1 else [values, other]

        def recv(t, src):
            t.copy_(self.inbox.pop(0))

        return Wire(gather, lambda t, dst: self.sent.append(t.clone()), recv)


@pytest.fixture
def nodes():
    """Two agents' slots (one local rank each)."""
    hosts = [HostSlots.create(1) for _ in range(2)]
    regions = [[Region(p) for p in slot_paths(h.describe(), 0)] for h in hosts]
    yield regions
    for rs in regions:
        for r in rs:
            r.close()
    for h in hosts:
        h.close()


def _published(regions):
    return [(h.step, h.world_size, h.rank, h.replicated) for h in (r.header() for r in regions)
            if h is not None and h.published]


def test_a_joining_rank_receives_the_state_bit_for_bit_and_keeps_it(nodes):
    state, model, optim = _state()
    saver = MemoryTier(nodes[0], Place(0, 1, Recorder(0, []).wire()), warn=print)
    saver.rules = Rules(replicated=True)  # a DDP job at world size 1 saved step 3
    saver.save(3, state)
    assert _published(nodes[0]) == [(3, 1, 0, True)]
    # Scale-up to 2: rank 0 (the old node) holds step 3, rank 1 (the new node) has nothing.
    holder = Recorder(0, [encode_offers([]), [0], [0], [0]])  # offers; layout, transfer, load agreed
    fresh0, model0, optim0 = _state(steps=0)
    got0 = MemoryTier(nodes[0], Place(0, 2, holder.wire()), warn=print).restore(fresh0, ddp(2, 0))
    assert (got0.source, got0.step, got0.senders, got0.receivers) == (PEER, 3, (0,), 1)
    assert len(holder.sent) == 3  # [ok, data bytes, json bytes], the skeleton's JSON, the tensor bytes
    joiner = Recorder(1, [encode_offers([Offer(3, 1, 0, snapshot.capture(state).digest, True)]), [0], [0], [0]],
                      inbox=holder.sent)
    fresh1, model1, optim1 = _state(steps=0)
    got1 = MemoryTier(nodes[1], Place(1, 2, joiner.wire()), warn=print).restore(fresh1, ddp(2, 1))
    assert (got1.source, got1.step) == (PEER, 3)
    assert [name for name, _ in got1.phases] == ["offers", "layout", "transfer", "load", "keep"]
    assert fresh1["train"].step == 3 and fresh1["train"].data == state["train"].data
    assert fresh1["sched"].obj.state_dict() == state["sched"].obj.state_dict()
    assert optim1.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    for m, o in ((model, optim), (model0, optim0), (model1, optim1)):
        _train_step(m, o, 9)
    for a, b, c in zip(model.parameters(), model0.parameters(), model1.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)  # the next step is the same step on all
    # The joiner now holds step 3 in its own memory, written at its new rank and world size.
    assert _published(nodes[1]) == [(3, 2, 1, True)]


def test_a_sender_that_cannot_encode_makes_every_rank_use_storage(nodes):
    state, *_ = _state(extra={"odd": {"s": {1, 2}}})
    saver = MemoryTier(nodes[0], Place(0, 1, Recorder(0, []).wire()), warn=print)
    saver.rules = Rules(replicated=True)
    saver.save(3, state)
    holder = Recorder(0, [encode_offers([]), [0], [1]])  # the receiver reports it got nothing
    fresh, _, optim = _state(steps=0, extra={"odd": {"s": set()}})
    assert MemoryTier(nodes[0], Place(0, 2, holder.wire()), warn=print).restore(fresh, ddp(2, 0)) is None
    assert [int(t[0]) for t in holder.sent] == [0]  # it said "cannot" and sent nothing else
    assert fresh["train"].step == 0 and _published(nodes[0]) == []  # untouched; storage next


def test_a_receiver_of_another_layout_makes_every_rank_use_storage_before_any_transfer(nodes):
    state, *_ = _state()
    saver = MemoryTier(nodes[0], Place(0, 1, Recorder(0, []).wire()), warn=print)
    saver.rules = Rules(replicated=True)
    saver.save(3, state)
    offers = encode_offers([Offer(3, 1, 0, snapshot.capture(state).digest, True)])
    wider = build_state(nn.Linear(4, 9), torch.optim.SGD(nn.Linear(4, 9).parameters(), lr=0.1),
                        TrainState(DataState(0, 100), world_size=2))
    joiner = Recorder(1, [offers, [0]])  # rank 0's layout matches (it holds the snapshot)
    assert MemoryTier(nodes[1], Place(1, 2, joiner.wire()), warn=print).restore(wider, ddp(2, 1)) is None
    holder = Recorder(0, [encode_offers([]), [1]])  # rank 1 said: another layout
    fresh, _, optim = _state(steps=0)
    assert MemoryTier(nodes[0], Place(0, 2, holder.wire()), warn=print).restore(fresh, ddp(2, 0)) is None
    assert holder.sent == [] and not optim.state and _published(nodes[0]) == []


def test_fsdp_snapshots_at_another_world_size_fall_back_and_are_cleared(nodes):
    state, *_ = _state()
    MemoryTier(nodes[0], Place(1, 4, Recorder(1, []).wire()), warn=print).save(35, state)
    other = encode_offers([Offer(35, 4, 0, snapshot.capture(state).digest, False)])
    fresh, _, optim = _state(steps=0)
    tier = MemoryTier(nodes[0], Place(1, 2, Recorder(1, [other]).wire()), warn=print)
    assert tier.restore(fresh, Topology.build(2, 1, 2, "fsdp", rank=1)) is None
    assert not optim.state and _published(nodes[0]) == []


# ----- two real processes over gloo ----------------------------------------------------------

def _rank(rank: int, port: int, described: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    try:
        group = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 3))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train = TrainState(DataState(0, 100), world_size=2)
        state = build_state(model, optim, train)
        assert replicated_layout("ddp", model, state) and not replicated_layout("fsdp", model, state)
        assert not replicated_layout("ddp", model.module, state)
        assert not replicated_layout("ddp", model, {**state, "extra.rng": {}})
        tier = MemoryTier.open(described if rank == 0 else "", 0, Place(rank, 2, Wire.of(group, 2)), warn=print)
        if rank == 0:  # rank 0's node trained 5 steps alone earlier (its snapshot, world size 1)
            for i in range(5):
                model.module(torch.full((2, 4), float(i))).sum().backward()
                optim.step()
                optim.zero_grad()
            train.step = 5
            tier.rules = Rules(replicated=True)
            tier.save(5, state)
            tier._last = None  # a new worker process: it knows nothing but its slots
            torch.manual_seed(0)
            model.module.reset_parameters()
            optim.state.clear()
            train.step = 0
        got = tier.restore(state, ddp(2, rank))
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "source": got.source, "step": got.step, "train": train.step,
            "params": [p.tolist() for p in model.parameters()],
            "momentum": [optim.state[p]["momentum_buffer"].tolist() for p in model.parameters()]}))
        tier.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e  # two spawned processes: ~10-25 s
def test_two_processes_a_rank_without_slots_receives_over_gloo(tmp_path):
    host = HostSlots.create(1)
    try:
        mp.start_processes(_rank, args=(free_port(), host.describe(), str(tmp_path)), nprocs=2,
                           start_method="spawn")
        got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        host.close()
    assert [(g["source"], g["step"], g["train"]) for g in got] == [(PEER, 5, 5)] * 2
    assert got[0]["params"] == got[1]["params"] and got[0]["momentum"] == got[1]["momentum"]


# ----- the transfer's pieces ---------------------------------------------------------------

def test_a_snapshot_travels_in_pieces_cut_the_same_way_on_both_sides():
    from elastic_harness.memtier.peer import pieces

    assert pieces(0) == [] and pieces(5, 8) == [(0, 5)] and pieces(16, 8) == [(0, 8), (8, 16)]
    assert pieces(17, 8) == [(0, 8), (8, 16), (16, 17)]


class Posted(Recorder):
    """A wire whose tensor bytes are posted (``post_send``/``post_recv``) and waited for
    later; ``log`` records posts, waits and (patched in) the sender's ``targets``."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.log: list[str] = []

    def wire(self) -> Wire:
        base = super().wire()
        log = self.log

        class Work:
            def __init__(self, name):
                self.name = name

            def wait(self):
                log.append(f"wait {self.name}")

        def post_send(t, dst):
            base.send(t, dst)
            log.append(f"post {t.numel()}")
            return Work(t.numel())

        def post_recv(t, src):
            base.recv(t, src)
            return Work(t.numel())

        return Wire(base.gather, base.send, base.recv, post_send=post_send, post_recv=post_recv)


def test_a_sender_posts_the_bytes_in_pieces_and_takes_its_state_dicts_while_they_move(nodes, monkeypatch):
    state, model, optim = _state()
    saver = MemoryTier(nodes[0], Place(0, 1, Recorder(0, []).wire()), warn=print)
    saver.rules = Rules(replicated=True)
    saver.save(3, state)
    data_len = nodes[0][0].header().data_len
    monkeypatch.setattr("elastic_harness.memtier.peer.CHUNK", 256)  # several pieces of a tiny state
    holder = Posted(0, [encode_offers([]), [0], [0], [0]])
    real = snapshot.targets
    monkeypatch.setattr(snapshot, "targets", lambda s: (holder.log.append("targets"), real(s))[1])
    fresh0, model0, _ = _state(steps=0)
    got0 = MemoryTier(nodes[0], Place(0, 2, holder.wire()), warn=print).restore(fresh0, ddp(2, 0))
    n = -(-data_len // 256)
    assert n > 1 and got0.source == PEER
    # every piece posted, then the sender's own state dicts, then the waits
    assert [e.split()[0] for e in holder.log] == ["post"] * n + ["targets"] + ["wait"] * n
    assert len(holder.sent) == 2 + n  # announcement, skeleton, the pieces
    joiner = Posted(1, [encode_offers([Offer(3, 1, 0, snapshot.capture(state).digest, True)]), [0], [0], [0]],
                    inbox=holder.sent)
    fresh1, model1, _ = _state(steps=0)
    assert MemoryTier(nodes[1], Place(1, 2, joiner.wire()), warn=print).restore(fresh1, ddp(2, 1)).source == PEER
    for a, b, c in zip(model.parameters(), model0.parameters(), model1.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
