"""``elastic-harness ckpt``: inspect, verify, export, import and compare checkpoints.

DIR may be a run directory (its ``checkpoints/``, or the ``checkpoint.dir`` its resolved
job names), a checkpoint root, one ``step-NNNNNNN`` directory, or an ``s3://`` URL of
either. Everything here runs in one process, without a process group, on CPU.
DCP unpickles a checkpoint's ``.metadata``: nothing here reads one whose manifest is not
signed with the run's key (``job.key`` beside the checkpoints, or ``--key FILE``) unless the
user says ``--trust``; ``ckpt trust`` shows one checkpoint the user vouches for (an older
run's, written before checkpoints were signed, or another job's) and signs it once
confirmed, ``ckpt import`` signs what it imports. ``.metadata`` is read by
``safe_metadata`` (DCP's types only), so even a signed one runs no code. ``ls`` and
``verify`` read no pickle and only report signatures.
Modules that import torch (``offline``, ``export``) are imported by the commands that use
them, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from elastic_harness import jobkey
from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.entries import TRAIN
from elastic_harness.checkpoint.storage import open_storage
from elastic_harness.checkpoint.where import checkpoint_root
from elastic_harness.errors import CheckpointError

_FILE_SUFFIXES = (".pt", ".pth", ".safetensors")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list, verify, export, import and diff checkpoints",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    acts = p.add_subparsers(dest="ckpt_action", metavar="ACTION", required=True)
    _add_ls_verify_export(acts)
    _add_trust_import(acts)
    a = acts.add_parser("diff", help="max abs/rel difference between two checkpoints' models")
    a.add_argument("a", help="checkpoint location or exported .pt/.safetensors file")
    a.add_argument("b")
    _key_flags(a)
    a.set_defaults(func=cmd_diff)


def _add_ls_verify_export(acts: argparse._SubParsersAction) -> None:
    """The actions that read checkpoints: ``ls``, ``verify``, ``export``."""
    a = acts.add_parser("ls", help="one line per checkpoint: step, world size, size, status")
    a.add_argument("dir")
    a.add_argument("--verify", choices=integrity.VERIFY_MODES, default="size",
                   help="how hard to check each one (default size; full re-hashes every file)")
    a.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    _key_flags(a)
    a.set_defaults(func=cmd_ls)
    a = acts.add_parser("verify", help="check checkpoints against their manifests (exit 1 if any is bad)")
    a.add_argument("dir")
    a.add_argument("--mode", choices=integrity.VERIFY_MODES, default="full")
    _key_flags(a)
    a.set_defaults(func=cmd_verify)
    a = acts.add_parser("export", help="write the model as one plain state dict (.pt or .safetensors)")
    a.add_argument("dir")
    a.add_argument("--to", required=True, metavar="FILE", help="model.pt or model.safetensors")
    a.add_argument("--step", type=int, help="which step (default: the newest that verifies)")
    _key_flags(a)
    a.set_defaults(func=cmd_export)


def _add_trust_import(acts: argparse._SubParsersAction) -> None:
    """The actions that bring checkpoints in: ``trust`` (sign one), ``import`` (a legacy file)."""
    a = acts.add_parser("trust", help="review one checkpoint and sign it with the run's key (an older "
                                      "run's unsigned one, another job's)")
    a.add_argument("dir", help="a run dir or checkpoint dir (with --step), or one step dir")
    a.add_argument("--step", type=int, help="the step of the checkpoint you vouch for (one at a time)")
    a.add_argument("--yes", action="store_true", help="sign what is shown without asking (needed when "
                                                      "stdin is not a terminal)")
    a.add_argument("--key", metavar="FILE", help="the key of the run that will load it, created if "
                                                 "absent (default: the job.key beside the checkpoints)")
    a.set_defaults(func=cmd_trust)
    a = acts.add_parser("import", help="start a run from a legacy single-file checkpoint (weights, "
                                       "optimizer state, a position you name)")
    a.add_argument("file", help="a torch.save file (read with weights_only=True) or .safetensors")
    a.add_argument("job", help="the job YAML that will train from it")
    a.add_argument("--run-dir", help="run directory (default runs/<job name>)")
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    where = a.add_mutually_exclusive_group()
    where.add_argument("--step", type=int, help="continue after this many optimizer steps (default 0)")
    where.add_argument("--epoch", type=int, help="continue at the start of this epoch (this many full "
                                                 "passes over the dataset done)")
    a.set_defaults(func=cmd_import)


def _key_flags(a: argparse.ArgumentParser) -> None:
    a.add_argument("--key", metavar="FILE", help="the run's key, to check signatures (default: the "
                                                 "job.key beside the checkpoints)")
    a.add_argument("--trust", action="store_true", help="do not check signatures: you vouch for these "
                                                        "files (reading a checkpoint unpickles it)")


def _key(args: argparse.Namespace, loc, required: bool) -> bytes | None:
    """The key to check ``loc``'s signatures with; None when the user vouches (``--trust``)
    or, where ``required`` is False, when no key is found (said on stderr)."""
    if args.trust:
        print("--trust: signatures not checked; you vouch for these files", file=sys.stderr)
        return None
    path = Path(args.key) if args.key else loc.key_file
    if path is None:
        if required:
            raise CheckpointError(f"cannot check who wrote the checkpoints in {loc.storage.root}: no job.key "
                                  "beside them", "pass --key RUN_DIR/job.key, or --trust if you trust these "
                                  "files (reading a checkpoint unpickles it)")
        print("note: signatures not checked (no job.key beside the checkpoints; pass --key FILE)", file=sys.stderr)
        return None
    return jobkey.read(path)


def cmd_ls(args: argparse.Namespace) -> int:
    from elastic_harness.checkpoint import offline

    loc = offline.locate(args.dir)
    rows = offline.describe(loc.storage, args.verify, _key(args, loc, required=False))
    if loc.step is not None:
        rows = [r for r in rows if r["name"] == loc.step]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{loc.storage.root}  (verify={args.verify})")
    print(f"{'STEP':>9}  {'WORLD':>5}  {'SIZE':>10}  STATUS")
    for r in rows:
        status = _status(r, args.verify)
        world = "-" if r["world_size"] is None else str(r["world_size"])
        print(f"{r['step']:>9}  {world:>5}  {_human(r['bytes']):>10}  {status}")
    if not rows:
        print("(no checkpoints)")
    return 0


def _status(row: dict, mode: str) -> str:
    if not row["complete"]:
        return row["problem"]
    if row["verified"] is False:
        label = {"unsigned": "UNSIGNED", "forged": "FORGED"}.get(row.get("kind", ""), "CORRUPT")
        return f"{label}: {row['problem']}"
    return "complete" if mode == "none" else f"complete, verified ({mode})"


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_verify(args: argparse.Namespace) -> int:
    from elastic_harness.checkpoint import offline

    loc = offline.locate(args.dir)
    rows = offline.describe(loc.storage, args.mode, _key(args, loc, required=False))
    if loc.step is not None:
        rows = [r for r in rows if r["name"] == loc.step]
        if not rows:
            raise CheckpointError(f"{loc.storage.uri(loc.step)} is not a checkpoint directory")
    bad = [r for r in rows if r["complete"] and r["verified"] is False]
    for r in rows:
        print(f"{r['name']}: {_status(r, args.mode)}")
    usable = [r for r in rows if r["complete"] and r["verified"] is not False]
    if usable and loc.step is None:
        print(f"a resume would load {usable[-1]['name']}")
    if not any(r["complete"] for r in rows):
        print("no complete checkpoint")
        return 1
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    from elastic_harness.checkpoint import offline
    from elastic_harness.checkpoint.export import check_target, save_model_file

    check_target(Path(args.to))  # a destination that cannot be written: said before anything is read
    loc = offline.locate(args.dir)
    name = offline.pick(loc, "full", args.step, _key(args, loc, required=True))
    tensors = offline.load_model_tensors(loc.storage.reader(name))
    size = save_model_file(tensors, Path(args.to))
    params = sum(t.numel() for t in tensors.values())
    print(f"exported {loc.storage.uri(name)} -> {args.to}: {len(tensors)} tensors, "
          f"{params} parameters, {_human(size)}")
    return 0


def _model_of(target: str, args: argparse.Namespace):
    from elastic_harness.checkpoint import offline
    from elastic_harness.checkpoint.export import load_model_file

    if Path(target).suffix in _FILE_SUFFIXES and Path(target).is_file():
        return load_model_file(Path(target)), target
    loc = offline.locate(target)
    name = offline.pick(loc, "full", key=_key(args, loc, required=True))
    return offline.load_model_tensors(loc.storage.reader(name)), loc.storage.uri(name)


def cmd_diff(args: argparse.Namespace) -> int:
    from elastic_harness.checkpoint import offline

    (a, where_a), (b, where_b) = _model_of(args.a, args), _model_of(args.b, args)
    result = {"a": where_a, "b": where_b, **offline.compare(a, b)}
    print(json.dumps(result, indent=1))
    return 0 if result["comparable"] else 1


def cmd_import(args: argparse.Namespace) -> int:
    from elastic_harness.checkpoint.export import load_legacy_file, save_single_process
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.spec import load_job

    spec = load_job(args.job, list(args.set))
    legacy = load_legacy_file(Path(args.file))
    weights = legacy.model
    run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
    storage = open_storage(checkpoint_root(spec.checkpoint.dir, run_dir))
    existing = [n for n in storage.listing() if layout.parse_step(n) is not None]
    if existing:
        raise CheckpointError(f"{storage.root} already holds checkpoints ({len(existing)})",
                              "import into a new --run-dir, or move them aside with 'run --fresh' first")
    state, step, optimizer = _fresh_state(spec, weights, legacy, args.step, args.epoch)
    streams = state[TRAIN].data.dataset_size == 0  # a stream, bound at the first start
    info = {"task": spec.task.target, "parallelism": spec.parallelism, "job": spec.name,
            "step": step, "world_size": 1, "imported_from": Path(args.file).name}
    name = layout.step_dirname(step)
    # An import is a (short) job of its own: it must not write under a running one.
    with prepare(run_dir, spec, holder=Holder.this_process(spec.name, f"import-{uuid.uuid4().hex[:12]}")) as claim:
        key = jobkey.read(claim.path / jobkey.KEY_FILE)
        save_single_process(storage, name, state, info, key=key)
    print(f"imported {args.file} -> {storage.uri(name)} ({len(weights)} tensors, {optimizer}, step {step}); "
          f"signed with {run_dir / jobkey.KEY_FILE}: you vouch for the file's contents")
    if legacy.position and args.step is None and args.epoch is None:
        said = ", ".join(f"{k} {v}" for k, v in legacy.position.items())
        where = ("the task streams its data, so training reads it from the first sample" if streams
                 else "name where to continue with --epoch E (E full passes done) or --step N")
        print(f"note: the file says {said}; this import starts at step 0: {where}")
    print(f"train from it with: elastic-harness run {args.job} --run-dir {run_dir}")
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    """Show one checkpoint (a full check against its manifest, its files and checksums, the
    entries its ``.metadata`` lists, read without running code) and sign it once the user
    confirms (``--yes``, or y at the prompt). One at a time: signing lets a resume load it."""
    from elastic_harness.checkpoint import offline

    loc = offline.locate(args.dir)
    name = _trust_target(loc, args.step)
    path = Path(args.key) if args.key else loc.key_file
    if path is None:
        raise CheckpointError(f"no job.key beside {loc.storage.root}",
                              "pass --key RUN_DIR/job.key: the key of the run that will load it")
    if path.is_file() and integrity.signed_by(loc.storage, name, jobkey.read(path)).ok:
        return _already_signed(loc.storage, name, path)
    _refuse_resigning_its_own(loc, name, path)
    shown = offline.review(loc.storage, name)
    _show(loc.storage.uri(name), shown, path)
    if not _confirmed(args.yes, f"sign {name} with {path}, so that a resume loads it? [y/N] "):
        raise CheckpointError(f"{name} not signed", "re-run with --yes to sign what is shown above")
    key = jobkey.ensure(path) if args.key else jobkey.read(path)  # --key: created if absent (a legacy run)
    verdict = integrity.trust(loc.storage, name, key, shown.manifest, shown.metadata_sha256)
    if not verdict.ok:
        print(f"{name}: NOT signed: {verdict.reason}")
        return 1
    print(f"{name}: signed with {path} (you vouch for its contents)")
    return 0


def _already_signed(storage, name: str, path: Path) -> int:
    """``ckpt trust`` of a checkpoint signed with the key given: nothing to sign. It must still
    verify in full (a shard damaged since is not "nothing to do": ``ckpt verify`` says CORRUPT)."""
    verdict = integrity.verify(storage, name, "full", jobkey.read(path))
    if verdict.ok:
        print(f"{name}: already signed with {path}, and it verifies in full; nothing to do")
        return 0
    print(f"{name}: signed with {path}, but {verdict.kind.upper()}: {verdict.reason}; signing cannot repair it "
          "(a resume skips it: 'elastic-harness ckpt verify' shows which step it loads instead)")
    return 1


def _refuse_resigning_its_own(loc, name: str, path: Path) -> None:
    """A checkpoint its own run signed (the ``job.key`` beside it) is not re-signed with another
    key: the run would then refuse its own checkpoint ("the key was replaced")."""
    own = loc.key_file
    if own is None or not own.is_file() or own.resolve() == path.resolve():
        return
    if integrity.signed_by(loc.storage, name, jobkey.read(own)).ok:
        raise CheckpointError(f"{name} is signed with its own run's key ({own}): signing it with {path} "
                              "would make that run refuse it",
                              "to load it in the run of that key, copy the step directory into that run's "
                              "checkpoint directory and trust the copy there")


def _trust_target(loc, step: int | None) -> str:
    """The one step directory ``ckpt trust`` may sign: the step dir named, or ``--step``."""
    if step is not None and loc.step is not None and layout.parse_step(loc.step) != step:
        raise CheckpointError(f"{loc.step} is not step {step}", "name the run dir with --step, or the step dir alone")
    if step is None and loc.step is None:
        steps = [d.step for d in layout.scan(loc.storage.listing(), require_manifest=True) if d.complete]
        raise CheckpointError(f"name the checkpoint to vouch for in {loc.storage.root}",
                              "add --step N (one at a time; it is shown before it is signed)"
                              + (f"; complete here: steps {', '.join(map(str, steps[-8:]))}" if steps else ""))
    name = loc.step or layout.step_dirname(step)
    if name not in loc.storage.listing():
        raise CheckpointError(f"no checkpoint {name} in {loc.storage.root}", "see 'elastic-harness ckpt ls' for the steps")
    return name


def _show(where: str, shown, key: Path) -> None:  # noqa: ANN001 - offline.Review (imported lazily)
    info = {k: shown.manifest.get(k) for k in ("task", "job", "world_size", "step") if shown.manifest.get(k)}
    signed = (f"signed, but not with {key}: a claim" if shown.manifest.get(integrity.SIGNATURE)
              else "unsigned: a claim")
    print(f"{where}: checked in full against its own manifest"
          + (f"; it says {', '.join(f'{k} {v}' for k, v in info.items())} ({signed})" if info else f" ({signed})"))
    print(f"  files ({len(shown.files)}, {_human(sum(size for _, size, _ in shown.files))}):")
    for name, size, digest in shown.files[:_SHOWN]:
        print(f"    {name:<28} {_human(size):>10}  {digest}")
    _more(len(shown.files))
    print(f"  state ({len(shown.entries)} entries, from .metadata read without running code):")
    for key, what in shown.entries[:_SHOWN]:
        print(f"    {key:<40} {what}")
    _more(len(shown.entries))


_SHOWN = 40


def _more(n: int) -> None:
    if n > _SHOWN:
        print(f"    ... and {n - _SHOWN} more")


def _confirmed(yes: bool, question: str) -> bool:
    """``--yes``, or the user typed y on a terminal; never asks a pipe."""
    if yes:
        return True
    if not sys.stdin.isatty():
        return False
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def import_position(step: int | None, epoch: int | None, dataset_size: int, global_batch: int,
                    total_steps: int) -> tuple[int, int]:
    """Pure: (step, sample cursor) of an import: after ``step`` updates, or at the start of
    ``epoch`` (its first sample is the cursor; the step is the updates that took)."""
    if step is not None and step < 0 or epoch is not None and epoch < 0:
        raise CheckpointError("--step and --epoch count from 0", "e.g. --epoch 3")
    if epoch is not None:
        cursor = epoch * dataset_size
        step = cursor // global_batch
    else:
        step = step or 0
        cursor = step * global_batch
    if step and step >= total_steps:
        raise CheckpointError(f"the imported position (step {step}) leaves nothing to train: train.steps is "
                              f"{total_steps}", f"raise train.steps above {step} (--set train.steps=...)")
    return step, cursor


def _fresh_state(spec, weights: dict, legacy, step: int | None, epoch: int | None) -> tuple[dict, int, str]:
    """The state a fresh job builds (the worker's own builders), with ``weights`` loaded, the
    file's optimizer state mapped onto the job's optimizer, at the position named. Returns
    (state, step, what became of the optimizer)."""
    import torch

    from elastic_harness.data.sampler import DataState
    from elastic_harness.runtime.state import TrainState, build_state
    from elastic_harness.runtime.worker import build_optimizer
    from elastic_harness.tasks import load_task

    if not spec.task.target:
        raise CheckpointError("ckpt import needs a job that names a task (task.target)",
                              "for a script job, load the weights in the script before training")
    task = load_task(spec.task.target, spec.task.args)
    torch.manual_seed(spec.train.seed)
    model = task.build_model()
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:  # missing/unexpected keys or shape mismatches, all listed
        raise CheckpointError(f"the file does not fit {spec.task.target}: {str(e)[:600]}",
                              "import it with the job (task.args) that trained it") from None
    optim, sched = build_optimizer(task, spec, model)
    optimizer = _load_optimizer(optim, model, legacy.optimizer)
    n, step, cursor = _import_data(task.dataset(), step, epoch, spec)
    if sched is not None and step:  # a task's scheduler continues where the step is
        sched.load_state_dict({**sched.state_dict(), "last_epoch": step, "_step_count": step + 1})
    train = TrainState(DataState(spec.train.seed, n, cursor), 1, step=step)
    return build_state(model, optim, train, scheduler=sched), step, optimizer


def _import_data(dataset, step: int | None, epoch: int | None, spec) -> tuple[int, int, int]:
    """(dataset size, step, cursor) the imported checkpoint starts from. A sharded stream
    starts at its beginning, world-size-free: size 0 means "not bound yet", and the first
    worker start binds the stream there and records its shard list (``runtime.session``),
    which its sizes need (counting every shard is the workers' job, not this command's)."""
    from elastic_harness.data.adapters import source_of
    from elastic_harness.data.stream import Stream

    data = source_of(dataset)
    if isinstance(data, Stream):
        if step or epoch:
            raise CheckpointError(f"{spec.task.target} streams its data: an import starts at the "
                                  "stream's beginning (step 0), not at a step or epoch",
                                  "import without --step/--epoch (the weights and optimizer state "
                                  "are kept; the data is read from the first sample)")
        return 0, 0, 0
    n = len(data)
    return (n, *import_position(step, epoch, n, spec.train.global_batch_size, spec.train.steps))


def _load_optimizer(optim, model, saved) -> str:
    """Load the file's optimizer state (``export.map_optimizer_state``) if it has one."""
    from elastic_harness.checkpoint.export import is_optimizer_state, map_optimizer_state

    if saved is None:
        return "fresh optimizer (the file holds none)"
    if not is_optimizer_state(saved):
        return "fresh optimizer (the file's 'optimizer' is not a torch optimizer state dict)"
    names = {id(p): n for n, p in model.named_parameters()}
    mapped = map_optimizer_state(saved, [g["params"] for g in optim.param_groups], names, optim.state_dict())
    optim.load_state_dict(mapped)
    return f"optimizer state of {len(mapped['state'])} parameters"
