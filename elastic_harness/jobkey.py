"""The job's secret key: the one home for creating, finding and using it.

Anything the harness deserializes from a place others can write (the rendezvous store,
etcd, the checkpoint directory) is authenticated first with an HMAC-SHA256 under a key
that only the job's own processes know. This module creates that key, finds it, and
seals/checks bytes with it; callers pass the key (or its file) in, nothing deeper reads
the environment.

Where the key lives:

- ``<run dir>/job.key`` (``KEY_FILE``), 32 random bytes written hex, mode 0600, created
  once per run directory by whichever process prepares it first (``ensure``: ``run``,
  ``agent``, ``submit``), atomically, so concurrent agents agree on one key. Every later
  submission into the same run directory reuses it: its checkpoints stay loadable. A key
  that went missing beside checkpoints it signed is not made anew (``rundir.check_key``).
- elsewhere, when ``KEY_FILE_VAR`` (``ELASTIC_HARNESS_KEY_FILE``) names a file: a
  Kubernetes Secret mounted into the pod, or a path Slurm's job environment exports. Such a
  file is never created here; it must exist.

Limits (docs/security.md): the key authenticates *origin* (a process that can read the key
wrote it), not freshness: a signed value captured earlier can be replayed within the same
context (an old rendezvous state of the same rendezvous id, an older checkpoint of the same
run). Replays carry our own data only, never code. Whoever can read the key file (the run
dir's owner, root) can forge anything: the key is as safe as that file. So a key file every
user of the machine can read (or replace) is refused, with one line naming the fix, and one
its group can read is named once on stderr (``check_private``).

This module imports nothing of ours but ``errors`` (the pure layer may use it).
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.errors import HarnessError

KEY_FILE = runfiles.KEY
KEY_FILE_VAR = "ELASTIC_HARNESS_KEY_FILE"
TAG_BYTES = 32  # HMAC-SHA256
_KEY_BYTES = 32


class KeyError_(HarnessError):  # noqa: N801 (KeyError is a builtin)
    """The job's key is missing or unreadable."""


class KeyExposed(KeyError_):
    """The job's key file is readable by every user (``check_private``)."""


def key_path(run_dir: Path, environ: Mapping[str, str]) -> Path:
    """Pure: where this job's key is: ``KEY_FILE_VAR`` if set, else ``<run_dir>/job.key``."""
    named = environ.get(KEY_FILE_VAR, "")
    return Path(named) if named else Path(run_dir) / KEY_FILE


def ensure(path: Path) -> bytes:
    """The key at ``path``, created (0600, atomically: the first creator wins) if absent."""
    path = Path(path)
    if not path.exists():
        key = secrets.token_bytes(_KEY_BYTES)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise KeyError_(f"cannot create the job's key {path}: {e.strerror or e}",
                            "name a key file in a directory you can write") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another process was first: use theirs
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return read(path)


def exposure(mode: int, shared_group: bool = True) -> str:
    """Pure: who besides the owner may read (or replace) a key file of ``mode`` (its
    ``st_mode``): "others" (every user of the machine: refused), "group" (warned about; not
    when the group is no one else's: ``shared_group`` False), or "" (the owner alone)."""
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        return "others"
    if mode & (stat.S_IRGRP | stat.S_IWGRP) and shared_group:
        return "group"
    return ""


def shared(gid: int) -> bool:
    """Does group ``gid`` hold users besides this process's? Not this process's own primary
    group without other members (a user's private group; a Kubernetes pod's
    ``runAsGroup``/``fsGroup``, which the manifests mount the key's Secret 0440 for)."""
    if gid != os.getgid():
        return True
    try:
        return bool(grp.getgrgid(gid).gr_mem)
    except KeyError:  # not in /etc/group (a container's numeric group): nobody else is in it
        return False


def check_private(path: Path, mode: int, shared_group: bool = True) -> str:
    """Refuse a key file every user can read (``KeyExposed``): whoever reads it can seal a
    rendezvous state that every agent then unpickles, running code as the job's user. A
    group-readable one is allowed (a run directory shared with a group on purpose); the
    line that says so is returned ("" when private, or the group is no one else's), for
    the caller to print once."""
    who = exposure(mode, shared_group)
    if who == "others":
        raise KeyExposed(f"the job's key {path} can be {'read' if mode & stat.S_IROTH else 'replaced'} by every "
                        f"user of this machine (mode {stat.S_IMODE(mode):04o}): anyone could seal rendezvous state "
                        "that the agents unpickle, and so run code as this job's user; it was not used",
                        f"chmod 600 {path} (a Kubernetes Secret: defaultMode 0400, or 0440 with the pod's fsGroup)")
    if who == "group":
        return (f"the job's key {path} can be read by its group (mode {stat.S_IMODE(mode):04o}): every member can "
                "forge this job's rendezvous state and checkpoints; chmod 600 it unless that group is trusted")
    return ""


_WARNED: set[str] = set()  # key files whose group exposure this process named already


def read(path: Path) -> bytes:
    """The key in ``path`` (hex, as ``ensure`` writes it, or raw bytes as a Secret may hold);
    refused when every user may read it, named once (stderr) when its group may
    (``check_private``)."""
    try:
        data = Path(path).read_bytes()
        st = os.stat(path)
        warning = check_private(Path(path), st.st_mode, shared(st.st_gid))
    except OSError as e:
        raise KeyError_(f"cannot read the job's key {path}: {e.strerror or e}",
                        "run from the run directory's owner, or point ELASTIC_HARNESS_KEY_FILE at the "
                        "job's key (a Kubernetes Secret, Slurm: the run dir's job.key)") from None
    if warning and str(path) not in _WARNED:
        _WARNED.add(str(path))
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = data  # a binary secret
    if len(key) < 16:
        raise KeyError_(f"the job's key {path} is too short ({len(key)} bytes)",
                        "use 32 random bytes only you can read, e.g. `(umask 077; openssl rand -hex 32 > job.key)`")
    return key


def tag(key: bytes, data: bytes, context: bytes = b"") -> bytes:
    """HMAC-SHA256 of ``data`` under ``key``, bound to ``context`` (what the bytes are for,
    so a value signed for one use is not valid for another)."""
    mac = hmac.new(key, context + b"\0", hashlib.sha256)
    mac.update(data)
    return mac.digest()


def seal(key: bytes, payload: bytes, context: bytes = b"") -> bytes:
    """``tag || payload``."""
    return tag(key, payload, context) + payload


def unseal(key: bytes, blob: bytes, context: bytes = b"") -> bytes | None:
    """The payload of a ``seal``, or None when the tag does not match (forged, corrupt)."""
    if len(blob) < TAG_BYTES:
        return None
    mac, payload = blob[:TAG_BYTES], blob[TAG_BYTES:]
    return payload if hmac.compare_digest(mac, tag(key, payload, context)) else None


def sign_hex(key: bytes, data: bytes, context: bytes = b"") -> str:
    return tag(key, data, context).hex()


def check_hex(key: bytes, data: bytes, signature: str, context: bytes = b"") -> bool:
    return hmac.compare_digest(signature.encode(), sign_hex(key, data, context).encode())
