"""What one generation of workers builds, in one place: the script API's collaborators.

``Run`` (``runtime.session``) is the script's contract: register, resume, steps, evaluate,
close. What it works with is built here, in the order the ranks need it (every rank calls
these in the same order: building the mesh and agreeing on the generation are collective):

1. ``join``: the generation itself: the process groups (made by ``runtime.dist``), the
   handshake (one all-gather: a fresh generation id from rank 0, every rank's pid and
   whether it is new to the job, ``runtime.inplace``; before the mesh, as a survivor
   re-forming in place shakes before it builds anything), the parallel layout and its
   ``DeviceMesh``, the event log (rank 0 narrates) and its first events (``worker``,
   ``rendezvous``);
2. ``equip``: what the steps use: the metrics, the step watchdog, the storage checkpoints,
   the in-memory tier and its cadence;
3. ``step_hook``: once the script registered its objects and the loop starts, what every
   ``step.done()`` runs (``runtime.hook``), from the parts above.

The line between a generation and a process runs here: a ``Generation`` and its ``Parts``
belong to one membership of the job (its ranks, groups, mesh, id), while the process keeps
what the script made (the model, the optimizer, what it registered) and its own (the spec,
the run directory, the drain, the run directory's lock). A worker builds one generation in
its life today; re-forming the groups in place would build the next one here and hand it the
same objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_harness import jobkey, runfiles
from elastic_harness.checkpoint.collective import Ranks
from elastic_harness.checkpoint.manager import Checkpoints
from elastic_harness.checkpoint.progress import Ticker
from elastic_harness.checkpoint.site import Site
from elastic_harness.checkpoint.storage import open_storage
from elastic_harness.checkpoint.where import checkpoint_root
from elastic_harness.events import EventLog
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.conduit import local_address
from elastic_harness.memtier.peer import Wire
from elastic_harness.memtier.tier import MemoryTier, Place
from elastic_harness.runtime import dist as hdist
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.hook import Keeping, Reporting, Signals, StepHook, Trained
from elastic_harness.runtime.inplace import Handshake, how, shake
from elastic_harness.runtime.mesh import build_mesh
from elastic_harness.runtime.metrics import Metrics
from elastic_harness.runtime.resume import memory_covers_failure, memory_covers_join
from elastic_harness.runtime.state import TrainState
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec


class NullLog:
    """The event log of a rank that does not narrate."""

    def emit(self, event: str, **fields: Any) -> dict:
        return {}


@dataclass(frozen=True)
class Generation:
    """One membership of the job, as this process sees it."""

    groups: hdist.Groups  # the training group and the checkpoints' own gloo group
    topology: Topology  # who this process is: rank, world size, the data-parallel split
    mesh: Any  # a mesh layout's DeviceMesh, built on every rank; None for DDP and FSDP
    id: str  # 12 hex digits, the same on every rank (audits, the memory tier's snapshots)
    log: EventLog  # every rank may report a failure
    events: Any  # rank 0 narrates: the log there, a ``NullLog`` elsewhere
    shake: Handshake | None = None  # every rank's pid, and which are new (in-place recovery)


@dataclass(frozen=True)
class Parts:
    """What the steps of a generation use, besides the script's own objects."""

    metrics: Metrics
    watchdog: ProgressWatchdog  # re-armed every step, and by checkpoint I/O while bytes move
    ckpt: Checkpoints  # the storage checkpoints' parts: the hook saves, the resume loads
    memory: MemoryTier | None  # None: not under our agent, or ``checkpoint.memory_every`` 0
    cadence: Cadence  # when the next in-memory snapshot is due


def join(spec: JobSpec, env: WorkerEnv, groups: hdist.Groups, run_dir: Path, topology: Topology,
         pg_init_s: float, agreed: Handshake | None = None) -> Generation:
    """Collective: this process's generation over ``groups``; its first events said.
    ``agreed``: the handshake a survivor made while re-forming (its rerun does not shake again)."""
    hand = agreed or shake(groups.ckpt, topology.rank, topology.world_size, new=True)
    mesh = build_mesh(topology, groups.device.type) if topology.kind == "mesh" else None
    log = EventLog(run_dir / runfiles.EVENTS)
    events = log if topology.rank == 0 else NullLog()
    gen = Generation(groups, topology, mesh, hand.id, log, events, hand)
    _announce(spec, gen, env, run_dir, pg_init_s)
    return gen


def _announce(spec: JobSpec, gen: Generation, env: WorkerEnv, run_dir: Path, pg_init_s: float) -> None:
    top = gen.topology
    gen.log.emit("worker", rank=top.rank, local_rank=env.local_rank, group_rank=env.group_rank,
                 node=env.node, restart=env.restart_count, world_size=top.world_size)
    if not env.by_harness and env.restart_count == 0:
        gen.events.emit("start", who="script", nodes=top.nodes, nproc_per_node=top.nproc_per_node,
                        run_id=env.run_id, run_dir=str(run_dir))
    gen.events.emit("rendezvous", generation=gen.id, world_size=top.world_size,
                    restart=env.restart_count, nodes=top.nodes, pg_init_s=round(pg_init_s, 3))
    hand = gen.shake
    if hand is not None and hand.kept:  # some ranks came with the process they had (in place)
        gen.events.emit("recovery", generation=gen.id, mode=how(hand, spec.parallelism), kept=list(hand.kept),
                        new=[pid for pid, new in zip(hand.pids, hand.new, strict=True) if new],
                        world_size=top.world_size)


