"""Process groups whose backend can be replaced under the objects that hold them.

Every group a harness worker uses (the default group, the checkpoint group, a mesh's
groups, the groups a script makes with ``new_group``) is a ``LiveGroup``: a Python subclass
of torch's ``ProcessGroup``, made by torch's own backend registry (``register``: the
backend name ``BACKEND`` in ``init_process_group``/``new_group``). Its operations run on an
inner backend (gloo; NCCL for CUDA tensors) that belongs to one worker generation, and
return works whose completion the harness owns (``HeldWork``):

- a collective that fails (a peer died) completes without raising and marks the lineage
  broken: DDP's reducer, FSDP's waits and the script's own ``work.wait()`` return, and the
  step is thrown away by the loop (``runtime.lineage`` says how);
- ``Lineage.leave`` completes every pending work and ends the generation's connections:
  gloo cannot abort a collective in flight (``abort()`` returns, the op waits out its whole
  timeout), but a ``shutdown`` of the generation's connected sockets makes every op blocked
  on them fail at once (a frozen peer resets nothing); NCCL's own ``abort`` where CUDA runs;
- ``Lineage.attach`` gives the group a new generation's backend (the same membership on a
  new store prefix, or, for a group over every rank, a new rank and size): DDP, FSDP2 and
  DTensor keep the group objects they hold.

Operations that torch dispatches in C++ to the backend registered for a device (functional
collectives: DTensor, tensor parallelism, ``clip_grad_norm_`` over DTensors) reach the
backend registered on the group object their group *name* resolves to. torch keeps the first
backend registered for a type, so each generation gets a new ``LiveGroup`` instance with its
own registered backend, and the group's name is re-registered to it (``_adopt``); older
instances, held by DDP or FSDP, forward their Python-level operations to the newest.

Private torch names used here (probed as ``live-groups``): ``ProcessGroup._register_backend``,
``_set_default_backend``, ``distributed_c10d._world`` (its ``pg_map``, ``pg_names``,
``pg_group_ranks``, ``pg_backend_config``), ``_register_process_group``,
``_unregister_process_group``, ``torch.distributed._Work`` (a Python work's base),
``DistributedDataParallel._update_process_group``. Without them a fault restarts every
worker (``recovery: restart``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from elastic_harness.torchcompat.probe import attrs, feature

BACKEND = "harness"  # the backend name every group of a harness worker is made with
_PINS = threading.local()  # per thread: {id(lineage): the generation its operations belong to}


@feature("live-groups", "in-place recovery",
         "every fault restarts every worker of the job (recovery: restart)")
def _check() -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    return (attrs(dist.ProcessGroup, "_register_backend", "_set_default_backend", label="ProcessGroup")
            + attrs(dist, "_Work", label="torch.distributed")
            + attrs(c10d, "_world", "_register_process_group", "_unregister_process_group",
                    "_get_default_group", label="distributed_c10d")
            + attrs(dist.Backend, "_plugins", label="Backend")
            + attrs(DistributedDataParallel, "_update_process_group", label="DistributedDataParallel"))


class Inner:
    """One generation's backends of a group, by device type, and the sockets gloo opened."""

    def __init__(self, backends: dict[str, Any], sockets: frozenset[int]) -> None:
        self.backends = backends
        self.sockets = sockets

    def for_device(self, device_type: str) -> Any:
        return self.backends.get(device_type) or self.backends["cpu"]

    def end(self) -> None:
        """End this generation's connections: blocked operations fail now."""
        shutdown_connected(self.sockets)
        nccl = self.backends.get("cuda")
        if nccl is not None and nccl is not self.backends.get("cpu"):
            with contextlib.suppress(Exception):  # an aborted communicator may raise again
                nccl.abort()


