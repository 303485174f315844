"""Worker entry, one process per rank: build, resume, loop, close.

Started by the elastic agent through ``runtime.entry`` (``python -m elastic_harness.runtime.entry
JOB RUN_DIR``).
It reads the agent's environment once (``WorkerEnv``) and passes plain values down.
Errors cross to the agent through torchelastic's ``@record`` error file; a mistake the user
must fix (``HarnessError``) is also logged as a ``fatal`` failure event so the host stops
restarting and prints it as one line.
"""

from __future__ import annotations

import hashlib
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_harness.checkpoint.manager import CheckpointManager
from elastic_harness.checkpoint.storage import open_storage
from elastic_harness.checkpoint.where import checkpoint_root
from elastic_harness.data.sampler import DataState, EpochOrder
from elastic_harness.errors import CheckpointError, HarnessError
from elastic_harness.events import EventLog
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.runtime import dist as hdist
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.loop import Trainer, save_due_by_steps, save_due_by_time, train_step
from elastic_harness.runtime.parallel import wrap
from elastic_harness.runtime.state import ModelState, OptimState, TrainState
from elastic_harness.runtime.watchdog import ProgressWatchdog
from elastic_harness.spec import JobSpec, load_job
from elastic_harness.tasks import load_task

DRAIN_EXIT = 128 + signal.SIGTERM


class NullLog:
    def emit(self, event: str, **fields) -> dict:
        return {}


class Drain:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves, and exits."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


def build_trainer(spec: JobSpec, env: WorkerEnv, device: torch.device, run_dir: Path) -> Trainer:
    task = load_task(spec.task.target, spec.task.args)
    torch.manual_seed(spec.train.seed)  # identical initial weights on every rank and restart
    model = wrap(task.build_model(), spec.parallelism, device, task, env.world_size)
    dataset = task.dataset()
    o = spec.optimizer
    if o.name == "adamw":
        optim = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    else:
        optim = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    sample_log = None
    if spec.train.record_samples:
        (run_dir / "samples").mkdir(exist_ok=True)
        sample_log = run_dir / "samples" / f"rank-{env.rank}.jsonl"
    return Trainer(
        spec=spec, task=task, model=model, optim=optim, dataset=dataset,
        order=EpochOrder(spec.train.seed, len(dataset)), device=device, rank=env.rank,
        world_size=env.world_size, collate=getattr(task, "collate", None), sample_log=sample_log,
    )


def resume(tr: Trainer, ckpt: CheckpointManager, state: dict, env: WorkerEnv, events) -> None:
    loaded = ckpt.restore(state)
    train: TrainState = state["train"]
    if loaded is None:
        events.emit("resume", fresh=True, step=0, world_size=env.world_size)
        return
    reason = train.check_matches(tr.spec.train.seed, len(tr.dataset))
    if reason:
        raise CheckpointError(f"{loaded.name} cannot continue this job: {reason}", "use a new --run-dir or --fresh")
    events.emit(
        "resume", step=loaded.step, checkpoint=loaded.name, saved_world_size=train.saved_world_size,
        world_size=env.world_size, load_s=round(loaded.seconds, 4), samples=train.data.cursor,
        message=f"resumed from step {loaded.step}, saved at world size {train.saved_world_size}, "
        f"now {env.world_size}, load took {loaded.seconds:.2f} s",
    )


