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
dir's owner, root) can forge anything: the key is as safe as that file.

This module imports nothing of ours but ``errors`` (the pure layer may use it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
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


def read(path: Path) -> bytes:
    """The key in ``path`` (hex, as ``ensure`` writes it, or raw bytes as a Secret may hold)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise KeyError_(f"cannot read the job's key {path}: {e.strerror or e}",
                        "run from the run directory's owner, or point ELASTIC_HARNESS_KEY_FILE at the "
                        "job's key (a Kubernetes Secret, Slurm: the run dir's job.key)") from None
    text = data.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = data  # a binary secret
    if len(key) < 16:
        raise KeyError_(f"the job's key {path} is too short ({len(key)} bytes)",
                        "use 32 random bytes, e.g. `openssl rand -hex 32 > job.key`")
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
