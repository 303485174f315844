"""Live process groups (``torchcompat.groups``, ``runtime.generations``): real gloo ranks,
forked from the session's forkserver (``tests.servers.rank_context``: torch imported once,
never a fork of the pytest process and whatever earlier tests left running in it), each
exiting with ``os._exit``."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.runtime import generations
from tests.servers import rank_context

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # real processes: 10-30 s each on 2 cores
TIMEOUT = dt.timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout: float = 90.0, awaited: tuple[int, ...] | None = None,
              port: int | None = None) -> list[int]:
    """``target(rank, world, port, *args)`` in ``world`` processes; their exit codes.
    ``awaited``: the ranks whose end is waited for (the others, frozen or waiting for a peer
    that is gone, are SIGKILLed then)."""
    port = port or free_port()
    ctx = rank_context()
    procs = [ctx.Process(target=_guard, args=(target, r, world, port, *args), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for r in (range(world) if awaited is None else awaited):
            procs[r].join(timeout)
    finally:  # also when pytest-timeout ends the wait: a rank left alive is joined at exit, forever
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    return [p.exitcode for p in procs]


def _guard(target, *args) -> None:
    code = 1
    try:
        target(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - printed, then the exit code says it
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def join(rank: int, world: int, port: int, live: bool) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
    if live:
        generations._CURRENT = None  # a forked child starts its own registry
        generations.install(rank=rank, world_size=world, timeout_s=60).begin(store, "g0")
    dist.init_process_group("harness" if live else "gloo", store=store, rank=rank, world_size=world,
                            timeout=TIMEOUT)
    return store


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 8, generator=g)[4 * rank:4 * (rank + 1)]


def digest(module: nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in module.parameters()]


def _ddp_rank(rank, world, port, live, out):
    join(rank, world, port, live)
    m = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        m(batch(step, rank, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    gathered = torch.zeros(world)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    if rank == 0:
        Path(out).write_text(json.dumps({"params": digest(m), "sum": t.item(), "gathered": gathered.tolist()}))


def test_a_ddp_model_trains_on_live_groups_exactly_as_on_gloo(tmp_path):
    results = {}
    for live in (False, True):
        out = tmp_path / f"{live}.json"
        assert run_ranks(_ddp_rank, 3, live, str(out)) == [0, 0, 0]
        results[live] = json.loads(out.read_text())
    assert results[True] == results[False]
    assert results[True]["sum"] == 3.0 and results[True]["gathered"] == [0.0, 1.0, 2.0]


def _frozen_rank(rank, world, port, out):
    store = join(rank, world, port, True)
    gens = generations.current()
    said = []
    gens.on_broken = said.append
    t = torch.ones(4)
    dist.all_reduce(t)  # everyone is there
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its connections stay open
    work = dist.all_reduce(torch.ones(4), async_op=True)  # blocks on the frozen rank
    lineage = gens.made[0][0]

    def leave_when_pending() -> None:
        with lineage._lock:
            pass
        gens.leave("rank 2 is silent")

    threading.Thread(target=leave_when_pending).start()
    work.wait()
    assert gens.broken == "rank 2 is silent"
    gens.reform(store, rank, 2, "g1")
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    assert gens.broken is None
    Path(f"{out}.{rank}").write_text(json.dumps({"sum": x.tolist(), "world": dist.get_world_size(),
                                                 "said": said}))


def test_leaving_frees_a_collective_blocked_on_a_frozen_peer_and_the_survivors_reform(tmp_path):
    out = tmp_path / "frozen"
    port_codes = run_ranks(_frozen_rank, 3, str(out), timeout=45, awaited=(0, 1))
    assert port_codes[:2] == [0, 0]
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        assert got == {"sum": [3.0, 3.0, 3.0], "world": 2, "said": []}


def _dead_peer_rank(rank, world, port, out):
    join(rank, world, port, True)
    gens = generations.current()
    said = []
    gens.on_broken = said.append
    m = nn.parallel.DistributedDataParallel(model())
    m(batch(0, rank, world)).sum().backward()  # one healthy step
    if rank == 2:
        os._exit(3)
    loss = m(batch(1, rank, world)).pow(2).mean()
    loss.backward()  # the reduction fails on a survivor (or is left): it must not raise
    Path(f"{out}.{rank}").write_text(json.dumps({"broken": gens.broken is not None, "said": len(said)}))
    gens.leave("a peer died")  # what the agent's word does for the survivor still blocked


def test_a_dead_peer_breaks_the_generation_without_raising_in_the_training_code(tmp_path):
    out = tmp_path / "dead"
    codes = run_ranks(_dead_peer_rank, 3, str(out), timeout=45, awaited=(0, 1, 2))
    assert codes[2] == 3
    seen = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1) if Path(f"{out}.{r}").exists()]
    assert seen and all(s["broken"] for s in seen)
    assert all(s["said"] <= 1 for s in seen)


def _train(m, opt, steps, rank, world, first=0):
    for step in range(first, first + steps):
        m(batch(step, rank, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _replaced_rank(rank, world, port, out, reference):
    """Rank 2 dies after step 2; a new process takes its place while ranks 0 and 1 re-form
    in place, on a second store, and build their DDP wrapper again around the same module, as
    the new process builds its own (its construction broadcasts rank 0's state)."""
    join(rank, world, port, True)
    gens = generations.current()
    m = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(m, opt, 2, rank, world)
    if rank == 2:
        os._exit(5)
    dist.all_reduce(torch.ones(1))  # fails on one survivor or is left by the other
    gens.leave("rank 2 died")
    store2 = dist.TCPStore("127.0.0.1", reference["port2"], world, False, timeout=TIMEOUT)
    gens.reform(store2, rank, world, generations.tag_of(reference["port2"]))
    m = nn.parallel.DistributedDataParallel(m.module)
    _train(m, opt, 2, rank, world, first=2)
    Path(f"{out}.{rank}").write_text(json.dumps(digest(m)))


def _new_rank_2(port2, world, out):
    store2 = dist.TCPStore("127.0.0.1", port2, world, True, timeout=TIMEOUT)
    generations._CURRENT = None
    generations.install(rank=2, world_size=world, timeout_s=60).begin(store2, generations.tag_of(port2))
    dist.init_process_group("harness", store=store2, rank=2, world_size=world, timeout=TIMEOUT)
    torch.manual_seed(7)  # not the others' initial weights: DDP's construction brings rank 0's
    m = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(m, opt, 2, 2, world, first=2)
    Path(f"{out}.2").write_text(json.dumps(digest(m)))


def _uninterrupted(rank, world, port, out):
    join(rank, world, port, False)
    m = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train(m, opt, 4, rank, world)
    if rank == 0:
        Path(out).write_text(json.dumps(digest(m)))


def test_survivors_reform_in_place_beside_a_new_process_and_train_on(tmp_path):
    """New workers and survivors of one generation meet under the same keys (``begin`` for
    the new one, ``reform`` for the others); with plain SGD (no optimizer state) the end is
    the uninterrupted run's, bit for bit."""
    ref = tmp_path / "ref.json"
    assert run_ranks(_uninterrupted, 3, str(ref)) == [0, 0, 0]
    port2 = free_port()
    out = tmp_path / "replaced"
    ctx = rank_context()
    newcomer = ctx.Process(target=_guard, args=(_new_rank_2, port2, 3, str(out)))
    newcomer.start()
    codes = run_ranks(_replaced_rank, 3, str(out), {"port2": port2}, awaited=(0, 1, 2), timeout=60)
    newcomer.join(60)
    assert codes == [0, 0, 5] and newcomer.exitcode == 0
    expected = json.loads(ref.read_text())
    assert [json.loads(Path(f"{out}.{r}").read_text()) for r in range(3)] == [expected] * 3
