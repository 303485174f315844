"""Save and load training state through DCP, on every rank, with one commit point.

Every rank calls every public method, in the same order (they run collectives on the
checkpoint process group passed in). Rank 0 alone decides (which checkpoint to load, whether
a step directory may be written), writes the manifest and purges; the others follow its
broadcast decision. The manager is given rank, world size, group and storage: it never asks
``torch.distributed`` who it is.

Who writes what: DCP splits the state so that each rank writes its own shards (replicated
DDP tensors are written once, spread over ranks), then rank 0 writes ``.metadata``; after
that rank 0 checksums the files into ``manifest.json``, the commit marker.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.compat import check_compatible
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import CheckpointError
from elastic_harness.spec import CheckpointSpec

# DCP's CheckpointException derives from BaseException: name it explicitly.
SAVE_ERRORS = (Exception, CheckpointException)
MAX_CONSECUTIVE_SAVE_FAILURES = 3
ASYNC_WAIT_S = 600.0


@dataclass(frozen=True)
class Loaded:
    step: int
    name: str
    manifest: dict
    seconds: float


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
        self._failures = 0
        self._closed = False

    # ----- decisions (rank 0), shared by broadcast -----------------------------------
    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _pick_verified(self, skip: set[str]) -> layout.StepDir | None:
        """Rank 0: newest complete checkpoint that verifies; warn about each skipped one."""
        dirs = layout.scan(self.storage.listing(), require_manifest=True)
        for d in [x for x in dirs if not x.complete and x.step > _newest_complete(dirs)]:
            self.events.emit("warning", message=f"ignoring incomplete checkpoint {d.name}")
        for cand in layout.load_candidates(dirs):
            if cand.name in skip:
                continue
            verdict = integrity.verify(self.storage, cand.name, self.policy.verify)
            if verdict.ok:
                return cand
            self.events.emit("warning", message=f"skipping {cand.name}: {verdict.reason}")
        return None

    # ----- load ------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> Loaded | None:
        """Load the newest complete, verified, loadable checkpoint into ``state``.

        Falls back to older ones when one fails to load; ``None`` when there is none.
        Raises ``CheckpointError`` for a checkpoint of another model or job.
        """
        failed: set[str] = set()
        while True:
            choice = self._pick_verified(failed) if self.rank == 0 else None
            choice = self._broadcast(choice)
            if choice is None:
                return None
            manifest = integrity.read_manifest(self.storage, choice.name) or {}
            check_compatible(self.storage.reader(choice.name), state, manifest, self.info)
            t0 = time.perf_counter()
            ok = 1
            try:
                dcp.load(state, storage_reader=self.storage.reader(choice.name), process_group=self.group)
            except SAVE_ERRORS as e:
                ok = 0
                if self.rank == 0:
                    self.events.emit("warning", message=f"loading {choice.name} failed: {e!r:.300}")
            if _all_ok(ok, self.group):
                return Loaded(choice.step, choice.name, manifest, time.perf_counter() - t0)
            failed.add(choice.name)

    # ----- save ------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, blocking: bool) -> bool:
        """Save ``state`` as step ``step``; async unless ``blocking`` or policy says sync.

        Returns False if the step already has a complete checkpoint (nothing written).
        A failed save is reported and tolerated up to a limit; the previous checkpoints
        stay as they were.
        """
        self.wait()  # at most one save in flight
        name = layout.step_dirname(step)
        go = self._prepare_dir(name) if self.rank == 0 else None
        if not self._broadcast(go):
            return False
        t0 = time.perf_counter()
        use_async = self.policy.async_save and not blocking
        try:
            writer = self.storage.writer(name)
            if use_async:
                fut = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                blocking_s = time.perf_counter() - t0
                self._pending = self._pool.submit(self._finish_async, fut, step, name, t0, blocking_s)
                return True
            dcp.save(state, storage_writer=writer, process_group=self.group)
        except SAVE_ERRORS as e:
            self._on_failure(step, name, e)
            return False
        self._commit(step, name, t0, time.perf_counter() - t0, asynchronous=False)
        return True

    def _prepare_dir(self, name: str) -> bool:
        """Rank 0: may ``name`` be written? Removes a stale incomplete dir of that name."""
        listing = self.storage.listing()
        if name in listing:
            d = layout.scan({name: listing[name]}, require_manifest=True)[0]
            if d.complete:
                return False
            self.events.emit("warning", message=f"removing stale incomplete {name}")
            self.storage.remove(name)
        return True

    def _finish_async(self, fut: Any, step: int, name: str, t0: float, blocking_s: float) -> None:
        done = getattr(fut, "upload_completion", fut)
        try:
            done.result(timeout=ASYNC_WAIT_S)
        except SAVE_ERRORS as e:
            self._on_failure(step, name, e)
            return
        self._commit(step, name, t0, blocking_s, asynchronous=True)

    def _commit(self, step: int, name: str, t0: float, blocking_s: float, asynchronous: bool) -> None:
        self._failures = 0
        if self.rank != 0:
            return
        info = {**self.info, "step": step, "world_size": self.world_size}
        integrity.write_manifest(self.storage, name, info)
        total = time.perf_counter() - t0
        self.events.emit(
            "checkpoint", step=step, path=self.storage.uri(name), blocking_s=round(blocking_s, 4),
            total_s=round(total, 4), asynchronous=asynchronous,
        )
        self._purge(protect={step})

    def _purge(self, protect: set[int]) -> None:
        dirs = layout.scan(self.storage.listing(), require_manifest=True)
        for d in layout.to_purge(dirs, self.policy.keep, self.policy.keep_every, protect):
            self.storage.remove(d.name)

    def _on_failure(self, step: int, name: str, err: BaseException) -> None:
        self._failures += 1
        if self.rank == 0:
            self.events.emit("failure", message=f"checkpoint at step {step} failed: {err!r:.400}")
            self.storage.remove(name)  # incomplete by definition: no manifest was written

    def raise_if_failing(self) -> None:
        if self._failures >= MAX_CONSECUTIVE_SAVE_FAILURES:
            raise CheckpointError(
                f"{self._failures} checkpoint saves in a row failed (see events.jsonl); "
                f"stopping so no more work goes unsaved; checkpoints in {self.storage.root} are intact",
                "free space or fix permissions on the checkpoint directory, then re-run to resume",
            )

    def wait(self, timeout: float = ASYNC_WAIT_S) -> None:
        """Wait for the in-flight save (and its commit), if any."""
        if self._pending is not None:
            self._pending.result(timeout=timeout)
            self._pending = None
        self.raise_if_failing()

    def close(self) -> None:
        """Finish the in-flight save; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None:
                self._pending.result(timeout=ASYNC_WAIT_S)
                self._pending = None
        finally:
            self._pool.shutdown(wait=True)


def _newest_complete(dirs: list[layout.StepDir]) -> int:
    return max((d.step for d in dirs if d.complete), default=-1)


def _all_ok(ok: int, group: Any) -> bool:
    import torch

    t = torch.tensor([ok], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