def open_sockets() -> set[int]:
    """This process's socket descriptors."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
    return found


def shutdown_connected(fds: Iterable[int]) -> int:
    """``shutdown`` every connected, non-listening socket among ``fds``; how many. gloo's
    listener must stay: a failed ``accept`` aborts the process."""
    done = 0
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            sock.getpeername()
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.close()
    return done


def build_inner(store: dist.Store, rank: int, size: int, timeout: dt.timedelta,
                cuda: torch.device | None = None) -> Inner:
    """A generation's backends: gloo (every CPU tensor), and NCCL on ``cuda`` when given.
    gloo connects its full mesh while it is built: the sockets that appear meanwhile are its."""
    before = open_sockets()
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    backends: dict[str, Any] = {"cpu": gloo}
    if cuda is not None:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backends["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    return Inner(backends, frozenset(open_sockets() - before))


class HeldWork(dist._Work):
    """A collective's work, completed when its inner work completes or when the lineage
    leaves its generation. A failure marks the lineage broken; it raises only on a lineage
    that ``raises`` (the harness's checkpoint group: a save must fail, not commit), else the
    work completes with its tensors as they are (the training code runs on; the step is
    thrown away)."""

    def __init__(self, lineage: Lineage, result: Any) -> None:
        super().__init__()
        self._lineage, self._result = lineage, result
        self._future: torch.futures.Future = torch.futures.Future()
        self._done = threading.Event()
        self.failed = False
        self._refused: str | None = None  # why it was never launched on this generation (``refuse``)

    def follow(self, inner: Any) -> HeldWork:
        """Complete when ``inner`` does (a work, or a list of works: when all did, or at the
        first failure): its future, or the lineage's waiter thread."""
        works = inner if isinstance(inner, list) else [inner]
        self._left = len(works)
        self._count = threading.Lock()
        if not works:
            self.complete(None)
        for work in works:
            try:
                future = work.get_future()
            except RuntimeError:  # some gloo works have none
                self._lineage.wait_for(work, self)
            else:
                future.add_done_callback(self._inner_done)
        return self

    def _inner_done(self, future: torch.futures.Future) -> None:
        try:
            future.value()
        except Exception as e:  # noqa: BLE001 - a peer's failure, reported to the lineage
            self.one_done(e)
        else:
            self.one_done(None)

    def one_done(self, error: BaseException | None) -> None:
        """One of the inner works completed."""
        with self._count:
            self._left -= 1
            last = self._left <= 0
        if last or error is not None:
            self.complete(error)

    def complete(self, error: BaseException | str | None, ran: bool = True) -> None:
        """Done: its inner operation completed (``ran``; ``error`` if it failed), or it was
        left or never launched (``ran`` False: its outputs are not the collective's)."""
        if not self._lineage.settle(self):
            return
        if error is not None or not ran:
            self._lineage.skipped += 1
        if error is not None:
            self.failed = True
            self._lineage.broke(error)
        self._done.set()
        if self.failed and self._lineage.raises:
            self._future.set_exception(RuntimeError(f"collective failed: {self._lineage.broken}"))
        else:
            self._future.set_result(self._result)

    def refuse(self, reason: str) -> None:
        """Done without launching, and failed, the lineage's generation untouched: an operation
        of a generation already left (``Lineage.pinned``). It raises on a lineage that
        ``raises``, and is not counted in ``skipped`` (not this generation's collective)."""
        if not self._lineage.settle(self):
            return
        self.failed, self._refused = True, reason
        self._done.set()
        if self._lineage.raises:
            self._future.set_exception(RuntimeError(f"collective refused: {reason}"))
        else:
            self._future.set_result(self._result)

    def wait(self, timeout: dt.timedelta | None = None) -> bool:
        self._done.wait()
        if self.failed and self._lineage.raises:
            raise RuntimeError(f"collective refused: {self._refused}" if self._refused
                               else f"collective failed: {self._lineage.broken}")
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and not self.failed

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result


class Lineage:
    """One logical group across generations: its name, its members, its current instance
    and backend, the works in flight. Thread-safe: works complete on backend threads."""

    def __init__(self, name: str, desc: str, rank: int, size: int, spans_world: bool) -> None:
        self.name, self.desc, self.rank, self.size = name, desc, rank, size
        self.spans_world = spans_world  # made over every rank: re-formable at any world size
        self.members: tuple = ()  # its global ranks (("w",) for every rank), for its keys
        self.occurrence = 0  # how many live groups of the same members were made before it
        self.raises = False  # a failed work raises (the checkpoint group) instead of completing
        self.names: list[str] = []  # every torch name it had, the current last
        self.inner: Inner | None = None
        self.current: LiveGroup | None = None
        self.broken: str | None = None  # why the current generation cannot be used
        self.stale = False  # its members no longer exist as such (a mesh after a resize)
        self.on_broken: Callable[[str], None] = lambda reason: None
        # works that completed without their operation's result (failed, left, or never
        # launched), across generations: a caller compares counts around its collectives
        self.skipped = 0
        # asked with an all-reduce's tensors and options before it is launched: True, and the
        # all-reduce is not launched but completes as it is (``runtime.inflight`` defers HSDP's
        # replica all-reduce of a step's gradients to the step's end, where it runs it itself)
        self.defer: Callable[[Any, Any], bool] | None = None
        self.generation = 0  # how many backends it had (``attach``): a pinned operation's reference
        self._lock = threading.Lock()
        self._pending: set[HeldWork] = set()
        self._waits: queue.SimpleQueue | None = None

    # -- generations -------------------------------------------------------------------
    def attach(self, inner: Inner, rank: int, size: int) -> None:
        """The next generation's backend; the generation is usable again."""
        self.inner, self.rank, self.size, self.broken = inner, rank, size, None
        self.generation += 1

    def pinned(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, whose collectives on this lineage belong to the generation current now,
        whichever thread runs it and whenever: one it launches once that generation was
        left is refused (``HeldWork.refuse``), not launched on the next one. A background
        checkpoint save is one: its collectives follow one another over seconds, and one
        launched after an in-place re-formation would wait forever for the new members,
        which never make it (a worker hung at a join, its save half-way)."""
        generation = self.generation

        def run(*args: Any, **kwargs: Any) -> Any:
            pins = _PINS.__dict__.setdefault("by_lineage", {})
            before = pins.get(id(self))
            pins[id(self)] = generation
            try:
                return fn(*args, **kwargs)
            finally:
                if before is None:
                    pins.pop(id(self), None)
                else:
                    pins[id(self)] = before

        return run

    def _left_since_pinned(self) -> str | None:
        """Why an operation the calling thread launches is refused (``pinned``); None if it is not."""
        pinned = _PINS.__dict__.get("by_lineage", {}).get(id(self))
        if pinned is None or pinned == self.generation:
            return None
        return (f"group {self.name!r} re-formed (generation {self.generation}) since this operation's work began "
                f"(generation {pinned})")

    def leave(self, reason: str) -> Inner | None:
        """End the current generation: mark it broken, complete what is pending, end its
        connections. The old backend, for the caller to drop; None if there was none."""
        inner, self.inner = self.inner, None
        if self.broken is None:
            self.broken = reason
        with self._lock:
            pending = list(self._pending)
        for work in pending:
            work.complete(f"left: {reason}" if self.raises else None, ran=False)
        if inner is not None:
            inner.end()
        return inner

    def broke(self, error: BaseException | str) -> None:
        first = self.broken is None
        if first:
            self.broken = str(error) or type(error).__name__
            self.on_broken(self.broken)

    # -- works -------------------------------------------------------------------------
    def start(self, device_type: str, result: Any, launch: Callable[[Any], Any]) -> HeldWork:
        """Launch an operation on the current backend; a completed work (nothing done)
        when the generation is broken or the launch itself fails."""
        if self.stale:  # a bug of ours: what was built on it should have been built again
            raise RuntimeError(f"collective on group {self.name!r} of a past generation (a mesh built for "
                               "another membership)")
        work = HeldWork(self, result)
        with self._lock:
            self._pending.add(work)
        left = self._left_since_pinned()
        if left is not None:
            work.refuse(left)
            return work
        inner = self.inner
        if inner is None or self.broken is not None:
            work.complete(self.broken or "the group has no backend (between generations)", ran=False)
            return work
        try:
            return work.follow(launch(inner.for_device(device_type)))
        except BaseException:  # refused at launch (an op this backend lacks): the caller's error
            self.settle(work)
            raise

    def deferred(self, result: Any) -> HeldWork:
        """A work completed at once, nothing launched (``defer``): not a skipped one."""
        work = HeldWork(self, result)
        with self._lock:
            self._pending.add(work)
        work.complete(None)
        return work

    def settle(self, work: HeldWork) -> bool:
        """Remove ``work`` from the pending set; False if it was settled already."""
        with self._lock:
            if work not in self._pending:
                return False
            self._pending.discard(work)
            return True

    def wait_for(self, inner_work: Any, work: HeldWork) -> None:
        """Works without a future: one daemon thread per lineage waits for them in order."""
        with self._lock:
            if self._waits is None:
                self._waits = queue.SimpleQueue()
                threading.Thread(target=self._waiter, args=(self._waits,), daemon=True,
                                 name=f"harness-wait-{self.name}").start()
        self._waits.put((inner_work, work))

    @staticmethod
    def _waiter(waits: queue.SimpleQueue) -> None:
        while True:
            inner_work, work = waits.get()
            try:
                inner_work.wait()
            except Exception as e:  # noqa: BLE001 - reported through the work
                work.one_done(e)
            else:
                work.one_done(None)


def _device(tensors: Any) -> str:
    """The device type of the first tensor in a (nested) list of tensors."""
    while isinstance(tensors, (list, tuple)):
        if not tensors:
            return "cpu"
        tensors = tensors[0]
    return tensors.device.type if isinstance(tensors, torch.Tensor) else "cpu"


def _opts(opts: Any, kind: type, **defaults: Any) -> Any:
    if opts is None or isinstance(opts, dist.ReduceOp):
        made = kind()
        if isinstance(opts, dist.ReduceOp):
            made.reduceOp = opts
        for k, v in defaults.items():
            setattr(made, k, v)
        return made
    return opts


class LiveGroup(dist.ProcessGroup):
    """torch's view of a lineage (see the module docstring). Every method torch's Python
    API or C++ trampoline calls for a collective is here, under each name torch 2.11-2.15
    uses for it."""

    def __init__(self, lineage: Lineage) -> None:
        super().__init__(lineage.rank, lineage.size)
        self.lineage = lineage

    # identity: read from the lineage, so a resized group answers its new rank and size
    def getRank(self) -> int:  # noqa: N802 - torch's C++ name (its trampoline calls it)
        return self.lineage.rank

    def getSize(self) -> int:  # noqa: N802
        return self.lineage.size

    def rank(self) -> int:
        return self.lineage.rank

    def size(self) -> int:
        return self.lineage.size

    def getBackendName(self) -> str:  # noqa: N802
        return BACKEND

    def getGroupName(self) -> str:  # noqa: N802
        return self.lineage.name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self.lineage.name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self.lineage.desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self.lineage.desc = desc

    @property
    def group_name(self) -> str:
        return self.lineage.name

    @property
    def group_desc(self) -> str:
        return self.lineage.desc

    def _run(self, tensors: Any, result: Any, launch: Callable[[Any], Any]) -> HeldWork:
        return self.lineage.start(_device(tensors), result, launch)

    # collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllreduceOptions)
        if self.lineage.defer is not None and self.lineage.defer(tensors, o):
            return self.lineage.deferred(tensors)
        return self._run(tensors, tensors, lambda b: b.allreduce(tensors, o))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllreduceCoalescedOptions)
        return self._run(tensors, tensors, lambda b: b.allreduce_coalesced(tensors, o))

    def broadcast(self, tensors: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.BroadcastOptions)
        return self._run(tensors, tensors, lambda b: b.broadcast(tensors, o))

    def reduce(self, tensors: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.ReduceOptions)
        return self._run(tensors, tensors, lambda b: b.reduce(tensors, o))

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._run(inputs, outputs, lambda b: b.allgather(outputs, inputs, o))

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._run(inputs, outputs, lambda b: b.allgather_coalesced(outputs, inputs, o))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._run(input, [output], lambda b: b._allgather_base(output, input, o))

    _allgather_base = all_gather_single  # torch before 2.13

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllgatherOptions)  # one op per pair: gloo's backend has no coalesced form here
        return self._run(inputs, outputs,
                         lambda b: [b._allgather_base(out, inp, o) for out, inp in zip(outputs, inputs, strict=True)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._run(outputs, outputs, lambda b: b.reduce_scatter(outputs, inputs, o))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._run(input, [output], lambda b: b._reduce_scatter_base(output, input, o))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._run(inputs, outputs,
                         lambda b: [b._reduce_scatter_base(out, inp, o) for out, inp in zip(outputs, inputs, strict=True)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: Any,
                          input_splits: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllToAllOptions)
        return self._run(input, [output],
                         lambda b: b.alltoall_base(output, input, output_splits, input_splits, o))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.AllToAllOptions)
        return self._run(inputs, outputs, lambda b: b.alltoall(outputs, inputs, o))

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.GatherOptions)
        return self._run(inputs, outputs, lambda b: b.gather(outputs, inputs, o))

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.ScatterOptions)
        return self._run(outputs, outputs, lambda b: b.scatter(outputs, inputs, o))

    def barrier(self, opts: Any = None) -> HeldWork:
        o = _opts(opts, c10d.BarrierOptions)
        return self._run([], [], lambda b: b.barrier(o))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    def send(self, tensors: Any, dst: int, tag: int = 0) -> HeldWork:
        return self._run(tensors, tensors, lambda b: b.send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> HeldWork:
        return self._run(tensors, tensors, lambda b: b.recv(tensors, src, tag))


def pinned(group: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its collectives on ``group`` pinned to the group's generation current now
    (``Lineage.pinned``); ``fn`` itself for a group that is not a ``LiveGroup``."""
    lineage = getattr(group, "lineage", None)
    return lineage.pinned(fn) if isinstance(lineage, Lineage) else fn


def make_group(lineage: Lineage, inner: Inner) -> LiveGroup:
    """A new instance for ``lineage``'s generation ``inner``: its backend registered for C++
    dispatch (torch keeps the first one registered per type, hence a new instance)."""
    lineage.attach(inner, lineage.rank, lineage.size)
    group = LiveGroup(lineage)
    for device_type, backend in inner.backends.items():
        kind = dist.ProcessGroup.BackendType.NCCL if device_type == "cuda" else dist.ProcessGroup.BackendType.GLOO
        group._register_backend(torch.device(device_type), kind, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    lineage.current = group
    return group


def adopt(first: LiveGroup, newest: LiveGroup, ranks: dict[int, int], store: dist.Store) -> None:
    """Make ``newest`` what ``first``'s name resolves to, known to torch's bookkeeping as
    ``first`` is (``ranks``: global rank -> group rank, now; ``store``: the generation's, under
    the prefixes torch gives a group's own store operations, the default group's name first)."""
    world = c10d._world
    name = first.lineage.name
    if first in world.pg_map:
        default = c10d._get_default_group()
        prefix = f"{name}/" if first is default else f"{world.pg_names.get(default, '0')}/"
        kept = dist.PrefixStore(prefix, store)
        world.pg_map[first] = (world.pg_map[first][0], kept if first is default else dist.PrefixStore(f"{name}/", kept))
    for table in (world.pg_map, world.pg_names, world.pg_backend_config):
        if first in table:
            table[newest] = table[first]
    world.pg_group_ranks[first] = dict(ranks)
    world.pg_group_ranks[newest] = dict(ranks)
    answer_for(first.lineage.names or [name], newest)


def answer_for(names: Iterable[str], group: LiveGroup) -> None:
    """Make each of ``names`` (a group's earlier torch names) resolve to ``group``."""
    for name in names:
        with contextlib.suppress(Exception):
            c10d._unregister_process_group(name)
        c10d._register_process_group(name, group)


def forget(groups: Iterable[LiveGroup]) -> None:
    """Drop older instances from torch's bookkeeping (the first stays: objects key on it)."""
    world = c10d._world
    for group in groups:
        for table in (world.pg_map, world.pg_names, world.pg_backend_config, world.pg_group_ranks):
            table.pop(group, None)


def register(creator: Callable[[Any, Any], LiveGroup], cuda: bool) -> None:
    """``BACKEND`` in torch's backend registry (once per process), in its extended form: the
    creator gets torch's backend options (group name, rank, size, timeout, global ranks)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, creator, extended_api=True,
                                  devices=["cpu", "cuda"] if cuda else ["cpu"])


def repoint_ddp(model: Any, group: Any) -> bool:
    """Point a ``DistributedDataParallel`` model at ``group`` (its size may have changed) and
    reset its reducer (a step left half-way); False if ``model`` is not one."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    model._update_process_group(group)
    return True
