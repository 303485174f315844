"""The run directory: claim it, prove it writable, record the resolved spec.

``prepare`` is what the host ``run``, each ``agent`` and ``ckpt import`` call first. It takes
the run directory's lock, and the checkpoint directory's when that lives elsewhere (a local
path outside the run directory, or ``s3://``), for one job submission (``Holder``: the
rendezvous id); every process of that submission shares the locks, a different job is
refused with one line naming the holder (see ``checkpoint.lock``). ``owner`` answers "who
holds this run directory".

Nothing here deletes: ``--fresh`` moves earlier checkpoints and events aside, under the
lock, into ``NAME.old-STAMP`` next to them. Checkpoints in an object store cannot be moved
cheaply: ``--fresh`` refuses when the prefix holds any, naming the fix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from elastic_harness import jobkey, runfiles
from elastic_harness.checkpoint import integrity, layout, lock
from elastic_harness.checkpoint.storage import LocalStorage, Storage, open_storage
from elastic_harness.checkpoint.where import checkpoint_root, inside, is_url
from elastic_harness.errors import CheckpointError, RunDirError, os_reason
from elastic_harness.spec import JobSpec, dump_job


class Claim:
    """A prepared run directory and the locks this process holds on it; ``release()`` (or
    leaving the ``with`` block) gives them back. ``took_over`` names stale holders replaced."""

    def __init__(self, path: Path, checkpoint_root: str, leases: list[lock.Lease]) -> None:
        self.path, self.checkpoint_root, self.leases = path, checkpoint_root, leases
        self.took_over = [lease.took_over for lease in leases if lease.took_over]

    def release(self) -> None:
        for lease in reversed(self.leases):
            lease.release()

    def lost(self, now: bool = False) -> str:
        """Why this submission no longer holds its locks ("" while it does): another live
        job took one over (``lock.Lease.lost``). ``now``: read the lock files first (a
        worker generation is about to start); else the heartbeats' last word (cheap)."""
        for lease in self.leases:
            record = lease.check() if now else lease.lost
            if record is not None:
                return (f"this submission lost the lock of {lease.store.root} to {lock.describe(record)}: "
                        "it stopped answering long enough to look gone, and that job took the directory over; "
                        "stopped without saving\n  fix: let that job finish (or stop it); then re-running "
                        "resumes from its checkpoints")
        return ""

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def prepare(run_dir: Path, spec: JobSpec, fresh: bool = False, *, holder: lock.Holder,
            clock: Callable[[], float] = time.time, key_file: Path | None = None,
            record_spec: bool = True) -> Claim:
    """Create and lock ``run_dir`` (and an outside checkpoint dir), move old state aside if
    ``fresh``, write the resolved spec (unless ``record_spec`` is False: a process handed
    the run directory's own resolved spec by its owner, see ``handed_resolved``), make sure
    the job's key exists (``jobkey``: created in the run dir unless ``key_file`` names one
    provided from outside, which must exist) and that it is the key the checkpoints there
    were signed with (``check_key``; a missing key is made only where no checkpoint needs it).
    Raises ``RunDirError``/``CheckpointError``/``jobkey.KeyError_``."""
    run_dir = Path(run_dir).resolve()
    _writable(run_dir)
    own_key = run_dir / jobkey.KEY_FILE
    key_path = own_key if key_file is None else Path(key_file)
    key = _provided_key(key_path) if key_path != own_key else jobkey.read(own_key) if own_key.exists() else None
    root = checkpoint_root(spec.checkpoint.dir, run_dir)
    leases = [_lease(LocalStorage(run_dir), holder, f"run directory '{run_dir}'", RunDirError, "--run-dir")]
    try:
        if not inside(root, run_dir):
            leases.append(_outside_checkpoints(root, holder))
        if fresh:
            set_aside_old(run_dir, root, time.strftime("%Y%m%d-%H%M%S", time.localtime(clock())))
        else:
            check_key(open_storage(root), key, key_path, run_dir)
        if key is None:
            jobkey.ensure(own_key)  # a new run directory: its key, made silently
        if record_spec:
            write_resolved(run_dir, spec)
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return Claim(run_dir, root, leases)


