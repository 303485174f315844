"""Where a worker generation starts from, and whether the data it is given can continue it.

``restore`` (collective, every rank): the newest snapshot in the agents' memory (own slot,
or, under DDP or across a mesh's replicas, received from a peer: ``memtier``), else the
newest complete, verified checkpoint through DCP (resharded to this world size), else
nothing (a fresh start).
``announce`` checks what was restored against the job and says so (the ``resume`` event,
the metrics' restart mark); it returns the step to continue from.

``bind_data`` then checks the restored data position against the data the script gives
(``check_data``: the same seed, dataset size, stream shard list and order settings), or
starts it, and builds the loader that reads each step's share from that position.

Everything comes in as arguments: the state, the tiers, the rank and world size, the
event log; nothing is read from a ``Run``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from elastic_harness.checkpoint.restorer import Loaded, Restorer
from elastic_harness.data.epochs import unresolved_epochs
from elastic_harness.data.sampler import DataState, EpochOrder
from elastic_harness.data.stream import Stream
from elastic_harness.errors import CheckpointError
from elastic_harness.memtier.peer import portable, restore_rules
from elastic_harness.memtier.restore import Restored, restored_message
from elastic_harness.memtier.tier import MemoryTier
from elastic_harness.runtime.loader import (
    LoaderSettings,
    StepLoader,
    StreamLoader,
    planner,
    stream_planner,
)
from elastic_harness.runtime.metrics import Metrics
from elastic_harness.runtime.state import TrainState
from elastic_harness.runtime.stream_index import Counting, bind_stream
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec


def restore(state: dict[str, Any], model: nn.Module | None, *, topology: Topology,
            memory: MemoryTier | None, ckpt: Restorer) -> Restored | Loaded | None:
    """Every rank: fill ``state`` from memory, else from storage; what restored it, or None.
    The memory tier reads the layout itself (``memtier.peer.restore_rules``)."""
    ckpt.join()  # every generation enters the fence, whichever tier restores it
    if memory is not None:
        restored = memory.restore(state, topology, portable=portable(topology, model, state),
                                  durable=ckpt.newest_complete)
        if restored is not None:
            return restored
    return ckpt.restore(state)


def go_on(state: dict[str, Any], model: nn.Module | None, *, topology: Topology,
          memory: MemoryTier | None) -> None:
    """Every rank of a generation whose state is already the job's (a step finished in place
    by the same processes): what ``restore`` would set up besides filling the state (the
    memory tier's rules for the snapshots it takes from now on). Such a generation enters the
    checkpoint fence at its first save (``Saver.save``), not here: the fence's
    write, its two fsyncs and collectives are then off the healthy ranks' path from the step
    in flight to the next."""
    if memory is not None:  # only a replicated layout finishes a step in place: no buddy link
        memory.rules = restore_rules(topology, memory.world_size, portable(topology, model, state))


def memory_covers_join(memory: MemoryTier | None, model: nn.Module | None, state: dict[str, Any], *,
                       topology: Topology) -> bool:
    """Can a generation that drains only because a node joins leave its state in memory
    alone (a forced snapshot, no storage write)? With the tier on and a layout that
    ``restore`` rebuilds from the old ranks' snapshots at any world size: replicated (DDP,
    the joiner receives it from a peer), 1-D FSDP (every old rank's own snapshot is still
    held: resharded in memory) or a mesh (HSDP/TP: a join changes only the replicate degree,
    and the joiner's ranks receive their coordinate's snapshot from a replica): every layout, when its state is ``portable``. Anything else (the tier off, a
    script's per-rank entries, a bare model under ddp) saves the drain to storage."""
    return memory is not None and portable(topology, model, state)


def memory_covers_failure(memory: MemoryTier | None, model: nn.Module | None, world_size: int,
                          on_failure: bool) -> bool:
    """Can a failing rank keep the step it last completed (``MemoryTier.arm``/``keep_armed``,
    ``checkpoint.memory_on_failure``)? Where another rank survives to keep it (world size
    above 1), the restored layout is replicated (DDP: any rank's snapshot restores every
    rank; ``peer.restore_rules``) and the state changes only in the optimizer's step, which
    disarms it: a model without persistent buffers (BatchNorm's running statistics change
    in every forward pass)."""
    if not on_failure or memory is None or model is None or world_size < 2 or not memory.rules.replicated:
        return False
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return all(name in params for name in model.state_dict(keep_vars=True))


def announce(found: Restored | Loaded | None, train: TrainState, *, seed: int, events: Any,
             metrics: Metrics, world_size: int, before_saying: Callable[[], None] | None = None) -> int:
    """Check a restore from storage against the job, run ``before_saying`` (binding the data:
    its refusal comes before any "resumed from"), then say where this generation starts
    (``resume`` event); the step it continues from."""
    if found is not None and not isinstance(found, Restored):
        # Before saying "resumed": a checkpoint of another data stream is refused first.
        reason = train.check_matches(seed, None)
        if reason:
            raise CheckpointError(f"the checkpoint at step {train.step} cannot continue this "
                                  f"job: {reason}", "use a new --run-dir or --fresh")
    if before_saying is not None:
        before_saying()
    if found is None:
        events.emit("resume", fresh=True, step=0, world_size=world_size)
        return 0
    if isinstance(found, Restored):
        return _from_memory(found, train, events=events, metrics=metrics, world_size=world_size)
    metrics.resumed_at(found.step)
    events.emit(
        "resume", step=found.step, source="storage", checkpoint=found.name,
        saved_world_size=train.saved_world_size,
        world_size=world_size, load_s=round(found.seconds, 4), samples=train.data.cursor,
        message=f"resumed from step {found.step}, saved at world size {train.saved_world_size}, "
        f"now {world_size}, load took {found.seconds:.2f} s",
    )
    return found.step


def _from_memory(restored: Restored, train: TrainState, *, events: Any, metrics: Metrics,
                 world_size: int) -> int:
    metrics.resumed_at(restored.step)
    saved = train.saved_world_size
    events.emit(
        "resume", step=restored.step, source=restored.source, saved_world_size=saved,
        world_size=world_size, load_s=round(restored.seconds, 4), samples=train.data.cursor,
        senders=list(restored.senders), receivers=restored.receivers, phases_s=dict(restored.phases),
        message=restored_message(restored, saved, world_size),
    )
    return restored.step


def bind_data(source: Any, train: TrainState, spec: JobSpec, topology: Topology,
              settings: LoaderSettings, *, group: Any, cache_dir: Path,
              on_progress: Callable[[], None]) -> StepLoader | StreamLoader:
    """Check the saved position against the data (or start it) and build the loader.

    Each step's share is the data-parallel rank's (``topology.dp_rank()`` of
    ``topology.dp_degree``); the processes of ``group`` (all of them) share the counting of a
    stream's shards."""
    g, mb = spec.train.global_batch_size, spec.train.micro_batch_size
    dp_size, dp_rank = topology.dp_degree, topology.dp_rank()
    if isinstance(source, Stream):
        counting = Counting(topology.rank, topology.world_size, group, cache_dir, on_progress)
        order, digests = bind_stream(source, counting, seed=spec.train.seed, global_batch=g, dp_size=dp_size)
        _refuse_unresolved_epochs(spec, order.n)
        check_data(train, spec.train.seed, order.n, *digests)
        plan_of = stream_planner(order, train.data.cursor, train.step, g, dp_size, dp_rank, mb)
        return StreamLoader(source, order, plan_of, train.step, spec.train.steps,
                            dp_size=dp_size, settings=settings)
    _refuse_unresolved_epochs(spec, len(source))
    check_data(train, spec.train.seed, len(source), 0, 0)
    order = EpochOrder(spec.train.seed, len(source))
    plan_of = planner(order, train.data.cursor, train.step, g, dp_size, dp_rank, mb)
    loader = StepLoader(source, plan_of, train.step, spec.train.steps, settings)
    loader.order = order  # the step in flight's extra samples are read from it (``runtime.inflight``)
    return loader


def _refuse_unresolved_epochs(spec: JobSpec, n: int) -> None:
    """``run``/``submit`` resolve ``train.epochs`` into steps; a bare ``eh.init(spec)`` did not."""
    if spec.train.epochs:
        raise unresolved_epochs(spec.train.epochs, n, spec.train.global_batch_size)


def check_data(train: TrainState, seed: int, n: int, stream: int, order_digest: int) -> None:
    """A fresh position starts on this data; a restored one must name the same data."""
    if train.data.dataset_size == 0:  # fresh: nothing was loaded
        train.data = DataState(seed, n)
        train.stream, train.order_digest = stream, order_digest
        return
    reason = train.check_matches(seed, n, stream, order_digest)
    if reason:
        raise CheckpointError(f"the checkpoint at step {train.step} cannot continue this "
                              f"job: {reason}", "use a new --run-dir or --fresh (or restore "
                              "the data as it was)")