def model_digest(model: torch.nn.Module) -> str:
    """sha256 over the full parameters (names, dtypes, shapes, bytes). Collective; rank 0 gets it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def loop(tr: Trainer, ckpt: CheckpointManager, state: dict, env: WorkerEnv, events, drain: Drain,
         faults: WorkerFaults) -> bool:
    """Train to the last step. Returns False if it stopped early to drain."""
    spec, train = tr.spec, state["train"]
    watchdog = ProgressWatchdog(env.timer_file, spec.timeouts.step)
    last_save, last_saved_step, loss = time.monotonic(), train.step, None
    while train.step < spec.train.steps:
        t0 = time.perf_counter()
        time_flag = float(env.rank == 0 and save_due_by_time(spec, time.monotonic() - last_save))
        watchdog.arm()
        loss, (drain_n, time_n) = train_step(tr, train, [float(drain.requested), time_flag])
        dt = time.perf_counter() - t0
        if train.step % spec.train.log_every == 0 or train.step == spec.train.steps:
            events.emit(
                "step", step=train.step, loss=round(loss, 6), world_size=env.world_size,
                samples=train.data.cursor, restart=env.restart_count, step_s=round(dt, 5),
                samples_per_s=round(spec.train.global_batch_size / dt, 2),
            )
        final = train.step == spec.train.steps
        drain_now = drain_n > 0 and not final
        blocking = drain_n > 0 or (final and spec.checkpoint.save_final)
        periodic = save_due_by_steps(spec, train.step) or time_n > 0
        if train.step != last_saved_step and (blocking or periodic):
            # A save may wait for the previous one or write synchronously: a longer budget.
            watchdog.arm(extra_s=spec.timeouts.process_group)
            if ckpt.save(train.step, state, blocking=blocking):
                last_save, last_saved_step = time.monotonic(), train.step
            watchdog.arm()
        if drain_now:
            events.emit("drain", step=train.step, world_size=env.world_size)
            watchdog.disarm()
            return False
        faults.after_step(train.step)
    watchdog.disarm()
    ckpt.wait()
    events.emit("finish", step=train.step, loss=None if loss is None else round(loss, 6),
                digest=model_digest(tr.model),
                samples=train.data.cursor, world_size=env.world_size)
    return True


def _agree_generation(rank: int) -> str:
    """A fresh id for this worker generation, the same on every rank (for audits)."""
    import uuid

    import torch.distributed as dist

    box = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@record
def main(argv: list[str] | None = None) -> int:
    job_path, run_dir = (argv or sys.argv[1:])[:2]
    run_dir = Path(run_dir)
    env = WorkerEnv.from_environ()
    drain = Drain()
    spec = load_job(job_path)
    log = EventLog(run_dir / "events.jsonl")
    events = log if env.rank == 0 else NullLog()  # rank 0 narrates; any rank reports fatals
    t0 = time.perf_counter()
    groups = hdist.init(env, spec.device, spec.timeouts.process_group)
    log.emit("worker", rank=env.rank, local_rank=env.local_rank, group_rank=env.group_rank, node=env.node,
             restart=env.restart_count, world_size=env.world_size)
    generation = _agree_generation(env.rank)
    events.emit("rendezvous", generation=generation, world_size=env.world_size, restart=env.restart_count,
                nodes=env.world_size // max(env.local_world_size, 1), pg_init_s=round(time.perf_counter() - t0, 3))
    ckpt = None
    try:
        tr = build_trainer(spec, env, groups.device, run_dir)
        tr.generation = generation
        storage = open_storage(checkpoint_root(spec.checkpoint.dir, run_dir))
        info = {"task": spec.task.target, "parallelism": spec.parallelism, "job": spec.name}
        ckpt = CheckpointManager(storage, spec.checkpoint, rank=env.rank, world_size=env.world_size,
                                 group=groups.ckpt, events=events, info=info)
        data = DataState(spec.train.seed, len(tr.dataset))
        state = {"model": ModelState(tr.model), "optim": OptimState(tr.model, tr.optim),
                 "train": TrainState(data, env.world_size)}
        resume(tr, ckpt, state, env, events)
        faults = WorkerFaults(spec.chaos, rank=env.rank, node=env.node, local_rank=env.local_rank,
                              marker_dir=run_dir / "chaos", events=log)
        finished = loop(tr, ckpt, state, env, events, drain, faults)
    except HarnessError as e:
        log.emit("failure", fatal=True, message=str(e), rank=env.rank)
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        hdist.destroy()
    return 0 if finished else DRAIN_EXIT


if __name__ == "__main__":
    sys.exit(main())