def _outside_checkpoints(root: str, holder: lock.Holder) -> lock.Lease:
    """A ``checkpoint.dir`` outside the run directory: created (private) and locked, its lease."""
    store = open_storage(root)
    try:
        if not is_url(root):
            private_dir(Path(root))
        store.ensure()
    except OSError as e:
        raise CheckpointError(f"checkpoint.dir '{root}' cannot be created: {e.strerror or e}",
                              "set checkpoint.dir to a directory you can write") from None
    return _lease(store, holder, f"checkpoint.dir '{root}'", CheckpointError, "checkpoint.dir")


def _provided_key(path: Path) -> bytes:
    """The key a job was given from outside (``ELASTIC_HARNESS_KEY_FILE``): it must exist."""
    try:
        return jobkey.read(path)
    except jobkey.KeyExposed as e:
        raise jobkey.KeyExposed(f"{jobkey.KEY_FILE_VAR}: {e.message}", e.hint) from None
    except jobkey.KeyError_ as e:
        raise jobkey.KeyError_(f"{jobkey.KEY_FILE_VAR}: {e.message}",
                               f"point {jobkey.KEY_FILE_VAR} at the job's key (32 random bytes, hex, mode 0600: "
                               "`(umask 077; openssl rand -hex 32 > FILE)`), or unset it to use RUN_DIR/job.key") from None


def check_key(store: Storage, key: bytes | None, path: Path, run_dir: Path) -> None:
    """Before a job starts: checkpoints signed with a key it does not have (``key`` None:
    the run dir's key file is missing) are refused here, naming the file, rather than set
    aside one by one as forgeries on resume while a new key is made."""
    try:
        signed, ours = integrity.signed_steps(store, key)
    except OSError:
        return  # unreadable storage: the resume says so in its own words
    if not signed or ours:
        return
    steps = ", ".join(str(layout.parse_step(n)) for n in signed[-4:])
    trust = f"elastic-harness ckpt trust {run_dir} --step {layout.parse_step(signed[-1])}"
    if key is None:
        raise jobkey.KeyError_(
            f"the run's key {path} is missing, but {len(signed)} checkpoint(s) in {store.root} are signed "
            f"(steps {steps}): without their key they cannot be told from forgeries; nothing was changed",
            f"restore {path} (from a backup, or the copy this run dir came from) or point "
            f"{jobkey.KEY_FILE_VAR} at it; or review one and sign it with a new key: {trust} --key {path}; "
            "or start over with --fresh (moves them aside)")
    raise jobkey.KeyError_(
        f"the {len(signed)} signed checkpoint(s) in {store.root} (steps {steps}) are not signed with the key in "
        f"{path}: the key was replaced, or {jobkey.KEY_FILE_VAR} names another job's; nothing was changed",
        f"restore this run's key to {path}; or review one and sign it with this key: {trust}; "
        "or start over with --fresh (moves them aside)")


# Run directories are the job's owner's alone (0700): checkpoints, logs, the key (docs/security.md).
DIR_MODE = 0o700


def private_dir(path: Path, mode: int = DIR_MODE) -> None:
    """Create ``path`` (and missing parents) with ``mode``; an existing directory is left as
    the user set it. A group-readable run dir: create it 0750 beforehand (docs/security.md)."""
    missing = []
    p = Path(path)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)  # mkdir's mode is masked by the umask; the chmod is not


def check_paths(run_dir: Path, spec: JobSpec) -> None:
    """Before anything heavy (torch, the task): the run directory and a local
    ``checkpoint.dir`` must be directories this process can create or write, not files.
    Reads only (nothing is created: a job refused later leaves no empty directory);
    ``prepare`` proves them writable for real."""
    run_dir = Path(run_dir).absolute()
    _check_dir(run_dir, "run directory", RunDirError, "pass --run-dir to a directory you can write")
    root = checkpoint_root(spec.checkpoint.dir, run_dir)
    if not is_url(root):
        _check_dir(Path(root), "checkpoint.dir", CheckpointError,
                   "set checkpoint.dir to a directory you can write (or leave it empty: RUN_DIR/checkpoints)")


