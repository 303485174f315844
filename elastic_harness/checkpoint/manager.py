"""Save and load training state through DCP, on every rank, with one commit point.

Every rank calls every public method, in the same order (they run collectives on the
checkpoint process group passed in). Rank 0 alone decides (which checkpoint to load, whether
a step directory may be written), writes the manifest and purges; the others follow its
broadcast decision. The manager is given rank, world size, group and storage: it never asks
``torch.distributed`` who it is.

Who writes what: DCP splits the state so that each rank writes its own shards (replicated
DDP tensors are written once, spread over ranks), each rank checksumming its files as they
are written; rank 0 writes ``.metadata``, gathers the checksums and writes
``manifest.json``, the commit marker; every rank learns whether the commit landed (one
all-reduce), so all ranks count failures alike.
The manifest's checksums replace the zip CRC32 that ``torch.save`` computes per record, so
that one is switched off in processes that create a manager (it cost a third of the write).

Asynchronous saves (the default for periodic saves): ``save`` blocks only while the state is
copied into host-memory staging buffers (pinned when CUDA is present; allocated once and
reused, see ``staging``), then DCP writes from that copy in a background thread and the commit follows in a
second one. At most one save is in flight: the next ``save``, ``wait`` and ``close`` wait
for it first. The group must be a dedicated gloo group: the background collectives would
otherwise interleave with training's and can deadlock.

Failure policy: a failed periodic save (sync or async) is a ``failure`` event, its step
directory is removed, earlier checkpoints are untouched, and training goes on; the
``MAX_CONSECUTIVE_SAVE_FAILURES``-th failure in a row raises ``CheckpointError``. A failed
*blocking* save (the final save, the save on preemption) raises at once: the job cannot
claim its result was kept.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.compat import check_compatible
from elastic_harness.checkpoint.integrity import written_files
from elastic_harness.checkpoint.staging import ReusedBufferStager
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import CheckpointError
from elastic_harness.spec import CheckpointSpec

# DCP's CheckpointException derives from BaseException: name it explicitly.
SAVE_ERRORS = (Exception, CheckpointException)
MAX_CONSECUTIVE_SAVE_FAILURES = 3
ASYNC_WAIT_S = 600.0
CLOSE_WAIT_S = 120.0


@dataclass(frozen=True)
class Loaded:
    step: int
    name: str
    manifest: dict
    seconds: float


def stale_incomplete(dirs: list[layout.StepDir], below: int) -> list[layout.StepDir]:
    """Incomplete step directories older than step ``below``: leftovers of interrupted saves.

    Only called right after step ``below`` committed, when no other save of this job is in
    flight, so none of these is being written.
    """
    return [d for d in dirs if not d.complete and d.step < below]


class CheckpointManager:
    def __init__(
        self,
        storage: Storage,
        policy: CheckpointSpec,
        *,
        rank: int,
        world_size: int,
        group: Any,
        events: Any,
        info: dict,
    ) -> None:
        self.storage, self.policy = storage, policy
        self.rank, self.world_size, self.group = rank, world_size, group
        self.events, self.info = events, info
        self._pending: cf.Future | None = None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self._stager: Any = None
        self._busy: set[int] = set()  # steps being loaded or written: never purged
        self._failures = 0
        self._closed = False
        torch.serialization.set_crc32_options(False)

    # ----- decisions (rank 0), shared by broadcast -----------------------------------
    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _pick_verified(self, skip: set[str]) -> tuple[layout.StepDir | None, int]:
        """Rank 0: newest complete checkpoint that verifies, and how many complete ones exist.

        Warns about each newer one passed over (incomplete, failed verification).
        """
        dirs = layout.scan(self.storage.listing(), require_manifest=True)
        candidates = layout.load_candidates(dirs)
        choice = None
        for cand in candidates:
            if cand.name in skip:
                continue
            verdict = integrity.verify(self.storage, cand.name, self.policy.verify)
            if verdict.ok:
                choice = cand
                break
            self.events.emit("warning", message=f"skipping {cand.name}: {verdict.reason}")
        floor = choice.step if choice is not None else -1
        for d in dirs:
            if not d.complete and d.step > floor:
                self.events.emit("warning", message=f"ignoring incomplete checkpoint {d.name} (interrupted save: .metadata or manifest missing)")
        return choice, len(candidates)

    # ----- load ------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> Loaded | None:
        """Load the newest complete, verified, loadable checkpoint into ``state``.

        Falls back to older ones when one fails to verify or load; ``None`` when there is
        no complete checkpoint at all. Raises ``CheckpointError`` for a checkpoint of another
        model or job, and when complete checkpoints exist but none is usable (starting over
        silently would throw their work away; ``--fresh`` does that on purpose).
        """
        failed: set[str] = set()
        while True:
            choice, complete = self._pick_verified(failed) if self.rank == 0 else (None, 0)
            choice, complete = self._broadcast((choice, complete))
            if choice is None:
                if complete:
                    raise CheckpointError(
                        f"none of the {complete} checkpoints in {self.storage.root} is usable "
                        "(see the warning events)",
                        "restore a good copy, or re-run with --fresh to start over",
                    )
                return None
            self._busy.add(choice.step)
            try:
                loaded = self._load(choice, state)
            finally:
                self._busy.discard(choice.step)
            if loaded is not None:
                return loaded
            failed.add(choice.name)

    def _load(self, choice: layout.StepDir, state: dict[str, Any]) -> Loaded | None:
        """Every rank: load ``choice`` into ``state``; ``None`` on every rank if any failed.

        DCP reads into the tensors of ``state`` on whatever device they live (shards are
        deserialised on CPU first), so a checkpoint saved on GPUs loads on CPUs and back.
        """
        manifest = integrity.read_manifest(self.storage, choice.name) or {}
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            check_compatible(self.storage.reader(choice.name), state, manifest, self.info)
            dcp.load(state, storage_reader=self.storage.reader(choice.name), process_group=self.group)
        except CheckpointError:
            raise
        except SAVE_ERRORS as e:  # unreadable metadata, a shard that fails to deserialise
            error = e
        if _all_ok(int(error is None), self.group):
            return Loaded(choice.step, choice.name, manifest, time.perf_counter() - t0)
        if self.rank == 0:
            why = f"{error!r:.300}" if error is not None else "another rank failed to read it"
            self.events.emit("warning", message=f"loading {choice.name} failed: {why}")
        return None

    # ----- save ------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, blocking: bool) -> bool:
        """Save ``state`` as step ``step``; async unless ``blocking`` or the policy says sync.

        Returns False if nothing was committed: the step already has a complete checkpoint,
        or a tolerated periodic save failed. Async: True once the write started.
        """
        self.wait()  # at most one save in flight
        name = layout.step_dirname(step)
        go = self._broadcast(self._prepare_dir(name) if self.rank == 0 else None)
        if go is not True:
            if go:  # rank 0 could not even look at the storage: a failed save like any other
                self._on_failure(step, name, CheckpointError(go), asynchronous=False)
                self.raise_if_failing()
            return False
        t0 = time.perf_counter()
        self._busy.add(step)
        writer = self.storage.writer(name)
        if self.policy.async_save and not blocking:
            fut = dcp.async_save(
                state, storage_writer=writer, process_group=self.group,
                async_stager=self._staging(),
            )
            self._pending = self._pool.submit(self._finish_async, fut, writer, step, name, t0, time.perf_counter() - t0)
            return True
        error: BaseException | None = None
        try:
            dcp.save(state, storage_writer=writer, process_group=self.group)
        except SAVE_ERRORS as e:
            error = e
        ok = self._settle(writer, step, name, error, t0, time.perf_counter() - t0, asynchronous=False)
        if not ok and blocking:
            raise CheckpointError(
                f"the required checkpoint at step {step} could not be written (see the failure "
                f"event); earlier checkpoints in {self.storage.root} are intact",
                "free space or fix permissions on the checkpoint directory, then re-run to resume",
            )
        self.raise_if_failing()
        return ok

    def _staging(self) -> Any:
        """One reusable host-memory buffer set for async saves (pinned when CUDA is present)."""
        if self._stager is None:
            self._stager = ReusedBufferStager(pin_memory=torch.cuda.is_available())
        return self._stager

    def _prepare_dir(self, name: str) -> bool | str:
        """Rank 0: may ``name`` be written? Removes a stale incomplete dir of that name.

        True: go; False: a complete checkpoint of that step exists; a string: why the
        storage could not be prepared.
        """
        try:
            listing = self.storage.listing()
            if name in listing:
                d = layout.scan({name: listing[name]}, require_manifest=True)[0]
                if d.complete:
                    return False
                self.events.emit("warning", message=f"removing stale incomplete {name}")
                self.storage.remove(name)
        except OSError as e:
            return f"cannot prepare {self.storage.uri(name)}: {e!r:.300}"
        return True

    def _finish_async(self, fut: Any, writer: Any, step: int, name: str, t0: float, blocking_s: float) -> bool:
        """Background thread, every rank: wait for DCP's write, then commit."""
        error: BaseException | None = None
        try:
            fut.result(timeout=ASYNC_WAIT_S)
        except SAVE_ERRORS as e:  # includes TimeoutError
            error = e
        return self._settle(writer, step, name, error, t0, blocking_s, asynchronous=True)

    def _settle(
        self, writer: Any, step: int, name: str, error: BaseException | None, t0: float,
        blocking_s: float, asynchronous: bool,
    ) -> bool:
        """Every rank: rank 0 commits if its write succeeded; all ranks agree on the outcome.

        DCP returns on rank 0 only after every rank's shards and ``.metadata`` are written,
        so rank 0 may commit on its own result; the all-reduce tells the others.
        """
        hashes: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(written_files(writer), hashes if self.rank == 0 else None, group=self.group, group_dst=0)
        if error is None and self.rank == 0:
            known = {f: h for part in hashes for f, h in (part or {}).items()}
            try:
                info = {**self.info, "step": step, "world_size": self.world_size}
                integrity.write_manifest(self.storage, name, info, known)
            except Exception as e:
                error = e
        ok = _all_ok(int(error is None), self.group)
        self._busy.discard(step)
        if not ok:
            self._on_failure(step, name, error, asynchronous)
            return False
        self._failures = 0
        if self.rank == 0:
            self.events.emit(
                "checkpoint", step=step, path=self.storage.uri(name), blocking_s=round(blocking_s, 4),
                total_s=round(time.perf_counter() - t0, 4), asynchronous=asynchronous,
            )
            if asynchronous:  # already in the background thread
                self._purge(step)
            else:  # deleting files is slow on some filesystems: keep it off the training path
                self._pending = self._pool.submit(self._purge, step)
        return True

    def _purge(self, committed: int) -> None:
        """Rank 0, right after ``committed``: retention, then leftovers of crashed saves."""
        try:
            dirs = layout.scan(self.storage.listing(), require_manifest=True)
            protect = self._busy | {committed}
            doomed = layout.to_purge(dirs, self.policy.keep, self.policy.keep_every, protect)
            for d in doomed + stale_incomplete(dirs, committed):
                if d.step not in protect:
                    self.storage.remove(d.name)
        except OSError as e:  # a purge that fails costs space, not correctness
            self.events.emit("warning", message=f"purging old checkpoints failed: {e!r:.300}")

    def _on_failure(self, step: int, name: str, err: BaseException | None, asynchronous: bool) -> None:
        self._failures += 1
        if self.rank != 0:
            return
        why = f"{err!r:.400}" if err is not None else "another rank failed to write"
        self.events.emit(
            "failure", step=step, asynchronous=asynchronous, consecutive=self._failures,
            message=f"checkpoint at step {step} failed ({self._failures} in a row, "
            f"limit {MAX_CONSECUTIVE_SAVE_FAILURES}): {why}",
        )
        with contextlib.suppress(OSError):
            self.storage.remove(name)  # incomplete by definition: no manifest was written

    def raise_if_failing(self) -> None:
        if self._failures >= MAX_CONSECUTIVE_SAVE_FAILURES:
            raise CheckpointError(
                f"{self._failures} checkpoint saves in a row failed (see events.jsonl); "
                f"stopping so no more work goes unsaved; checkpoints in {self.storage.root} are intact",
                "free space or fix permissions on the checkpoint directory, then re-run to resume",
            )

    def wait(self, timeout: float = ASYNC_WAIT_S) -> None:
        """Wait for the in-flight save (and its commit), if any; raise past the failure limit."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result(timeout=timeout)
        self.raise_if_failing()

    def close(self) -> None:
        """Finish the in-flight save (bounded), free the staging buffer; safe to call twice.

        Never raises for the save itself: its outcome is already an event, and ``close``
        runs on error paths where the original exception must win.
        """
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result(timeout=CLOSE_WAIT_S)
        except SAVE_ERRORS:
            pass
        finally:
            self._pool.shutdown(wait=False)
            if self._stager is not None:
                self._stager.close()


def _all_ok(ok: int, group: Any) -> bool:
    t = torch.tensor([ok], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
