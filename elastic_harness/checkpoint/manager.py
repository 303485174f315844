"""Save and load training state through DCP, on every rank, with one commit point.

The checkpoint manager is four objects, one per job, built together by
``Checkpoints.build`` over one ``site.Site`` (the storage, the ranks and their checkpoint
process group, the event log, the job's identity and key, the progress callback, the
clock) and one ``site.Tenure`` (the generation joined, the steps in use: the only state
they share):

- ``Saver`` (here): saves, sync or async, staging, commit, failure judging, ``wait``, ``close``;
- ``restorer.Restorer``: ``restore`` (the newest complete checkpoint that verifies and
  loads), ``join``, ``newest_complete``;
- ``verifier.Verifier``: the shared listing, agreed verdicts, setting aside what fails;
- ``purger.Purger``: retention and leftovers after each commit (never a step in use).

A caller takes the part it uses (the step hook the saver, the resume the restorer).
Every rank calls every public method, in the same order (they run collectives on the
checkpoint process group). Rank 0 alone decides (which checkpoint to load, whether a step
directory may be written), writes the manifest, sets failed checkpoints aside and purges;
the others follow its broadcast decision. The parts are given rank, world size, group and
storage: they never ask ``torch.distributed`` who they are.

Call order: ``restorer.restore`` once per worker generation, first (it starts the generation
in the checkpoint directory, see ``fence``, and checks that every rank sees that directory),
or ``restorer.join`` alone when the state came from elsewhere (the in-memory tier); then
``saver.save`` any number of times; ``saver.wait`` before reading results; ``saver.close``
at the end (safe twice).

Who writes what: DCP splits the state so that each rank writes its own shards (replicated
DDP tensors are written once, spread over ranks), each rank checksumming its files as they
are written; rank 0 writes ``.metadata``, gathers every rank's report of what it wrote, and
commits (``manifest.json``) only if every reported file is on storage with its size, after
making ``.metadata`` and the directory entries durable. The manifest's checksums replace
the zip CRC32 that ``torch.save`` computes per record, so that one is switched off in the
threads that serialise (it cost a third of the write; torch keeps that setting per thread).

Asynchronous saves (the default for periodic saves): ``save`` blocks only while the state is
copied into host-memory staging buffers (see ``staging``; only what this rank writes, once the
save plans are cached), and meets no other rank meanwhile: no collective, no storage access.
Everything else runs in two background threads (``scheduling``: both yield the CPU to
training, and are raised back while anyone waits on them): the commit thread has the ranks
agree that the step may be written (rank 0 looks at its directory), the write thread runs DCP
(planning, serialising, writing and syncing the bytes) from the copy, and the commit thread
settles the save. Which tensors another rank writes is decided by each rank alone, from its
cached plans (``plans.written_elsewhere``): a rank whose state no longer plans as cached copies
everything. Should another rank's changed plan hand this rank a tensor it left out, the
planner refuses to write it: that save fails and is reported like any other, and the next one
plans anew. Save plans are cached per saver (``plans``). At most one save is in flight. The
group must be a dedicated gloo group: the background collectives would otherwise interleave
with training's and can deadlock.

Time: no fixed budgets. The site's ``ticker`` calls its callback (at most once a second, on
the calling thread) while a blocking call moves bytes: blocking saves, waits for an in-flight save,
verification and loading. A write whose rank moves no byte for ``stall_s`` is stopped
before its directory is touched (``progress.await_write``).

Failure policy: a failed periodic save (sync or async) is a ``failure`` event, its step
directory is removed, earlier checkpoints are untouched, and training goes on; the
job stops (``CheckpointError``) once saves have kept failing for ``checkpoint.give_up_after``
seconds and at least ``MAX_CONSECUTIVE_SAVE_FAILURES`` times in a row (``give_up``: with a save
every 10 steps, three failures took 0.3 s, and a full disk that brief ended the job; rank 0's
clock decides, in the broadcast that settles each save, so every rank stops alike). A failed
*blocking* save (the final save, the save on preemption) raises at once: the job cannot
claim its result was kept. A save of a step that already has a complete checkpoint is a
``skipped`` event; a save by a superseded generation is a ``fenced`` event (neither writes).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from elastic_harness.checkpoint import (
    collective,
    integrity,
    layout,
    plans,
)
from elastic_harness.checkpoint.failure_text import detail, one_line
from elastic_harness.checkpoint.progress import (
    BACKGROUND_POLL_S,
    POLL_S,
    Progress,
    await_write,
    on_callers_device,
    without_zip_crc,
)
from elastic_harness.checkpoint.purger import Purger
from elastic_harness.checkpoint.restorer import Restorer
from elastic_harness.checkpoint.scheduling import BackgroundThreads
from elastic_harness.checkpoint.site import FIX_STORAGE, SAVE_ERRORS, Site, Tenure
from elastic_harness.checkpoint.staging import ReusedBufferStager
from elastic_harness.checkpoint.streams import write_watch, written_files
from elastic_harness.checkpoint.verifier import Verifier
from elastic_harness.errors import CheckpointError
from elastic_harness.spec import CheckpointSpec
from elastic_harness.torchcompat import groups as live_groups

MAX_CONSECUTIVE_SAVE_FAILURES = 3
STALL_S = 300.0


def give_up(failures: int, failing_s: float, limit_s: float) -> bool:
    """Pure: stop the job after ``failures`` periodic saves in a row failed, the first
    ``failing_s`` seconds ago? At ``MAX_CONSECUTIVE_SAVE_FAILURES`` at least, and once they
    have failed for ``limit_s`` (``checkpoint.give_up_after``; 0: at once)."""
    return failures >= MAX_CONSECUTIVE_SAVE_FAILURES and failing_s >= limit_s


class Saver:
    """Every rank's part in each save (the module's doc: async saves, time, the failure
    policy): ``save``, ``wait``, ``raise_if_failing``, ``close``. It holds the background
    threads, the staging buffers and its cached save plans; after each commit rank 0's
    purger runs (in the commit thread)."""

    def __init__(self, site: Site, tenure: Tenure, policy: CheckpointSpec, verifier: Verifier, purger: Purger,
                 stall_s: float = STALL_S) -> None:
        self.tenure, self.verifier, self.purger = tenure, verifier, purger
        self.key = site.key
        self.storage, self.policy = site.storage, policy
        self.rank, self.world_size, self.group = site.ranks.rank, site.ranks.world_size, site.ranks.group
        self.events, self.info = site.events, site.info
        self.stall_s, self._clock = stall_s, site.clock
        self._ticker = site.ticker
        self._pending: cf.Future | None = None
        self._pending_watch: tuple[Any, str] = (None, "")
        self.threads = BackgroundThreads.here()
        self._plan_key = f"ckpt-{uuid.uuid4().hex}"  # this saver's entries in DCP's plan cache
        self._stager: Any = None
        self._failures, self._failing_since, self._give_up = 0, None, False  # saves failed in a row (``_judged``)
        self._outcome = ""  # every rank: the last settled save's ("ok", "fenced", "failed")
        self._waited_s = 0.0  # the save in flight's wait for the one before it (its blocking_s has it)
        self._last_failure = ""  # the newest failed save's one line (``failure_text``)
        self._closed = False

    # ----- save ------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, blocking: bool) -> bool:
        """Save ``state`` as step ``step``; async unless ``blocking`` or the policy says sync.

        Returns False if nothing was committed: the step already has a complete checkpoint
        (``skipped`` event), this generation was superseded (``fenced`` event), or a
        tolerated periodic save failed. Async: True once the copy is staged; whether it was
        written is said later, as for the write itself (``checkpoint``, ``skipped``, ``fenced``
        or ``failure`` event; ``wait`` raises past the failure limit).
        """
        t0 = time.perf_counter()  # training is blocked from here: a wait for the last save too
        self.wait()  # at most one save in flight
        self._waited_s = time.perf_counter() - t0
        name = layout.step_dirname(step)
        write = without_zip_crc(on_callers_device(dcp.save))
        if self.policy.async_save and not blocking:
            self._start_async(write, state, step, name, t0)
            return True
        self.tenure.join()
        action, detail = collective.decision(self._prepare_dir(name) if self.rank == 0 else None, self.group)
        if action != "go":
            self._not_written(step, name, action, detail)
            return False
        self.tenure.busy.add(step)
        writer = self.storage.writer(name)
        # Written in a thread so this one can watch progress (and report it) meanwhile.
        with self.threads.foreground():
            fut = self.threads.write(write, state, storage_writer=writer, process_group=self.group,
                                     planner=plans.planner(self._plan_key))
            ok = self._finish(fut, writer, step, name, t0, None, False)
        if not ok and blocking and self._outcome != "fenced":  # superseded: an event, not an error
            raise CheckpointError(
                f"the required checkpoint at step {step} could not be written ({self._last_failure}; "
                f"details in events.jsonl); {self._left()}", FIX_STORAGE)
        self.raise_if_failing()
        return ok

    def _not_written(self, step: int, name: str, action: str, detail: str, asynchronous: bool = False) -> None:
        """Rank 0 said ``name`` is not to be written (``_prepare_dir``, broadcast to every rank):
        an error (it could not look at the storage: a failure), or the ``skipped`` or ``fenced``
        event."""
        message = f"checkpoint at step {step} not written: {detail}"
        if action == "error":
            self._on_failure(step, name, CheckpointError(detail), asynchronous=asynchronous)
            if not asynchronous:  # (in the background: the next save or wait raises)
                self.raise_if_failing()
        elif self.rank == 0 and action == "skipped":
            self.events.emit("skipped", step=step, name=name, reason=detail, message=message)
        elif self.rank == 0:
            self.events.emit("fenced", step=step, name=name, reason=detail, message=message)

    def _start_async(self, write: Any, state: dict[str, Any], step: int, name: str, t0: float) -> None:
        """On the calling thread only what later optimizer steps could change: the copy of this
        rank's part of ``state`` (less what its cached plans have another rank write, as this
        rank alone decides: ``plans.written_elsewhere``) into the staging buffers. Then, in the
        commit thread, every rank: whether ``name`` may be written (rank 0's word, broadcast),
        DCP's write of the copy in the write thread, and the settling (``_finish``). The
        checkpoint group's collectives of one save follow one another there (this agreement,
        DCP's, the settling), and no other save's run meanwhile."""
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        staged = self._staging().stage(plain, plans.written_elsewhere(self._plan_key, plain) or frozenset())
        blocked = time.perf_counter() - t0
        # Both threads' collectives belong to this generation: one launched after an in-place
        # re-formation is refused (the save fails, uncommitted) instead of waiting for ranks
        # of the next generation, which never take part in it.
        write = live_groups.pinned(self.group, write)

        def in_background() -> bool:
            self.tenure.join()  # a generation that restored nothing enters the fence before it writes
            action, detail = collective.decision(self._prepare_dir(name) if self.rank == 0 else None, self.group)
            if action != "go":
                self._not_written(step, name, action, detail, asynchronous=True)
                return False
            self.tenure.busy.add(step)
            writer = self.storage.writer(name)
            self._pending_watch = (write_watch(writer), name)
            fut = self.threads.write(write, staged, storage_writer=writer, process_group=self.group,
                                     planner=plans.planner(self._plan_key))
            try:
                return self._finish(fut, writer, step, name, t0, blocked, True)
            finally:  # also when it was refused half-way (the group re-formed): never committed
                self.tenure.busy.discard(step)

        self._pending_watch = (None, name)
        self._pending = self.threads.commit(live_groups.pinned(self.group, in_background))

    def _staging(self) -> Any:
        """One reusable host-memory buffer set for async saves (pinned when CUDA is present)."""
        if self._stager is None:
            self._stager = ReusedBufferStager(pin_memory=torch.cuda.is_available())
        return self._stager

    def _prepare_dir(self, name: str) -> tuple[str, str]:
        """Rank 0: may ``name`` be written? Removes a stale incomplete dir of that name.

        Looks at ``name`` alone, and reads the fence only before removing something: a
        superseded generation learns it at its next commit (``_commit``) and remembers, so
        at worst one save's files are written in vain, never committed. (DCP itself refuses
        to write over a ``.metadata``.)
        ("go", ""), ("skipped", why), ("fenced", why) or ("error", why).
        """
        if self.tenure.fenced:
            return "fenced", self.tenure.fenced
        try:
            present = self._files(name)
            if present is None:
                return "go", ""
            if layout.scan({name: present}, require_manifest=True)[0].complete:
                return self._complete_in_the_way(name)
            fenced = self.tenure.superseded()
            if fenced:
                return "fenced", fenced
            self.events.emit("warning", message=f"removing stale incomplete {name}")
            self.storage.remove(name)
        except OSError as e:
            return "error", f"cannot prepare {self.storage.uri(name)}: {one_line(e)}"
        return "go", ""

    def _files(self, name: str) -> list[str] | None:
        """The files in step directory ``name``; None if there is no such directory."""
        try:
            return list(self.storage.files(name))
        except FileNotFoundError:
            return None

    def _complete_in_the_way(self, name: str) -> tuple[str, str]:
        """Rank 0: a complete ``name`` where this save would go: this job's (skipped), or one
        it did not sign, set aside (which reads the fence) so that it takes neither the step's
        name nor a keep slot."""
        if self.verifier.ours(name):
            return "skipped", f"a complete checkpoint {name} already exists"
        verdict = integrity.signed_by(self.storage, name, self.key)
        if not self.verifier.quarantine(name, f"{verdict.reason}; in the way of this job's checkpoint of that step",
                                         verdict.kind, move_unsigned=True):
            return "skipped", f"{name} is not this job's and could not be set aside"
        return "go", ""

    def _finish(self, fut: Any, writer: Any, step: int, name: str, t0: float, blocking_s: float | None,
                asynchronous: bool) -> bool:
        """Every rank (async: in the commit thread): wait for DCP's write, then settle.

        Progress is reported on the calling thread only when it is the caller's (blocking).
        """
        tick = self._ticker.tick if not asynchronous else (lambda: None)
        error = await_write(fut, write_watch(writer), stall_s=self.stall_s, tick=tick,
                            dir_bytes=lambda: sum(self.storage.files(name).values()),
                            poll_s=BACKGROUND_POLL_S if asynchronous else POLL_S)
        blocking_s = time.perf_counter() - t0 if blocking_s is None else blocking_s
        return self._settle(writer, step, name, error, t0, blocking_s, asynchronous)

    def _settle(self, writer: Any, step: int, name: str, error: BaseException | None, t0: float,
                blocking_s: float, asynchronous: bool) -> bool:
        """Every rank: rank 0 commits what every rank reported, if all wrote; all learn the outcome."""
        reports: list[Any] = [None] * self.world_size if self.rank == 0 else []
        mine = (written_files(writer), None if error is None else self._explain(error))
        dist.gather_object(mine, reports if self.rank == 0 else None, group=self.group, group_dst=0)
        outcome = self._judged(self._commit(step, name, reports)) if self.rank == 0 else None
        status, why, self._give_up = collective.broadcast(outcome, self.group)
        self._outcome = status
        self.tenure.busy.discard(step)
        if status == "fenced":
            if self.rank == 0:
                self.events.emit("fenced", step=step, name=name, reason=why,
                                 message=f"checkpoint at step {step} not committed: {why}")
            return False
        if status != "ok":
            self._on_failure(step, name, error or CheckpointError(why), asynchronous)
            return False
        self._failures, self._failing_since = 0, None
        if self.rank == 0:
            self.events.emit(
                "checkpoint", step=step, path=self.storage.uri(name), blocking_s=round(blocking_s, 4),
                waited_s=round(self._waited_s, 4), total_s=round(time.perf_counter() - t0, 4),
                asynchronous=asynchronous,
            )
            if asynchronous:  # already in the background thread
                self.purger.purge(step)
            else:  # deleting files is slow on some filesystems: keep it off the training path
                self._pending_watch = (None, "")
                self._pending = self.threads.commit(self.purger.purge, step)
        return True

    def _judged(self, outcome: tuple[str, str]) -> tuple[str, str, bool]:
        """Rank 0: ``outcome`` and whether a failure ends the streak's patience (``give_up``,
        from when its first failure settled: ``_failing_since``; every rank learns it)."""
        if outcome[0] != "failed":
            return (*outcome, False)
        now = self._clock()
        self._failing_since = now if self._failing_since is None else self._failing_since
        return (*outcome, give_up(self._failures + 1, now - self._failing_since, self.policy.give_up_after))

    def _commit(self, step: int, name: str, reports: list[Any]) -> tuple[str, str]:
        """Rank 0: write the manifest if every rank wrote and this generation is current.

        ("ok", ""), ("fenced", why) or ("failed", why).
        """
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(reports) if err]
        if errors:
            return "failed", "; ".join(errors)
        fenced = self.tenure.superseded()
        if fenced:
            return "fenced", fenced
        reported = {f: h for files, _ in reports for f, h in files.items()}
        try:
            info = {**self.info, "step": step, "world_size": self.world_size}
            integrity.write_manifest(self.storage, name, info, reported, key=self.key)
        except integrity.CommitRefused as e:
            return "failed", (f"files the ranks wrote are not all on {self.storage.uri(name)} ({e}); "
                              "is checkpoint.dir shared by every node?")
        except Exception as e:  # storage errors: a failed save like any other
            return "failed", one_line(e)
        return "ok", ""

    def _explain(self, err: BaseException) -> str:
        """``err`` in one line; the storage's free space names a full disk behind a short write."""
        return one_line(err, self.storage.free_bytes())

    def _on_failure(self, step: int, name: str, err: BaseException | None, asynchronous: bool) -> None:
        self._failures += 1
        why = self._explain(err) if err is not None else "another rank failed to write"
        self._last_failure = why
        if self.rank != 0:
            return
        self.events.emit(
            "failure", step=step, asynchronous=asynchronous, consecutive=self._failures,
            message=f"checkpoint at step {step} failed ({self._failures} in a row; the job stops after "
            f"{self.policy.give_up_after:.0f} s of failures, {MAX_CONSECUTIVE_SAVE_FAILURES} at least): {why}",
            detail=detail(err) if err is not None else why,
        )
        with contextlib.suppress(OSError):
            self.storage.remove(name)  # incomplete by definition, and every writer has stopped

    def raise_if_failing(self) -> None:
        if self._give_up:
            raise CheckpointError(
                f"{self._failures} checkpoint saves in a row failed, for {self.policy.give_up_after:.0f} s at least "
                f"(checkpoint.give_up_after; last: {self._last_failure}; details in events.jsonl); "
                f"stopping so no more work goes unsaved; {self._left()}",
                FIX_STORAGE,
            )

    def _left(self) -> str:
        """What a save failure leaves behind, as listed now: the complete checkpoints that are
        intact, or that none was complete yet (not "intact" checkpoints that never existed)."""
        try:
            done = layout.load_candidates(layout.scan(self.storage.listing(), require_manifest=True))
        except OSError:
            return f"the checkpoints already in {self.storage.root} were not touched"
        if not done:
            return f"no checkpoint of this job was complete in {self.storage.root} yet"
        return f"earlier checkpoints in {self.storage.root} are intact (the newest: {done[0].name})"

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the in-flight save (and its commit), if any; raise past the failure limit.

        Without ``timeout`` it waits as long as it takes: the commit thread itself stops a
        stalled write. ``on_progress`` is called meanwhile, while bytes move.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            with self.threads.foreground():
                self._await(pending, timeout)
        self.raise_if_failing()

    def _await(self, pending: cf.Future, idle_limit: float | None) -> Any:
        """Wait for ``pending``; give up (TimeoutError) after ``idle_limit`` s without progress."""
        watch, name = self._pending_watch
        dir_bytes = (lambda: sum(self.storage.files(name).values())) if name else None
        progress = Progress(watch, dir_bytes, time.monotonic)
        idle_since = time.monotonic()
        while not cf.wait([pending], timeout=0.05)[0]:
            if progress.moved():
                idle_since = time.monotonic()
                self._ticker.tick()
            elif idle_limit is not None and time.monotonic() - idle_since > idle_limit:
                raise TimeoutError(f"checkpoint save made no progress for {idle_limit:.0f} s")
        return pending.result()

    def close(self) -> None:
        """Finish the in-flight save, free the staging buffer; safe to call twice.

        Never raises for the save itself: its outcome is already an event, and ``close``
        runs on error paths where the original exception must win. Gives up after
        ``stall_s`` without progress.
        """
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                with self.threads.foreground():
                    self._await(pending, self.stall_s)
        except SAVE_ERRORS:
            pass
        finally:
            self.threads.shutdown()
            plans.forget(self._plan_key)
            if self._stager is not None:
                self._stager.close()


@dataclass(frozen=True)
class Checkpoints:
    """The manager's parts, built together over one ``Site`` (``build``): a caller takes the
    part it uses (the loop saves, the resume loads) and closes the saver at the end."""

    tenure: Tenure
    verifier: Verifier
    restorer: Restorer
    purger: Purger
    saver: Saver

    @classmethod
    def build(cls, site: Site, policy: CheckpointSpec, *, stall_s: float = STALL_S,
              verify_round_bytes: int = collective.ROUND_BYTES,
              optional_keys: frozenset[str] = frozenset()) -> Checkpoints:
        """``stall_s``: a write whose rank moves no byte that long is stopped
        (``progress.await_write``); ``verify_round_bytes``: each rank's share of a full
        verification per round (``collective.agreed_verdict``); ``optional_keys``: as
        ``Restorer``'s."""
        tenure = Tenure(site)
        verifier = Verifier(site, tenure, policy, verify_round_bytes)
        purger = Purger(site, tenure, verifier, policy)
        return cls(tenure, verifier, Restorer(site, tenure, verifier, optional_keys), purger,
                   Saver(site, tenure, policy, verifier, purger, stall_s))