def equip(spec: JobSpec, env: WorkerEnv, gen: Generation, run_dir: Path) -> Parts:
    """The metrics, the step watchdog (one per process: the loop re-arms it every step, and
    checkpoint I/O while bytes move: a big save or load is slow, not stuck), the storage
    checkpoints and the in-memory tier, signed and sealed with the job's key."""
    metrics = Metrics(gen.events, run_dir, tensorboard=spec.metrics.tensorboard, main=gen.topology.rank == 0)
    watchdog = ProgressWatchdog(env.timer_file, spec.timeouts.step, renew_s=spec.timeouts.process_group)
    key = jobkey.read(jobkey.key_path(run_dir, {jobkey.KEY_FILE_VAR: env.key_file}))
    ckpt = _checkpoints(spec, run_dir, gen, watchdog, key)
    memory = _memory_tier(spec, env, gen, key)
    cadence = Cadence(spec.checkpoint.memory_every, spec.checkpoint.memory_budget, spec.checkpoint.memory_probe)
    return Parts(metrics, watchdog, ckpt, memory, cadence)


def _checkpoints(spec: JobSpec, run_dir: Path, gen: Generation, watchdog: ProgressWatchdog,
                 key: bytes) -> Checkpoints:
    """The job's storage checkpoints, every rank's part in them (DCP over the checkpoint
    group); checkpoint I/O re-arms the step watchdog while bytes move."""
    site = Site(open_storage(checkpoint_root(spec.checkpoint.dir, run_dir)),
                Ranks(gen.topology.rank, gen.topology.world_size, gen.groups.ckpt), gen.events,
                {"task": job_identity(spec), "parallelism": spec.parallelism, "job": spec.name},
                key=key, ticker=Ticker(watchdog.renew))
    return Checkpoints.build(site, spec.checkpoint, optional_keys=TrainState.OPTIONAL_KEYS)


def _memory_tier(spec: JobSpec, env: WorkerEnv, gen: Generation, key: bytes) -> MemoryTier | None:
    """The in-memory tier when our agent runs this worker and the job wants it. The same on
    every rank (restoring is collective): a rank whose slots cannot be opened has none.

    Its rank and world size are processes, not data-parallel ones: every process holds its
    own slots and takes part in the restore's collectives on the checkpoint group, and a
    snapshot names the process that wrote it (a tensor-parallel rank's state is its own)."""
    if not (env.by_harness and spec.checkpoint.memory_every > 0):
        return None
    top, log = gen.topology, gen.log
    place = Place(top.rank, top.world_size, Wire.of(gen.groups.ckpt, top.world_size), int(gen.id, 16))
    return MemoryTier.open(env.memory, env.local_rank, place,
                           warn=lambda message: log.emit("warning", message=message),
                           local_size=env.local_world_size,
                           link_key=key if spec.checkpoint.memory_buddy else None,
                           link_host=local_address(env.master_addr))


def step_hook(spec: JobSpec, env: WorkerEnv, run_dir: Path, gen: Generation, parts: Parts, trained: Trained,
              drain: Any, in_place: Any = None) -> StepHook:
    """What every ``step.done()`` runs (``runtime.hook``): the generation's parts, the
    script's registered objects, the drain's requests and the job's scheduled faults;
    ``in_place`` (the run's ``runtime.repoint.RunInPlace``, or None): how a step in flight is
    finished, and HSDP's replica all-reduce deferred to a step's end."""
    top = gen.topology
    faults = WorkerFaults(spec.chaos, rank=top.rank, node=env.node, local_rank=env.local_rank,
                          marker_dir=run_dir / runfiles.CHAOS, events=gen.log, agent=env.agent_pid or os.getppid())
    covered = memory_covers_join(parts.memory, trained.model, trained.state, topology=top)
    on_failure = memory_covers_failure(parts.memory, trained.model, top.world_size,
                                       spec.checkpoint.memory_on_failure)
    return StepHook(
        spec, top, trained,
        Keeping(parts.ckpt.saver, parts.memory, parts.cadence, join_in_memory=covered, on_failure=on_failure),
        Signals(lambda: drain.requested, lambda: drain.stop, parts.watchdog, faults,
                broken=_broken(), in_flight=in_place.finish if in_place is not None else (lambda step: None),
                replicas=in_place.shards if in_place is not None else None),
        Reporting(gen.events, parts.metrics, env.restart_count))


def _broken() -> Any:
    """Why this process's live groups cannot go on (in-place recovery), as the step hook asks."""
    from elastic_harness.runtime import generations

    live = generations.current()
    if live is None:
        return lambda: None
    return lambda: live.broken


def job_identity(spec: JobSpec) -> str:
    """What a checkpoint records as its producer: the task target, or the script's name."""
    return spec.task.target or f"script:{Path(spec.script.path).name}"
