"""The commit manifest: what a checkpoint holds, and proof that it is intact.

DCP has no checksums (flipped bytes in a shard load silently). After DCP has written
``.metadata``, rank 0 writes ``manifest.json`` listing every file the ranks *reported*
writing, with its size and checksum, plus what ``ckpt ls`` shows without reading shards
(step, world size). The manifest is the commit marker: a step directory without it is not a
checkpoint. A commit is refused when a reported file is missing on storage or has another
size (a checkpoint directory that is not shared between nodes looks like that).

The checksum is CRC32 (zlib): it catches the accidents this guards against (flipped bits,
truncated or torn files, a shard from another save) and runs 2-3x faster than sha256 here.
Manifests that list ``sha256`` (written before) are still verified with sha256.

Authenticity (docs/security.md): write access to a checkpoint directory must not be code
execution, yet DCP unpickles ``.metadata``. So the manifest carries ``sha256`` of
``.metadata`` besides its CRC32, and a ``signature``: HMAC-SHA256 with the job's key
(``jobkey``) over the whole manifest (every file's size and checksum, step, job) in a
canonical JSON form. ``authenticate`` checks the signature and then ``.metadata``'s sha256,
in every verify mode, before anything in the step directory is deserialized. A manifest
without a signature (``unsigned``: written before signing, or by another tool) or with a
wrong one (``forged``: tampered with, or another job's key) fails. Callers that pass no key
vouch for the checkpoint themselves (``ckpt ... --trust``, tests); ``sign`` re-signs a
checkpoint the user trusts (``ckpt trust``).
Limit: shards are covered by their CRC32, which the signature authenticates but which is
not collision-resistant: someone who can write shards and forge a CRC32 can still change
tensor values and DCP's pickled non-tensor items (``docs/security.md``).

Cost: each rank checksums its own shards while DCP writes them (``streams``), so the
commit reads nothing large back, which matters for object stores. Verification modes trade
safety for load time: ``full`` re-checksums everything, ``size`` only compares sizes
(catches truncation and missing files, not flipped bytes), ``none`` only requires the
manifest. ``verify`` checks in one process (``ckpt`` commands); the verifier splits a full
check over all ranks with ``shares`` and ``ShareCheck``, a bounded number of bytes per round.

Unreadable files (EACCES, EIO) give a failed ``Verdict`` of kind ``unreadable``, never an
exception: a resume falls back from them exactly as from corruption.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_harness import jobkey
from elastic_harness.checkpoint.layout import MANIFEST, METADATA, scan
from elastic_harness.checkpoint.streams import CHECKSUM, Crc32
from elastic_harness.errors import os_reason

if TYPE_CHECKING:
    from collections.abc import Callable

    from elastic_harness.checkpoint.storage import Storage

MANIFEST_VERSION = 1
VERIFY_MODES = ("full", "size", "none")
_CHUNK = 8 << 20
_MAX_THREADS = 8


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    kind: str = ""  # on failure: "corrupt", "unreadable" or "uncommitted"


class CommitRefused(Exception):
    """A reported file is missing or differs on storage: the checkpoint is not committed."""


def _new(kind: str) -> Any:
    return Crc32() if kind == "crc32" else hashlib.new(kind)


def _covered(filename: str) -> bool:
    """Files the manifest lists: everything but itself and hidden temp files."""
    return filename == METADATA or not (filename == MANIFEST or filename.startswith("."))


def _unreadable(filename: str, e: OSError) -> Verdict:
    return Verdict(False, f"{filename} is unreadable ({os_reason(e)})", "unreadable")


def checksum_of(storage: Storage, name: str, filename: str, kind: str = CHECKSUM) -> str:
    h = _new(kind)
    with storage.open_read(name, filename) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checksum_files(storage: Storage, name: str, todo: dict[str, str]) -> dict[str, str]:
    """``{filename: digest}`` for ``todo`` ``{filename: kind}``, one thread per file (up to 8)."""
    files = sorted(todo)
    threads = max(1, min(_MAX_THREADS, len(files), os.cpu_count() or 1))
    if threads == 1:
        return {f: checksum_of(storage, name, f, todo[f]) for f in files}
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="ckpt-sum") as pool:
        return dict(zip(files, pool.map(lambda f: checksum_of(storage, name, f, todo[f]), files), strict=True))


# ----- commit -------------------------------------------------------------------------------
def commit_problems(reported: dict[str, dict], present: dict[str, int]) -> list[str]:
    """Pure: why the reported files cannot be committed (empty list: they can)."""
    problems = []
    for f, want in sorted(reported.items()):
        if f not in present:
            problems.append(f"{f} is missing")
        elif present[f] != want["size"]:
            problems.append(f"{f} has {present[f]} bytes, its writer reported {want['size']}")
    return problems


def build_manifest(storage: Storage, name: str, info: dict, reported: dict | None = None) -> dict:
    """The manifest of ``name``.

    ``reported`` ``{file: {size, crc32}}``: what the ranks said they wrote (checksummed as it
    went out); the manifest lists exactly those plus ``.metadata``, and ``CommitRefused`` is
    raised if any is missing or has another size on storage. Without ``reported`` (one
    process wrote it all), every file on storage is listed and checksummed.
    """
    present = {f: s for f, s in sorted(storage.files(name).items()) if _covered(f)}
    if reported is None:
        listed = dict(present)
        known: dict = {}
    else:
        known = {f: r for f, r in reported.items() if _covered(f)}
        problems = commit_problems(known, present)
        if METADATA not in present:
            problems.append(f"{METADATA} is missing")
        if problems:
            raise CommitRefused("; ".join(problems[:5]))
        listed = {f: present[f] for f in {*known, METADATA}}
    todo = {f: CHECKSUM for f in listed if CHECKSUM not in known.get(f, {})}
    digests = {**{f: known[f][CHECKSUM] for f in listed if f not in todo}, **checksum_files(storage, name, todo)}
    files = {f: {"size": listed[f], CHECKSUM: digests[f]} for f in sorted(listed)}
    files[METADATA]["sha256"] = checksum_of(storage, name, METADATA, "sha256")  # small; unpickled first
    return {"version": MANIFEST_VERSION, "created": time.time(), **info, "checksum": CHECKSUM, "files": files}


def write_manifest(storage: Storage, name: str, info: dict, reported: dict | None = None,
                   key: bytes | None = None) -> dict:
    """Commit ``name``: make ``.metadata`` and the directory entries durable, then write the
    manifest (atomically), signed with ``key`` (unsigned without: tests, benchmarks).
    Raises ``CommitRefused`` (see ``build_manifest``) or ``OSError``."""
    manifest = build_manifest(storage, name, info, reported)
    if key is not None:
        manifest = sign(manifest, key)
    storage.make_durable(name, [METADATA])
    storage.write_atomic(name, MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(storage: Storage, name: str) -> dict | None:
    manifest, _ = load_manifest(storage, name)
    return manifest


def load_manifest(storage: Storage, name: str) -> tuple[dict | None, Verdict]:
    """The manifest, or None with a failed verdict saying why (missing, unreadable, garbled)."""
    try:
        manifest = json.loads(storage.read_bytes(name, MANIFEST))
    except FileNotFoundError:
        return None, Verdict(False, "manifest missing or unreadable", "uncommitted")
    except OSError as e:
        return None, _unreadable(MANIFEST, e)
    except ValueError:
        return None, Verdict(False, "manifest missing or unreadable", "corrupt")
    if not isinstance(manifest, dict):
        return None, Verdict(False, "manifest missing or unreadable", "corrupt")
    return manifest, Verdict(True)


# ----- authenticity --------------------------------------------------------------------------
SIGNATURE = "signature"
_CONTEXT = b"checkpoint-manifest"
UNSIGNED = ("unsigned checkpoint (not signed with this run's key: written before checkpoints were "
            "signed, by another tool, or planted by someone who can write the checkpoint directory); if you "
            "know where it came from, review it with 'elastic-harness ckpt trust RUN_DIR --step N', which shows "
            "what it holds and asks before it signs, else remove it")
TRUST_ONE = "'elastic-harness ckpt trust RUN_DIR --step N' reviews one you trust and signs it"


def _signed_bytes(manifest: dict) -> bytes:
    """Pure: the canonical form the signature covers (everything but the signature)."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: dict, key: bytes) -> dict:
    """Pure: ``manifest`` with its signature under ``key``."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return {**body, SIGNATURE: jobkey.sign_hex(key, _signed_bytes(body), _CONTEXT)}


def check_signature(manifest: dict, key: bytes) -> Verdict:
    """Pure: the manifest is signed with ``key`` and lists a sha256 for ``.metadata``."""
    signature = manifest.get(SIGNATURE)
    if not signature:
        return Verdict(False, UNSIGNED, "unsigned")
    if not isinstance(signature, str) or not jobkey.check_hex(key, _signed_bytes(manifest), signature, _CONTEXT):
        return Verdict(False, "manifest signature does not match this job's key (tampered with, or "
                              f"another job's checkpoint: {TRUST_ONE})", "forged")
    if not isinstance((manifest.get("files") or {}).get(METADATA, {}).get("sha256"), str):
        return Verdict(False, "signed manifest lists no sha256 of .metadata", "forged")
    return Verdict(True)


def authenticate(storage: Storage, name: str, manifest: dict, key: bytes | None) -> Verdict:
    """Before anything in ``name`` is deserialized: the signature, then ``.metadata`` against
    its signed sha256 (it is small). ``key`` None: the caller vouches for the checkpoint."""
    if key is None:
        return Verdict(True)
    verdict = check_signature(manifest, key)
    if not verdict.ok:
        return verdict
    try:
        data = storage.read_bytes(name, METADATA)
    except FileNotFoundError:
        return Verdict(False, f"{METADATA} is missing", "corrupt")
    except OSError as e:
        return _unreadable(METADATA, e)
    want = manifest["files"][METADATA]
    if len(data) != want.get("size"):
        return Verdict(False, f"{METADATA} has {len(data)} bytes, expected {want.get('size')}", "corrupt")
    if hashlib.sha256(data).hexdigest() != want["sha256"]:
        # the signature holds, so the manifest is ours: the file changed after the commit
        return Verdict(False, f"{METADATA} differs from its signed sha256 (corrupt or tampered with)", "corrupt")
    return Verdict(True)


def signed_by(storage: Storage, name: str, key: bytes) -> Verdict:
    """Is ``name``'s manifest signed with ``key`` (this job's own checkpoint)? Reads only the
    manifest: what retention and a save of the same step ask."""
    manifest, verdict = load_manifest(storage, name)
    return check_signature(manifest, key) if manifest is not None else verdict


def signed_steps(storage: Storage, key: bytes | None) -> tuple[list[str], list[str]]:
    """(complete checkpoints whose manifest carries a signature, oldest first; those of them
    signed with ``key``). Reads manifests only; ``OSError`` if the root cannot be listed."""
    signed, ours = [], []
    for d in scan(storage.listing(), require_manifest=True):
        manifest = read_manifest(storage, d.name) if d.complete else None
        if manifest is not None and manifest.get(SIGNATURE):
            signed.append(d.name)
            if key is not None and check_signature(manifest, key).ok:
                ours.append(d.name)
    return signed, ours


def trust(storage: Storage, name: str, key: bytes, reviewed: dict | None = None,
          metadata_sha256: str | None = None) -> Verdict:
    """Sign ``name`` with ``key`` because the user vouches for it (``ckpt trust``): only a
    checkpoint that passes a full check against its own manifest; ``.metadata``'s sha256
    is added if missing. With ``reviewed`` (the manifest the user was shown) and
    ``metadata_sha256`` (the ``.metadata`` whose contents were shown), a checkpoint that
    changed since is refused: what is signed is what was reviewed. Nothing is deserialized."""
    verdict = verify(storage, name, "full")
    if not verdict.ok:
        return verdict
    manifest = read_manifest(storage, name) or {}
    try:
        sha = checksum_of(storage, name, METADATA, "sha256")
        if reviewed is not None and manifest != reviewed or metadata_sha256 not in (None, sha):
            return Verdict(False, "it changed after it was shown: review it again", "corrupt")
        manifest["files"][METADATA]["sha256"] = sha
        storage.write_atomic(name, MANIFEST, json.dumps(sign(manifest, key), indent=1).encode())
    except OSError as e:
        return _unreadable(name, e)
    return Verdict(True)


def check_sizes(manifest: dict, actual: dict[str, int]) -> Verdict:
    """Pure: every listed file present with its size (``actual`` is a listing)."""
    listed = manifest.get("files") or {}
    if METADATA not in listed:
        return Verdict(False, "manifest does not list .metadata", "corrupt")
    for filename, want in sorted(listed.items()):
        if filename not in actual:
            return Verdict(False, f"{filename} is missing", "corrupt")
        if actual[filename] != want["size"]:
            return Verdict(False, f"{filename} has {actual[filename]} bytes, expected {want['size']}", "corrupt")
    return Verdict(True)


def _kinds(listed: dict) -> dict[str, str]:
    return {f: ("crc32" if "crc32" in w else "sha256") for f, w in listed.items()}


def verify(storage: Storage, name: str, mode: str = "full", key: bytes | None = None) -> Verdict:
    """Check a step directory against its manifest, in this process: its signature with
    ``key`` (``authenticate``; None: the caller vouches for it), then ``mode``. Never
    raises OSError."""
    assert mode in VERIFY_MODES, mode
    manifest, verdict = load_manifest(storage, name)
    if manifest is None:
        return verdict
    verdict = authenticate(storage, name, manifest, key)
    if not verdict.ok or mode == "none":
        return verdict
    try:
        verdict = check_sizes(manifest, storage.files(name))
        if not verdict.ok or mode == "size":
            return verdict
        listed = manifest["files"]
        kinds = _kinds(listed)
        digests = checksum_files(storage, name, kinds)
    except OSError as e:
        return _unreadable(getattr(e, "filename", None) or name, e)
    for filename in sorted(listed):
        if digests[filename] != listed[filename][kinds[filename]]:
            return Verdict(False, f"{filename} checksum mismatch (corrupt)", "corrupt")
    return Verdict(True)


# ----- verification split over ranks -----------------------------------------------------
def shares(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Pure: the files each rank checksums, balanced by bytes (largest first, to the lightest)."""
    load = [0] * world_size
    out: list[list[str]] = [[] for _ in range(world_size)]
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        out[r].append(f)
        load[r] += sizes[f]
    return out