def _check_dir(path: Path, what: str, error: type, fix: str) -> None:
    """``path`` is a writable directory, or the nearest existing ancestor is one."""
    here = path
    while not here.exists() and here != here.parent:
        if here.is_symlink():  # a dangling link: mkdir would fail on it
            raise error(f"{what} '{path}' is a broken link ({here} -> {os.readlink(here)})", fix)
        here = here.parent
    if not here.is_dir():
        if here == path:
            raise error(f"{what} '{path}' is a file, not a directory", fix)
        raise error(f"{what} '{path}' is not writable: '{here}' is a file, not a directory", fix)
    if not os.access(here, os.W_OK | os.X_OK):
        inside = "" if here == path else f" (nor can it be made in '{here}')"
        raise error(f"{what} '{path}' is not writable{inside}", f"{fix}, or fix its permissions")


def _writable(run_dir: Path) -> None:
    try:
        private_dir(run_dir)
        probe = run_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"run directory '{run_dir}' is not writable: {e.strerror}",
            "pass --run-dir to a directory you can write, or fix its permissions",
        ) from None


def _lease(store, holder: lock.Holder, what: str, error: type, flag: str) -> lock.Lease:
    try:
        return lock.Lease.acquire(store, holder)
    except lock.LockHeld as e:
        raise error(f"{what} is in use by {e}",
                    f"wait for that job to finish or stop it, or use another {flag}") from None
    except OSError as e:
        raise error(f"cannot lock {what}: {os_reason(e)}", "fix its permissions or storage") from None


def owner(run_dir: Path) -> dict | None:
    """The lock record of the job holding ``run_dir`` (None if free). See ``lock.describe``."""
    return lock.read_record(LocalStorage(Path(run_dir)))


def set_aside_old(run_dir: Path, root: str, stamp: str) -> None:
    """``--fresh``: move the run's events and summary, and its checkpoints, aside (never delete)."""
    if is_url(root):
        store = open_storage(root)
        held = [n for n in store.listing() if layout.parse_step(n) is not None or layout.parse_quarantined(n)]
        if held:
            raise CheckpointError(
                f"--fresh cannot move the {len(held)} checkpoints in {root} aside (object storage has no rename)",
                "point checkpoint.dir at a new prefix (--set checkpoint.dir=...), or delete them there first",
            )
    else:
        _move_entries(Path(root), Path(f"{root}.old-{stamp}"), keep={lock.LOCK_FILE})
    for name in runfiles.SET_ASIDE_ON_FRESH:
        if (run_dir / name).exists():
            os.replace(run_dir / name, run_dir / f"{name}.old-{stamp}")


def _move_entries(root: Path, aside: Path, keep: set[str]) -> None:
    """Move everything in ``root`` but ``keep`` into ``aside`` (the lock stays where it is)."""
    if not root.is_dir():
        return
    entries = [e for e in os.listdir(root) if e not in keep]
    if not entries:
        return
    aside.mkdir(parents=True, exist_ok=True)
    for name in entries:
        os.replace(root / name, aside / name)


def handed_resolved(job_path: str | Path, run_dir: Path) -> bool:
    """Is ``job_path`` the run directory's own resolved spec? Then the run directory's owner
    (``run``) wrote it, and an agent given it must not write it again."""
    return Path(job_path).resolve() == (Path(run_dir) / runfiles.RESOLVED_SPEC).resolve()


def write_resolved(run_dir: Path, spec: JobSpec) -> Path:
    """Atomically: the peer agents of a cluster submission (each given the job's own YAML,
    no host above them) may each write the same content; readers never see half a file."""
    final = run_dir / runfiles.RESOLVED_SPEC
    tmp = run_dir / f".{runfiles.RESOLVED_SPEC}.{os.getpid()}"
    tmp.write_text(dump_job(spec))
    os.replace(tmp, final)
    return final
