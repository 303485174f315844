"""The task path: the harness's own training loop, written on the public API (``session``).

A job that names a task (``task.target``) runs this; a job that names a script runs the
user's script instead (``runtime.entry``). Both go through the same ``Run``: resume,
fixed global batch, checkpoints, drain, watchdog, metrics. What a task provides (see
``tasks.base``): ``build_model``, ``dataset``, ``loss``; optionally ``optimizer(model)``,
``lr_scheduler(optimizer)``, ``collate``, ``shard_units``, ``eval_dataset``,
``evaluate(model, batch)``, and for a mesh layout with ``tensor > 1`` ``parallelize(model,
mesh)`` (its tensor-parallel plan; ``check_parallelize(model, tensor)`` lets ``run`` refuse a
plan before any agent starts). Without a task optimizer/scheduler the job's ``optimizer``
section builds AdamW or SGD and the LR is a pure function of the step (``runtime.lr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastic_harness.errors import TaskError
from elastic_harness.runtime.lr import lr_at
from elastic_harness.runtime.mesh import parallelize
from elastic_harness.runtime.parallel import wrap
from elastic_harness.runtime.seeding import seed_torch
from elastic_harness.runtime.session import Run, init
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec, OptimizerSpec
from elastic_harness.tasks import load_task


def build_model(task: Any, spec: JobSpec, device: torch.device, topology: Topology,
                mesh: Any = None) -> nn.Module:
    """The task's model, built on the seeded RNG, wrapped for this layout, maybe compiled."""
    seed_torch(spec.train.seed)  # identical initial weights on every rank and restart (seeding)
    if topology.kind == "mesh":  # the task's tensor-parallel plan, then FSDP2/HSDP (runtime.mesh)
        model = parallelize(task.build_model().to(device), mesh, task, topology, spec.task.target)
        return torch.compile(model) if spec.train.compile else model
    model = wrap(task.build_model(), topology, device, task)
    return torch.compile(model) if spec.train.compile else model


def builtin_optimizer(opt: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer:
    if opt.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                 weight_decay=opt.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=opt.momentum,
                           weight_decay=opt.weight_decay)


def build_optimizer(task: Any, spec: JobSpec, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """The task's optimizer and scheduler if it has them, else the built-ins (no scheduler)."""
    make = getattr(task, "optimizer", None)
    optim = make(model) if callable(make) else builtin_optimizer(spec.optimizer, model)
    if not isinstance(optim, torch.optim.Optimizer):
        raise TaskError(f"{spec.task.target}.optimizer(model) returned {type(optim).__name__}",
                        "return a torch.optim.Optimizer built over model.parameters()")
    make_sched = getattr(task, "lr_scheduler", None)
    return optim, make_sched(optim) if callable(make_sched) else None


def evaluator(task: Any, model: nn.Module) -> Callable[[Any], dict[str, torch.Tensor]]:
    custom = getattr(task, "evaluate", None)
    if callable(custom):
        return lambda batch: custom(model, batch)
    return lambda batch: {"loss": task.loss(model, batch)}


def eval_set(task: Any, spec: JobSpec) -> Any:
    if not spec.eval.every_steps:
        return None
    make = getattr(task, "eval_dataset", None)
    if not callable(make):
        raise TaskError(f"eval.every_steps is {spec.eval.every_steps} but {spec.task.target} has "
                        "no eval_dataset()", "add eval_dataset() to the task, or set eval.every_steps: 0")
    return make()


def grad_norm(model: nn.Module, clip: float) -> float:
    """Clip to ``clip`` (0 = only measure) and return the global gradient norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    if len(by_mesh) > 1:  # a mesh layout: tensor-parallel DTensors beside FSDP-only ones
        return _grad_norm_per_mesh(model, by_mesh, clip)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)
    return _value(norm)


def _value(norm: torch.Tensor) -> float:
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
    return float(full() if callable(full) else norm)


def _grad_norm_per_mesh(model: nn.Module, by_mesh: dict, clip: float) -> float:
    """torch's clip stacks every gradient's norm, which DTensor refuses across meshes: one norm
    per mesh (each reduced over its own ranks), combined here, then the same clip coefficient."""
    squares = [_value(torch.nn.utils.get_total_norm(gs, 2.0)) ** 2 for gs in by_mesh.values()]
    total = math.sqrt(sum(squares))
    if clip and total > clip:
        coef = clip / (total + 1e-6)
        for gs in by_mesh.values():
            for g in gs:
                g.mul_(coef)
    return total


def train(run: Run, task: Any, model: nn.Module, optim: torch.optim.Optimizer, sched: Any) -> None:
    spec = run.spec
    evaluation = eval_set(task, spec)
    collate = getattr(task, "collate", None)
    for step in run.steps(task.dataset(), collate_fn=collate):
        if sched is None:  # built-in schedule: a pure function of the step
            lr = lr_at(step.number - 1, spec.optimizer, spec.train.steps)
            for group in optim.param_groups:
                group["lr"] = lr
        for batch in step.batches():
            with run.autocast():
                per_sample = task.loss(model, batch)
            step.backward(per_sample)
        step.unscale(optim)
        norm = grad_norm(model, spec.optimizer.grad_clip)
        step.optimizer_step(optim)
        if sched is not None:
            sched.step()
        optim.zero_grad(set_to_none=True)
        step.done(grad_norm=norm)
        if evaluation is not None and step.eval_due:
            run.evaluate(evaluation, evaluator(task, model), collate_fn=collate)


def main(spec: JobSpec, run_dir: str) -> int:
    """Every rank: build the task's model and optimizer, register them, train, close.
    ``spec``: the job, parsed once by the entry."""
    run = init(spec, run_dir=run_dir)
    try:
        spec = run.spec
        task = load_task(spec.task.target, spec.task.args)
        model = build_model(task, spec, run.device, run.topology, run.mesh)
        optim, sched = build_optimizer(task, spec, model)
        run.register(model, optim, scheduler=sched)
        train(run, task, model, optim, sched)
    finally:
        run.close()
    return 0
