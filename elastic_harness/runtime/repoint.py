"""A ``Run`` through an in-place fault (``runtime.inplace``): its part of the recovery.

``RunInPlace`` is the run's side of a fault recovered in place. ``recover`` is what its loop
calls when the generation broke (``runtime.loop``): keep the step the memory tier was armed
with, park, take the next place, then ``repoint`` the run at the new generation (every
member a survivor, DDP) or raise ``Rerun`` (the training function runs again in this process).
``reruns`` tells the run's ``close`` that a rerun is on its way (the groups then stay).

``repoint`` keeps what the process owns (the model, the optimizer, what the script
registered, the drain, the run directory's lock) and builds what a generation builds
(``runtime.build``: its layout, events, checkpoints, memory tier, metrics, watchdog), as a
new worker of the generation builds them; the loop then resumes from memory.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from elastic_harness.launch.env import WorkerEnv
from elastic_harness.runtime import build, inplace
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.hook import ReplicaCheck, Trained
from elastic_harness.runtime.topology import Topology
from elastic_harness.torchcompat.groups import repoint_ddp


class RunInPlace:
    def __init__(self, run: Any) -> None:
        self.run = run  # a ``runtime.session.Run`` with its ``recovery``

    def reruns(self) -> bool:
        """Is the run closing because its training function runs again in this process (a
        ``Rerun`` on its way, or an exception while its generation is broken)? Then the
        groups stay: the re-formation made them for the next generation."""
        exc, recovery = sys.exc_info()[1], self.run.recovery
        return isinstance(exc, inplace.Rerun) or (isinstance(exc, Exception) and recovery.broken() is not None)

    def recover(self) -> None:
        """The generation broke under the loop: keep the step the tier was armed with, park,
        take the next place; then re-point the run at it, or unwind the training function to
        run it again (``Rerun``)."""
        run = self.run
        recovery, memory = run.recovery, run.parts.memory
        kept = memory.keep_armed() if memory is not None and run._kept is None else run._kept
        run.parts.watchdog.disarm()  # parked: no step is due
        env, hand = recovery.reform(recovery.park(run.step, kept), run.spec)
        if inplace.how(hand, run.spec.parallelism) == inplace.RERUN:
            raise inplace.Rerun()
        self.repoint(env, hand)

    def repoint(self, env: WorkerEnv, hand: inplace.Handshake) -> None:
        """Every member of the new generation is a survivor and the layout is DDP: the same
        objects go on (the model pointed at the resized default group, its reducer reset);
        what a generation builds is built for it; the loop then resumes from memory and binds
        the data at the new split."""
        run = self.run
        old = run.parts
        run.env, topology = env, Topology.from_env(env, run.spec.parallelism)
        run.gen = build.join(run.spec, env, run.groups, run.run_dir, topology, 0.0, agreed=hand)
        run.topology, run.rank, run.world_size = topology, topology.rank, topology.world_size
        for close in (old.ckpt.close, old.metrics.close, old.memory.close if old.memory is not None else None):
            if close is not None:
                close()
        run.parts = build.equip(run.spec, env, run.gen, run.run_dir)
        trained = run._trained
        if trained is not None:
            repoint_ddp(trained.model, dist.group.WORLD)
            replicas = (ReplicaCheck(trained.model, run.groups.ckpt, run.world_size)
                        if trained.replicas is not None else None)
            run._trained = Trained(trained.state, trained.train, trained.model, trained.optimizer, trained.scaler,
                                   BufferSync.of(trained.model, topology.dp_degree), replicas)
        run._resumed, run._kept = False, None
        run._loop.rebind(run.parts.watchdog, run.parts.cadence, run.rank)
