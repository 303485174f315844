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

``finish`` is what a step calls when its generation broke under it (``Step.batches``, after
this rank's micro-batches): under DDP the survivors finish the step in flight
(``runtime.inflight``): the same re-formation, then this rank's local gradients put back, its
part of the lost ranks' shares as extra micro-batches and one reduction at the new
membership; no restore (every survivor left the step before its optimizer stepped, and holds
the step before it). Where it cannot be done (not DDP, a stream, a communication hook of the
script's own, a survivor ahead or behind, too few lost samples), the step is thrown away and
redone after a restore, said once.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from elastic_harness.launch.env import WorkerEnv
from elastic_harness.runtime import build, inflight, inplace
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.hook import ReplicaCheck, Trained
from elastic_harness.runtime.loop import Samples
from elastic_harness.runtime.resume import go_on
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.topology import Topology
from elastic_harness.torchcompat.groups import repoint_ddp


@dataclass(frozen=True)
class Pending:
    """An HSDP step in flight that the survivors finish once their training function runs again
    (a mesh is built for one membership): what they keep of it through the re-run."""

    step: int  # its number
    kept: dict  # this rank's shard-local gradients of it, by parameter name (``inflight.KeptShards``)
    plan: list  # this rank's own micro-batches of it (positions, dataset indices)
    meta: list | None  # their (index, content hash), when samples are recorded
    old_dp: int  # the step's data-parallel degree
    replicas: int  # the step's replica count
    lost: list  # the data-parallel ranks it lost


@dataclass
class Finishing:
    """A step's end in place: this rank's extra micro-batches and what ends the step."""

    plan: list  # micro-batches of (position, dataset index)
    batches: list  # the same, loaded, on the device
    done: Callable[[Any], Any]  # (the step) -> the step hook of the new generation


class RunInPlace:
    def __init__(self, run: Any) -> None:
        self.run = run  # a ``runtime.session.Run`` with its ``recovery``
        self.kept = inflight.Kept()  # the step's local gradients (DDP: ``register`` hooks them)
        self.cannot_finish = "the model is not registered yet"  # why a step is not finished in place
        self.shards: inflight.KeptShards | None = None  # HSDP with replicas: the shard-local gradients
        self._finishing = -1  # the step being finished after a re-run (a fault in it: redone)
        self._said: set[str] = set()
        run._loop.in_place(lambda: run.recovery.broken() is not None, self.recover,
                           joinable=run.drain.take_join, opening=self.opening)

    def registered(self, model: Any) -> None:
        """``run.register``: keep the model's local gradients each step, where the step in flight
        can be finished (DDP; HSDP with more than one replica); else say once, at the first
        fault, why it is redone."""
        top = self.run.topology
        if top.kind != "ddp":
            self.shards = self._shards(model) if self.run.spec.finish_hsdp_step else None
            self.cannot_finish = "" if self.shards is not None else self._why_shards(top)
            if self.shards is not None:
                self.run.recovery.holding = self.shards.holding
                self.shards.on_begin = self.run.recovery.late_for_word
            return
        self.cannot_finish = inflight.install(model, self.kept, lambda: dist.group.WORLD) or ""

    def _why_shards(self, top: Any) -> str:
        """Pure: why a sharded layout's step in flight is redone."""
        if top.kind == "mesh" and top.replicate > 1 and not self.run.spec.finish_hsdp_step:
            return ("HSDP finishes it only with finish_hsdp_step: true (its replica all-reduce then waits "
                    "for the step's end; docs/in-place.md)")
        return f"a {top.kind} layout's lost shards went with the node"

    def _shards(self, model: Any) -> inflight.KeptShards | None:
        """HSDP (FSDP2 over a mesh with replicas, no tensor parallelism: the shard group is the
        node): the replica all-reduce deferred to each step's end, the shard-local gradients
        kept before it; None for any other layout or model (a tensor group's collectives would
        need the same care: not built)."""
        from torch.distributed.fsdp import FSDPModule

        from elastic_harness.torchcompat.nn import unwrap_compiled

        top, mesh = self.run.topology, self.run.mesh
        if top.kind != "mesh" or top.replicate < 2 or top.tensor > 1 or mesh is None \
                or not isinstance(unwrap_compiled(model), FSDPModule):
            return None
        return inflight.KeptShards(mesh["dp_replicate"].get_group(), mesh["dp_shard"].get_group()).install()

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
        recovery = run.recovery
        kept = self._kept(joining=recovery.broken() is None)
        run.parts.watchdog.disarm()  # parked: no step is due
        env, hand = recovery.reform(recovery.park(run.step, kept), run.spec)
        if inplace.how(hand, run.spec.parallelism) == inplace.RERUN:
            raise inplace.Rerun()
        self.repoint(env, hand)

    def _kept(self, joining: bool) -> int | None:
        """The step this rank holds in memory for the next generation: a broken generation's
        is the step the tier was armed with (published now); a drain for a joining node (nothing
        broke) took its snapshot at the drained step, which must not be rolled back from."""
        run, memory = self.run, self.run.parts.memory
        if memory is None:
            return run._kept
        if joining:
            memory.disarm()
            return run.step if memory.newest == run.step else None
        return memory.keep_armed() if run._kept is None else run._kept

    def finish(self, step: Any) -> Finishing | None:
        """The generation broke under ``step`` (after this rank's micro-batches): park and
        re-form, then finish the step in place, or throw it away to be redone (None). HSDP:
        ``_finish_replicas``."""
        if self.shards is not None:
            return self._finish_replicas(step)
        run = self.run
        recovery = run.recovery
        kept = self._kept(joining=False)
        run.parts.watchdog.disarm()
        loader = run._loop.loader
        why = self._why_not(step)
        old = (run.topology.dp_rank(), run.topology.dp_degree)
        env, hand = recovery.reform(recovery.park(run.step, kept), run.spec, old_dp=old,
                                    finishing=-1 if why else step.number)
        reformed = time.monotonic()
        if inplace.how(hand, run.spec.parallelism) == inplace.RERUN:
            if why:
                self._say(f"step {step.number} is redone after a restore: {why}")
            raise inplace.Rerun()
        plan = None if why or not hand.finishes(step.number) else self._extra(loader, hand, old[1], env)
        why = why or ("" if plan is not None else "not every survivor holds the step's local gradients, "
                      "or the lost shares have fewer samples than there are survivors")
        self.repoint(env, hand, restore=bool(why))
        if why or not self.kept.restore(run._trained.model):
            self._say(f"step {step.number} is redone after a restore: {why or 'a gradient was not kept'}")
            step.thrown = True
            return None
        batches, meta = loader.fetch(plan)
        ready = (reformed, time.monotonic())
        return Finishing(plan, batches, lambda st: self._finished(st, plan, meta, old, hand, ready))

    def _why_not(self, step: Any) -> str:
        """Why this rank cannot finish ``step`` in place, whatever the others hold; "" if it can."""
        if step.number == self._finishing:
            return "a fault came while it was being finished"
        if self.cannot_finish:
            return self.cannot_finish
        if getattr(self.run._loop.loader, "order", None) is None:
            return "a stream's samples are read in order, not by position"
        return ""

    def _finish_replicas(self, step: Any) -> None:
        """HSDP: the generation broke under ``step``. Park and re-form; where every survivor
        holds its shard-local gradients of the step and the step before it in memory, and whole
        replicas were lost, keep what finishing needs (``Pending``) for the training function,
        which runs again (its mesh is built for the new membership): it restores the step
        before and starts with ``opening``. Else the step is redone after the restore."""
        run, recovery, shards = self.run, self.run.recovery, self.shards
        kept = self._kept(joining=False)
        run.parts.watchdog.disarm()
        why = self._why_not(step)
        if not why and (shards.kept is None or shards.step != step.number):
            why = "a collective of the step within a node was left, so its shard-local gradients are not whole"
        if not why and step.number - 1 not in (kept, self._newest()):
            kept = self._keep_now()
        if not why and step.number - 1 not in (kept, self._newest()):
            why = "the step before it is not kept in memory"
        old = (run.topology.dp_rank(), run.topology.dp_degree)
        env, hand = recovery.reform(recovery.park(run.step, kept), run.spec, old_dp=old,
                                    finishing=-1 if why else step.number)
        lost = sorted(set(range(old[1])) - {r for r, _ in hand.old_dp})
        why = why or self._replicas_lost(hand, step.number, lost, env)
        if why:
            self._say(f"step {step.number} is redone after a restore: {why}")
        else:
            recovery.pending = Pending(step.number, shards.kept, list(step.plan), run._loop.loader.meta, old[1],
                                       run.topology.replicate, lost)
        raise inplace.Rerun()

    def _newest(self) -> int | None:
        memory = self.run.parts.memory
        return memory.newest if memory is not None else None

    def _keep_now(self) -> int | None:
        """Publish the state as it is (the step before the one in flight: the optimizer did not
        step) in this rank's memory, where the cadence had not armed it (arming every step costs
        more than its budget share); the step kept, or None (no tier, or it failed)."""
        run = self.run
        memory = run.parts.memory
        if memory is None or run._trained is None:
            return None
        memory.arm(run.step, run._trained.state)
        return memory.keep_armed()

    def _replicas_lost(self, hand: inplace.Handshake, step: int, lost: list[int], env: WorkerEnv) -> str:
        """Pure over what every rank agreed: why the survivors cannot finish ``step`` across
        replicas, or "": every rank a survivor that would finish it, only whole replicas lost,
        and each survivor at the same shard coordinate (its kept gradients are that shard's)."""
        old, shard = self.run.topology, self.run.topology.shard
        new = Topology.from_env(env, self.run.spec.parallelism)
        if hand.newcomers or not hand.finishes(step):
            return "not every survivor holds the step's shard-local gradients and the step before it"
        gone = {d // shard for d in lost}
        if set(lost) != {d for d in range(old.dp_degree) if d // shard in gone} or (new.shard, new.tensor) != (
                shard, old.tensor):
            return "the lost ranks are not whole replicas"
        if any(r % shard != new.dp_rank(i) % shard for i, (r, _) in enumerate(hand.old_dp)):
            return "a survivor's shard moved"
        return ""

    def opening(self, hook: Any, loader: Any) -> Step | None:
        """The loop's first step after the training function ran again to finish an HSDP step
        (``Pending``): that step, with this rank's part of the lost replicas' share as its
        micro-batches (``inflight.extra_plan`` at the new membership); ``_completed`` ends it.
        None when nothing is pending, or (said) the step before it was not what was restored."""
        run = self.run
        pending, run.recovery.pending = run.recovery.pending, None
        if pending is None:
            return None
        spec, top, plan = run.spec, run.topology, None
        if run.step == pending.step - 1 and getattr(loader, "order", None) is not None:
            plan = inflight.extra_plan(loader.order, run._train.data.cursor, spec.train.global_batch_size,
                                       pending.old_dp, pending.lost, top.dp_degree, top.dp_rank(),
                                       spec.train.micro_batch_size)
        if plan is None:
            self._say(f"step {pending.step} is redone after a restore: the step before it was not the one "
                      "restored, or the lost share has fewer samples than there are survivors")
            return None
        batches, meta = loader.fetch(plan)
        step = Step(hook, pending.step, plan, batches)
        step.completing = lambda: self._completed(step, pending, plan, meta)
        step.reformed = True  # the loop binds its data again after it (``Loop._after``)
        self._finishing = pending.step
        return step

    def _completed(self, step: Step, pending: Pending, plan: list, meta: list | None) -> None:
        """The extra micro-batches reduced at the new membership: add the kept shard-local
        gradients over the surviving replicas (``inflight.reduce_kept``), record the step's
        samples, say it. A fault meanwhile: the step hook throws the step away."""
        run = self.run
        if run.recovery.force("finish"):
            os._exit(inplace.REFORM_FAILED_EXIT)  # a second fault while the step is being finished
        inflight.reduce_kept(run._trained.model, pending.kept, run.mesh["dp_replicate"].get_group(),
                             pending.replicas)
        # One replica left: its replica group is this rank alone, so a shard peer that failed
        # while finishing is seen only by a collective of the whole generation.
        dist.barrier()
        if run.recovery.broken() is not None:
            return
        samples = Samples.of(run.spec, run.run_dir, run.gen.id, run.topology)
        if samples is not None:
            merged = Step(step.hook, step.number, [*pending.plan, *plan], [])
            samples.record(merged, (pending.meta + meta) if pending.meta is not None and meta is not None else None)
        self._said_finished(step.number, pending.lost, sum(len(c) for c in plan))

    def _said_finished(self, number: int, lost: list[int], extra: int, phases: dict | None = None) -> None:
        run = self.run
        run.gen.events.emit("finished", step=number, lost_dp_ranks=lost, world_size=run.world_size,
                            extra_samples=extra, phases_s=phases or {},
                            message=f"step {number} finished without data-parallel rank(s) {lost}: the "
                                    f"{run.world_size} survivor(s) computed their shares as extra micro-batches")

    def _extra(self, loader: Any, hand: inplace.Handshake, old_dp: int, env: WorkerEnv) -> list | None:
        """This survivor's part of the lost shares of the step in flight (``inflight.extra_plan``)."""
        spec, run = self.run.spec, self.run
        lost = sorted(set(range(old_dp)) - {r for r, _ in hand.old_dp})
        return inflight.extra_plan(loader.order, run._train.data.cursor, spec.train.global_batch_size, old_dp,
                                   lost, env.world_size, env.rank, spec.train.micro_batch_size)

    def _finished(self, step: Any, plan: list, meta: list | None, old: tuple[int, int],
                  hand: inplace.Handshake, ready: tuple[float, float]) -> Any:
        """The extra micro-batches' backward done: reduce at the new membership (divided by
        the step's own data-parallel degree), record the step's samples in this generation,
        say it with its phases (``ready``: when this rank had re-formed, and when its extra
        micro-batches were loaded); the new generation's step hook."""
        run, began = self.run, time.monotonic()
        if run.recovery.force("finish"):
            os._exit(inplace.REFORM_FAILED_EXIT)  # a second fault while the step is being finished
        inflight.reduce(run._trained.model, dist.group.WORLD, old[1])
        hook = build.step_hook(run.spec, run.env, run.run_dir, run.gen, run.parts, run._trained, run.drain,
                               in_place=self)
        if run.recovery.broken() is not None:  # the reduction failed: the update is not the step's
            self._say(f"step {step.number} is redone after a restore: a fault came while it was being finished")
            step.thrown = True
            return hook
        loader = run._loop.loader
        samples = Samples.of(run.spec, run.run_dir, run.gen.id, run.topology)
        if samples is not None:
            own = loader.meta or []
            merged = Step(step.hook, step.number, [*step.plan, *plan], [])
            samples.record(merged, (own + meta) if meta is not None else None)
        lost = sorted(set(range(old[1])) - {r for r, _ in hand.old_dp})
        self._said_finished(step.number, lost, sum(len(c) for c in plan),
                            finish_phases(*ready, began, time.monotonic()))
        return hook

    def _say(self, line: str) -> None:
        """One warning per reason (rank 0 narrates)."""
        key = line.split(": ", 1)[-1]
        if key not in self._said:
            self._said.add(key)
            self.run.gen.events.emit("warning", message=line)

    def repoint(self, env: WorkerEnv, hand: inplace.Handshake, restore: bool = True) -> None:
        """Every member of the new generation is a survivor and the layout is DDP: the same
        objects go on (the model pointed at the resized default group, its reducer reset);
        what a generation builds is built for it; the loop then resumes from memory and binds
        the data at the new split (``restore``; without it the state stays as it is: a step
        finished in place)."""
        run = self.run
        old = run.parts
        run.env, topology = env, Topology.from_env(env, run.spec.parallelism)
        run.gen = build.join(run.spec, env, run.groups, run.run_dir, topology, 0.0, agreed=hand)
        run.topology, run.rank, run.world_size = topology, topology.rank, topology.world_size
        for close in (old.ckpt.saver.close, old.metrics.close, old.memory.close if old.memory is not None else None):
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
        run._resumed, run._kept = not restore, None
        if not restore and trained is not None:
            go_on(trained.state, trained.model, topology=topology, memory=run.parts.memory)
        run._loop.rebind(run.parts.watchdog, run.parts.cadence, run.rank)


def finish_phases(reformed: float, ready: float, began: float, done: float) -> dict[str, float]:
    """Pure: the ``finished`` event's phases (monotonic seconds): ``repoint`` from the
    re-formation until the extra micro-batches were loaded (the run's parts re-pointed, the
    local gradients put back), ``extra`` their forward and backward, ``reduce`` the reduction
    at the new membership and the new step hook."""
    return {"repoint": round(ready - reformed, 4), "extra": round(began - ready, 4), "reduce": round(done - began, 4)}
