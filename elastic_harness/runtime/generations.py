"""Every process group of this worker, across generations: made live, left, re-formed.

A worker made by our agent joins its groups through ``torchcompat.groups``' backend
(``install``): the default group, the checkpoint group, a mesh's groups and any group a
script makes are ``LiveGroup``s, kept here in the order they were made (the same order on
every rank, as torch's own group creation requires). A fault then costs the survivors no
process:

1. ``leave(reason)``: the current generation ends on this rank: works in flight complete
   (nothing raises in the training code), connections close, so a collective blocked on a
   lost or frozen peer returns now.
2. ``reform(store, rank, world_size, tag)``: collective over the new membership: each
   group over every rank (the default group, the checkpoint group) gets a backend of the new
   generation on ``store`` under ``tag``, in the order they were made, at the new rank and
   size. Any other group (a mesh's) is ``stale`` from then on: what was built on it is
   built again (the training function runs again, ``runtime.inplace``), as a new worker of
   the generation builds it, and with it its groups.

Keys: a group's backend meets its peers under ``TAG/MEMBERS/N/`` of the generation's store
(``key_of``): its members (global ranks; ``w`` and the size for a group over every rank) and
how many live groups of the same members this process made before it. Not torch's group
name: torch numbers groups in the order a process made them, and a survivor that re-ran its
training function made more than a new worker has. A new worker (``begin`` names the store
and tag before torch makes its groups) and a survivor (``reform``) of one generation meet
under the same keys. The tag is the generation's store port (``tag_of``): a new store is
served for every generation, and a store still served by a survivor keeps its port, so no tag
repeats on one store.

A collective's failure anywhere in the generation is ``broken`` (first reason), told once to
``on_broken`` (the control channel tells the agent: a peer is lost).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch.distributed as dist

from elastic_harness.torchcompat import groups as tg


class Generations:
    def __init__(self, *, rank: int, world_size: int, timeout_s: float, cuda: Any = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout = dt.timedelta(seconds=timeout_s)
        self.cuda = cuda  # the CUDA device whose NCCL backend groups also get, or None
        self.made: list[tuple[tg.Lineage, tg.LiveGroup]] = []  # (lineage, first instance)
        self.tag = ""
        self.store: dist.Store | None = None  # the generation's store (``begin``/``reform``)
        self._broken_said = False
        self._raising = False
        self._lock = threading.Lock()
        self.on_broken: Callable[[str], None] = lambda reason: None

    # -- made by torch (``init_process_group`` / ``new_group`` with our backend) ------------
    def begin(self, store: dist.Store, tag: str) -> None:
        """The store and tag of the generation whose groups torch is about to make."""
        self.store, self.tag = store, tag

    def create(self, options: Any, backend_options: Any = None) -> tg.LiveGroup:
        """torch's backend registry calls this for every group (its extended form: the
        group's name comes with it)."""
        if self.store is None:
            raise RuntimeError("runtime.generations: begin() names the store before groups are made")
        name, rank, size = options.group_id, options.group_rank, options.group_size
        spans = size == self.world_size
        members = ("w",) if spans else tuple(options.global_ranks_in_group) or tuple(range(size))
        occurrence = sum(1 for other, _ in self.made if not other.stale and other.members == members)
        lineage = self._revived(members, occurrence)
        fresh = lineage is None
        if lineage is None:
            lineage = tg.Lineage(name, "", rank, size, spans_world=spans)
            lineage.members, lineage.occurrence = members, occurrence
            lineage.on_broken = self._broke
            lineage.raises = self._raising
        lineage.name, lineage.rank, lineage.size = name, rank, size
        lineage.names.append(name)
        inner = tg.build_inner(self._keys(lineage, size), rank, size, options.timeout, self.cuda)
        group = tg.make_group(lineage, inner)
        if fresh:
            self.made.append((lineage, group))
        else:
            tg.answer_for(lineage.names[:-1], group)
        return group

    def _revived(self, members: tuple, occurrence: int) -> tg.Lineage | None:
        """A stale group of the same members, made again by a training function run again
        in this process: it lives on as the new group (its old objects forward to it, and its
        old names resolve to it: DTensor keeps meshes it built in its caches, and a mesh equal
        to the new one may be found there, with the old groups' names)."""
        for lineage, _ in self.made:
            if lineage.stale and lineage.members == members and lineage.occurrence == occurrence:
                lineage.stale, lineage.broken = False, None
                return lineage
        return None

    def _keys(self, lineage: tg.Lineage, size: int, store: dist.Store | None = None, tag: str | None = None
              ) -> dist.Store:
        return dist.PrefixStore(key_of(tag or self.tag, lineage.members, size, lineage.occurrence),
                                store or self.store)

    def _broke(self, reason: str) -> None:
        with self._lock:
            first, self._broken_said = not self._broken_said, True
        if first:
            self.on_broken(reason)

    @property
    def broken(self) -> str | None:
        """Why the current generation cannot go on (the first failure or leave), or None."""
        for lineage, _ in self.made:
            if lineage.broken is not None and not lineage.stale:
                return lineage.broken
        return None

    # -- a fault --------------------------------------------------------------------------
    def leave(self, reason: str, spare: Collection[tg.Lineage] = ()) -> None:
        """End the current generation on this rank (any thread; twice is harmless). ``spare``:
        groups left running for now (their members all alive: the step's collectives within a
        node, ``inplace.Recovery``); the re-formation ends them (a mesh's groups go stale)."""
        for lineage, _ in self.made:
            if lineage not in spare:
                lineage.leave(reason)

    @contextlib.contextmanager
    def raising(self) -> Iterator[None]:
        """Groups made inside this block raise on a failed collective (the checkpoint group:
        a save must fail, never commit), instead of completing it as it is."""
        self._raising = True
        try:
            yield
        finally:
            self._raising = False

    def meshed(self) -> bool:
        """Does this process hold a group that is not over every rank (a mesh's)?"""
        return any(not lineage.spans_world and not lineage.stale for lineage, _ in self.made)

    def reform(self, store: dist.Store, rank: int, world_size: int, tag: str) -> list[str]:
        """Collective over the new membership: every group over every rank gets its next
        generation; the names of the other groups, left stale (module doc)."""
        stale: list[str] = []
        replaced: list[tg.LiveGroup] = []
        for lineage, first in self.made:
            if lineage.stale:
                continue
            r, s = rank, world_size
            if not lineage.spans_world:
                lineage.stale = True
                lineage.leave("a mesh group is built again in a new generation")
                stale.append(lineage.name)
                continue
            if lineage.inner is not None:  # left already on a fault; not on a planned change
                lineage.leave("re-formed")
            lineage.rank, lineage.size = r, s
            inner = tg.build_inner(self._keys(lineage, s, store, tag), r, s, self.timeout, self.cuda)
            old = lineage.current
            newest = tg.make_group(lineage, inner)
            ranks = (list(range(s)) if lineage.spans_world else dist.get_process_group_ranks(first))
            tg.adopt(first, newest, {g: i for i, g in enumerate(ranks)}, store)
            if old is not None and old is not first:
                replaced.append(old)
        tg.forget(replaced)
        self.rank, self.world_size, self.tag, self.store = rank, world_size, tag, store
        with self._lock:
            self._broken_said = False
        return stale


_CURRENT: Generations | None = None


def install(*, rank: int, world_size: int, timeout_s: float, cuda: Any = None) -> Generations:
    """This process's registry, and our backend in torch's (once per process)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Generations(rank=rank, world_size=world_size, timeout_s=timeout_s, cuda=cuda)
        tg.register(lambda options, backend_options: _CURRENT.create(options, backend_options), cuda is not None)
    return _CURRENT


def key_of(tag: str, members: tuple, size: int, occurrence: int) -> str:
    """Pure: where a group's backend meets its peers in a generation's store (module doc)."""
    if members == ("w",):
        who = f"w{size}"
    else:
        text = "-".join(map(str, members))
        who = f"r{text}" if len(text) <= 40 else "h" + hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"{tag}/{who}/{occurrence}/"


def tag_of(master_port: int) -> str:
    """Pure: the key prefix of the generation whose store serves on ``master_port``."""
    return f"g{master_port}"


def current() -> Generations | None:
    return _CURRENT