def rounds_needed(sizes: dict[str, int], parts: list[list[str]], round_bytes: int) -> int:
    """Pure: rounds of at most ``round_bytes`` per rank until the biggest share is done."""
    biggest = max((sum(sizes[f] for f in part) for part in parts), default=0)
    return max(1, -(-biggest // round_bytes))


class ShareCheck:
    """Checksum one rank's share of a manifest's files, ``advance(n)`` bytes at a time.

    Call order: ``advance`` once per round (all ranks run the same number of rounds), then
    read ``verdict``. Reading stops at the first mismatch or unreadable file; ``on_bytes``
    is called with the number of bytes read after every chunk.
    """

    def __init__(self, storage: Storage, name: str, manifest: dict, files: list[str],
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self._storage, self._name, self._on_bytes = storage, name, on_bytes
        self._listed = manifest.get("files") or {}
        self._kinds = _kinds({f: self._listed[f] for f in files})
        self._todo = list(files)
        self._sum: Any = None
        self._offset = 0
        self.verdict = Verdict(True)

    def advance(self, budget: int) -> bool:
        """Read up to ``budget`` bytes; False once a failure is found."""
        while self.verdict.ok and self._todo and budget > 0:
            filename = self._todo[0]
            try:
                budget -= self._read(filename, budget)
            except OSError as e:
                self.verdict = _unreadable(filename, e)
        return self.verdict.ok

    def _read(self, filename: str, budget: int) -> int:
        """Go on reading ``filename`` where the last round stopped; finish it at its end."""
        if self._sum is None:
            self._sum, self._offset = _new(self._kinds[filename]), 0
        used = 0
        with self._storage.open_read(self._name, filename) as f:
            f.seek(self._offset)
            while used < budget:
                chunk = f.read(min(_CHUNK, budget - used))
                if not chunk:
                    self._finish(filename)
                    break
                self._sum.update(chunk)
                used += len(chunk)
                self._offset += len(chunk)
                if self._on_bytes is not None:
                    self._on_bytes(len(chunk))
        return used

    def _finish(self, filename: str) -> None:
        if self._sum.hexdigest() != self._listed[filename][self._kinds[filename]]:
            self.verdict = Verdict(False, f"{filename} checksum mismatch (corrupt)", "corrupt")
        self._todo.pop(0)
        self._sum = None
