"""Save and load training state through DCP, on every rank, with one commit point.

Every rank calls every public method, in the same order (they run collectives on the
checkpoint process group passed in). Rank 0 alone decides (which checkpoint to load, whether
a step directory may be written), writes the manifest, sets failed checkpoints aside and
purges; the others follow its broadcast decision. The manager is given rank, world size,
group and storage: it never asks ``torch.distributed`` who it is.

Call order: ``restore`` once per worker generation, first (it starts the generation in the
checkpoint directory, see ``fence``, and checks that every rank sees that directory), or
``join`` alone when the state came from elsewhere (the in-memory tier); then
``save`` any number of times; ``wait`` before reading results; ``close`` at the end (safe
twice).

Who writes what: DCP splits the state so that each rank writes its own shards (replicated
DDP tensors are written once, spread over ranks), each rank checksumming its files as they
are written; rank 0 writes ``.metadata``, gathers every rank's report of what it wrote, and
commits (``manifest.json``) only if every reported file is on storage with its size, after
making ``.metadata`` and the directory entries durable. The manifest's checksums replace
the zip CRC32 that ``torch.save`` computes per record, so that one is switched off in the
threads that serialise (it cost a third of the write; torch keeps that setting per thread).

Asynchronous saves (the default for periodic saves): ``save`` blocks only while the state is
copied into host-memory staging buffers (see ``staging``; only what this rank writes, once the
save plans are cached), then DCP plans and serialises from that copy in a background thread,
which writes and syncs the bytes, and the commit follows in a second thread (``scheduling``:
both threads yield the CPU to training, and are raised back while anyone waits on them).
Save plans are cached per manager (``plans``). At most one save is in flight. The group must be a dedicated gloo
group: the background collectives would otherwise interleave with training's and can
deadlock.

Time: no fixed budgets. ``on_progress()`` is called (at most once a second, on the calling
thread) while a blocking call moves bytes: blocking saves, waits for an in-flight save,
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from elastic_harness.checkpoint import (
    collective,
    fence,
    integrity,
    layout,
    plans,
    quarantine,
)
from elastic_harness.checkpoint.compat import check_compatible
from elastic_harness.checkpoint.failure_text import detail, one_line
from elastic_harness.checkpoint.progress import (
    BACKGROUND_POLL_S,
    POLL_S,
    Progress,
    Ticker,
    await_write,
    on_callers_device,
    without_zip_crc,
)
from elastic_harness.checkpoint.safe_load import WeightsOnlyLoadPlanner
from elastic_harness.checkpoint.scheduling import BackgroundThreads
from elastic_harness.checkpoint.staging import ReusedBufferStager
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.checkpoint.streams import Counter, watch_reader, write_watch, written_files
from elastic_harness.errors import CheckpointError, os_reason
from elastic_harness.spec import CheckpointSpec

# DCP's CheckpointException derives from BaseException: name it explicitly.
SAVE_ERRORS = (Exception, CheckpointException)
MAX_CONSECUTIVE_SAVE_FAILURES = 3
STALL_S = 300.0
_FIX_STORAGE = "free space or fix permissions on the checkpoint directory, then re-run to resume"


def give_up(failures: int, failing_s: float, limit_s: float) -> bool:
    """Pure: stop the job after ``failures`` periodic saves in a row failed, the first
    ``failing_s`` seconds ago? At ``MAX_CONSECUTIVE_SAVE_FAILURES`` at least, and once they
    have failed for ``limit_s`` (``checkpoint.give_up_after``; 0: at once)."""
    return failures >= MAX_CONSECUTIVE_SAVE_FAILURES and failing_s >= limit_s


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
        on_progress: Callable[[], None] | None = None,
        stall_s: float = STALL_S,
        verify_round_bytes: int = collective.ROUND_BYTES,
        clock: Callable[[], float] = time.time,
        key: bytes | None = None,
        optional_keys: frozenset[str] = frozenset(),
    ) -> None:
        # ``optional_keys``: flattened state keys a checkpoint may lack (fields added later,
        # whose current value is what an older checkpoint meant: ``safe_load``).
        self.optional_keys = optional_keys
        # ``key``: the job's (``jobkey``); commits are signed with it and a checkpoint not
        # signed with it is refused before it is read. None: unsigned, trusted (tests, benches).
        self.key = key
        self.storage, self.policy = storage, policy
        self.rank, self.world_size, self.group = rank, world_size, group
        self.events, self.info = events, info
        self.stall_s, self.verify_round_bytes, self._clock = stall_s, verify_round_bytes, clock
        self._ticker = Ticker(on_progress)
        self._pending: cf.Future | None = None
        self._pending_watch: tuple[Any, str] = (None, "")
        self.threads = BackgroundThreads.here()
        self._plan_key = f"ckpt-{uuid.uuid4().hex}"  # this manager's entries in DCP's plan cache
        self._stager: Any = None
        self._busy: set[int] = set()  # steps being loaded or written: never purged
        self._generation: fence.Generation | None = None
        self._fenced = ""  # rank 0: why this generation was found superseded (for good)
        self._failures, self._failing_since, self._give_up = 0, None, False  # saves failed in a row (``_judged``)
        self._outcome = ""  # every rank: the last settled save's ("ok", "fenced", "failed")
        self._last_failure = ""  # the newest failed save's one line (``failure_text``)
        self._closed = False

    # ----- load ------------------------------------------------------------------------
    def restore(self, state: dict[str, Any]) -> Loaded | None:
        """Load the newest complete, verified, loadable checkpoint into ``state``.

        Checkpoints that fail verification or loading are set aside (``quarantine`` event)
        and the next older one is tried; ``None`` when there is no complete checkpoint at
        all. Raises ``CheckpointError`` (on every rank) for a checkpoint of another model or
        job, when the ranks do not share the checkpoint directory, and when complete
        checkpoints existed but none is usable (``--fresh`` starts over on purpose).
        """
        self.join()
        unusable: set[str] = set()
        unloadable: list[tuple[str, str]] = []  # set aside only once an older one loads
        seen_complete = None
        unsigned = False
        while True:
            choice = layout.choose(self._shared_listing(), self._verify, exclude=unusable)
            seen_complete = choice.complete if seen_complete is None else seen_complete
            self._report_skipped(choice)
            unusable |= {s.name for s in choice.failed}
            unsigned = unsigned or any(s.kind == "unsigned" for s in choice.failed)
            if choice.chosen is None:
                self._report_unloadable(unloadable, set_aside=False)
                if seen_complete:
                    raise CheckpointError(
                        f"none of the {seen_complete} checkpoints in {self.storage.root} is usable "
                        "(see the quarantine and warning events)",
                        "an unsigned one (an older run's, another tool's, or planted) loads only once you have "
                        "reviewed it with 'elastic-harness ckpt trust RUN_DIR --step N'; or re-run with --fresh "
                        "to start over"
                        if unsigned else "restore a good copy, or re-run with --fresh to start over",
                    )
                return None
            loaded, why = self._load(choice.chosen, state)
            if loaded is not None:
                self._report_unloadable(unloadable, set_aside=True)
                return loaded
            unusable.add(choice.chosen.name)
            unloadable.append((choice.chosen.name, why))

    def newest_complete(self) -> int | None:
        """Collective: the step of the newest complete checkpoint listed (not verified), the
        same on every rank; None if none."""
        candidates = layout.load_candidates(layout.scan(self._shared_listing(), True))
        return candidates[0].step if candidates else None

    def join(self) -> None:
        """Start this worker generation in the checkpoint directory (the fence), once; every
        rank. ``restore`` calls it; call it first when the state is restored from memory.
        ``save`` calls it before a generation's first write, for a generation that restored
        nothing (the survivors that finished the step in flight in place)."""
        if self._generation is None:
            self._generation = collective.join_generation(
                self.storage, str(self.info.get("job", "")), rank=self.rank, world_size=self.world_size,
                group=self.group)

    def _report_unloadable(self, unloadable: list[tuple[str, str]], set_aside: bool) -> None:
        """Rank 0: checkpoints that verified but failed to load. They are set aside only when an
        older one loaded (the fault is theirs); if none loads, the fault may be this job's code
        or environment, and they stay where they are."""
        for name, why in unloadable if self.rank == 0 else ():
            if set_aside:
                self._quarantine(name, f"loading failed: {why}", "unloadable")
            else:
                self.events.emit("warning", message=f"skipping {name}: loading failed: {why} (left in place: "
                                 "no checkpoint loaded, the fault may not be the checkpoint's)")

    def _shared_listing(self) -> dict[str, list[str]]:
        """Rank 0 lists the root; every rank gets the same listing (or the same error)."""
        listing: Any = None
        if self.rank == 0:
            try:
                listing = self.storage.listing()
            except OSError as e:
                listing = f"cannot list {self.storage.root}: {os_reason(e)}"
        listing = collective.broadcast(listing, self.group)
        if isinstance(listing, str):
            raise CheckpointError(listing, _FIX_STORAGE)
        return listing

    def _verify(self, name: str) -> integrity.Verdict:
        return collective.agreed_verdict(
            self.storage, name, self.policy.verify, collective.Ranks(self.rank, self.world_size, self.group),
            round_bytes=self.verify_round_bytes, on_bytes=self._ticker.tick, key=self.key)

    def _report_skipped(self, choice: layout.Choice) -> None:
        """Rank 0: set failed checkpoints aside; warn about newer incomplete ones."""
        if self.rank != 0:
            return
        for s in choice.failed:
            self._quarantine(s.name, s.reason, s.kind)
        for s in choice.incomplete:
            self.events.emit("warning", message=f"ignoring incomplete checkpoint {s.name} ({s.reason})")

    def _quarantine(self, name: str, reason: str, kind: str, move_unsigned: bool = False) -> str | None:
        """Rank 0: move a checkpoint that cannot be used where nothing will load or count it
        (an unsigned one stays, unless ``move_unsigned``); its new name, or None."""
        return quarantine.set_aside(self.storage, name, reason, kind, events=self.events, now=self._clock(),
                                    blocked=self._superseded(), move_unsigned=move_unsigned)

    def _load(self, choice: layout.StepDir, state: dict[str, Any]) -> tuple[Loaded | None, str]:
        """Every rank: load ``choice`` into ``state``; ``(None, why)`` on every rank if any failed.

        Compatibility is agreed first (a rank that cannot read ``.metadata`` says so instead
        of leaving), then DCP loads (its own collectives share errors between ranks).
        DCP reads into the tensors of ``state`` on whatever device they live (shards are
        deserialised on CPU first), so a checkpoint saved on GPUs loads on CPUs and back.
        """
        t0 = time.perf_counter()
        self._busy.add(choice.step)
        try:
            manifest = integrity.read_manifest(self.storage, choice.name) or {}
            mismatch, error = self._compatible(choice.name, state, manifest)
            agreed = collective.all_min(0 if mismatch else 1 if error else 2, self.group)
            if agreed == 0:
                raise mismatch or CheckpointError(
                    f"{self.storage.uri(choice.name)} does not match this job on another rank",
                    "see that rank's failure event; use a new --run-dir or --fresh for another model")
            if agreed == 2:
                try:
                    reader = watch_reader(self.storage.reader(choice.name), Counter(self._ticker.tick))
                    dcp.load(state, storage_reader=reader, process_group=self.group,
                             planner=WeightsOnlyLoadPlanner(self.optional_keys))
                except SAVE_ERRORS as e:  # a shard that fails to deserialise, unreadable files
                    error = e
            ok = collective.all_min(int(error is None and agreed == 2), self.group) == 1
        finally:
            self._busy.discard(choice.step)
        if ok:
            return Loaded(choice.step, choice.name, manifest, time.perf_counter() - t0), ""
        return None, one_line(error) if error is not None else "another rank failed to read it"

    def _compatible(self, name: str, state: dict, manifest: dict) -> tuple[CheckpointError | None, BaseException | None]:
        """(why ``name`` belongs to another model or job, why it could not be read)."""
        try:
            check_compatible(self.storage.reader(name), state, manifest, self.info)
        except CheckpointError as e:
            return e, None
        except SAVE_ERRORS as e:  # unreadable or garbled .metadata
            return None, e
        return None, None

    # ----- save ------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, blocking: bool) -> bool:
        """Save ``state`` as step ``step``; async unless ``blocking`` or the policy says sync.

        Returns False if nothing was committed: the step already has a complete checkpoint
        (``skipped`` event), this generation was superseded (``fenced`` event), or a
        tolerated periodic save failed. Async: True once the write started.
        """
        self.wait()  # at most one save in flight
        self.join()  # a generation that restored nothing enters the fence before it writes
        name = layout.step_dirname(step)
        t0 = time.perf_counter()
        asynchronous = self.policy.async_save and not blocking
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()} if asynchronous else {}
        skip = plans.written_elsewhere(self._plan_key, plain) if asynchronous else None
        said = collective.all_gather((self._prepare_dir(name) if self.rank == 0 else None, skip is not None),
                                     self.group, self.world_size)
        action, detail = said[0][0]
        if action != "go":
            self._not_written(step, name, action, detail)
            return False
        self._busy.add(step)
        writer = self.storage.writer(name)
        write = without_zip_crc(on_callers_device(dcp.save))
        if asynchronous:
            # What dcp.async_save does, in our write thread: a copy training cannot change
            # (of what this rank writes, when every rank's cached plan still holds).
            agreed = all(same for _, same in said)
            self._start_async(write, writer, plain, skip if agreed else frozenset(), step, name, t0)
            return True
        # Written in a thread so this one can watch progress (and report it) meanwhile.
        with self.threads.foreground():
            fut = self.threads.write(write, state, storage_writer=writer, process_group=self.group,
                                     planner=plans.planner(self._plan_key))
            ok = self._finish(fut, writer, step, name, t0, None, False)
        if not ok and blocking and self._outcome != "fenced":  # superseded: an event, not an error
            raise CheckpointError(
                f"the required checkpoint at step {step} could not be written ({self._last_failure}; "
                f"details in events.jsonl); {self._left()}", _FIX_STORAGE)
        self.raise_if_failing()
        return ok

    def _not_written(self, step: int, name: str, action: str, detail: str) -> None:
        """Rank 0 said ``name`` is not to be written (``_prepare_dir``): an error (it could
        not look at the storage: a failure), or the ``skipped`` or ``fenced`` event."""
        message = f"checkpoint at step {step} not written: {detail}"
        if action == "error":
            self._on_failure(step, name, CheckpointError(detail), asynchronous=False)
            self.raise_if_failing()
        elif self.rank == 0 and action == "skipped":
            self.events.emit("skipped", step=step, name=name, reason=detail, message=message)
        elif self.rank == 0:
            self.events.emit("fenced", step=step, name=name, reason=detail, message=message)

    def _start_async(self, write: Any, writer: Any, plain: dict[str, Any], skip: frozenset, step: int,
                     name: str, t0: float) -> None:
        """Stage this rank's part of ``plain`` (less what ``skip`` says another rank writes),
        then write and commit it in the background."""
        staged = self._staging().stage(plain, skip)
        blocked = time.perf_counter() - t0
        fut = self.threads.write(write, staged, storage_writer=writer, process_group=self.group,
                                 planner=plans.planner(self._plan_key))
        self._pending_watch = (write_watch(writer), name)
        self._pending = self.threads.commit(self._finish, fut, writer, step, name, t0, blocked, True)

    def _staging(self) -> Any:
        """One reusable host-memory buffer set for async saves (pinned when CUDA is present)."""
        if self._stager is None:
            self._stager = ReusedBufferStager(pin_memory=torch.cuda.is_available())
        return self._stager

    def _superseded(self) -> str:
        """Rank 0: why this generation may no longer change the directory ("" if it may).
        Reads the fence until it says so once: a generation never becomes current again."""
        if self._fenced:
            return self._fenced
        try:
            self._fenced = fence.superseded(self._generation, fence.read(self.storage) if self._generation else None)
        except OSError as e:
            return f"the generation record cannot be read: {os_reason(e)}"
        return self._fenced

    def _prepare_dir(self, name: str) -> tuple[str, str]:
        """Rank 0: may ``name`` be written? Removes a stale incomplete dir of that name.

        Looks at ``name`` alone, and reads the fence only before removing something: a
        superseded generation learns it at its next commit (``_commit``) and remembers, so
        at worst one save's files are written in vain, never committed. (DCP itself refuses
        to write over a ``.metadata``.)
        ("go", ""), ("skipped", why), ("fenced", why) or ("error", why).
        """
        if self._fenced:
            return "fenced", self._fenced
        try:
            present = self._files(name)
            if present is None:
                return "go", ""
            if layout.scan({name: present}, require_manifest=True)[0].complete:
                return self._complete_in_the_way(name)
            fenced = self._superseded()
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
        if self._ours(name):
            return "skipped", f"a complete checkpoint {name} already exists"
        verdict = integrity.signed_by(self.storage, name, self.key)
        if not self._quarantine(name, f"{verdict.reason}; in the way of this job's checkpoint of that step",
                                verdict.kind, move_unsigned=True):
            return "skipped", f"{name} is not this job's and could not be set aside"
        return "go", ""

    def _ours(self, name: str) -> bool:
        """Rank 0: is ``name`` this job's (signed with its key)? True without a key (tests,
        benches: everything is trusted there)."""
        return self.key is None or integrity.signed_by(self.storage, name, self.key).ok

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
        self._busy.discard(step)
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
                total_s=round(time.perf_counter() - t0, 4), asynchronous=asynchronous,
            )
            if asynchronous:  # already in the background thread
                self._purge(step)
            else:  # deleting files is slow on some filesystems: keep it off the training path
                self._pending_watch = (None, "")
                self._pending = self.threads.commit(self._purge, step)
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
        fenced = self._superseded()
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

    def _purge(self, committed: int) -> None:
        """Rank 0, right after ``committed``: retention, then leftovers of crashed saves.

        The fence is not read again: the commit read it moments ago. A generation that
        started since is still restoring, from the newest checkpoint, which is kept (keep >= 2),
        and has written nothing a leftover could be."""
        try:
            dirs = layout.scan(self.storage.listing(), require_manifest=True)
            protect = self._busy | {committed}
            foreign = {d.name for d in dirs if d.complete and not self._ours(d.name)}
            doomed = layout.to_purge(dirs, self.policy.keep, self.policy.keep_every, protect, foreign)
            for d in doomed + stale_incomplete(dirs, committed):
                if d.step not in protect:
                    self.storage.remove(d.name)
        except OSError as e:  # a purge that fails costs space, not correctness
            self.events.emit("warning", message=f"purging old checkpoints failed: {e!r:.300}")

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
                _FIX_STORAGE,
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
