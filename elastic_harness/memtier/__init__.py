"""The in-memory checkpoint tier: each rank's last training state, kept in node-local memory
owned by its agent, so a restarted worker group resumes with a memory copy instead of a
storage read.

Which tier covers which fault:

- a worker process crashes, is killed, or is killed by the step watchdog: its agent lives,
  and so does its memory. The next generation restores from memory when every rank holds
  the same newest step at the same layout (world size, rank, tensor shapes); at most the
  steps since the last snapshot (``checkpoint.memory_every``, default every step) are redone.
- under DDP (replicated state: each snapshot is the whole job's state), also a node lost or
  a job resized: the survivors restore their own snapshot at the new world size, and ranks
  without one (a node that joined) receive it from one that has it (``peer``).
- under 1-D FSDP, a node lost or joined: every old rank's snapshot is still held (its own,
  or a copy the next node keeps: ``buddy``), resharded in memory (``reshard``).
- under a mesh, a node lost or joined changes the replicate degree only: each rank reads, or
  receives from a replica, its coordinate's snapshot (``choose``).
- otherwise (every agent new, a node lost with the one holding its copies, layouts that
  disagree) every rank falls back to the newest verified DCP checkpoint on storage
  (``checkpoint.every_steps``).

Pieces, in call order:

- ``host``: the agent creates two memory slots (memfds) per local rank before its first
  worker starts and holds them until it exits; the kernel frees them when it does, also on
  SIGKILL, and nothing is ever in ``/dev/shm``. Workers open them through ``/proc``.
- ``slots``: pure decisions: the slot header (replicated or not), which slot to write next.
- ``region``: one slot's bytes (mmap), written then published: a rank killed while writing
  leaves that slot unpublished and the other slot intact.
- ``snapshot``: a state dict <-> tensor bytes plus a small pickled skeleton; restoring fills
  the tensors of the freshly built state in place, as DCP does.
- ``choose``: pure: where a generation restores from (memory, peer, storage), from every
  rank's offers (its published snapshots), gathered once.
- ``peer``: what the ranks exchange, as raw tensors (offers, flags, a snapshot's bytes and
  its skeleton as JSON): nothing received is unpickled; and the rules a job's layout
  (``runtime.topology``) allows (``restore_rules``).
- ``buddy``, ``conduit``, ``exchange``, ``reshard``: the buddy copies, and resharding them;
  ``cadence``: how often a snapshot is taken, within a budget of step time.
- ``tier``: the worker side: ``MemoryTier.restore`` (collective) and ``save``; ``restore``:
  the restore of one generation (plan, read, move pieces, exchange, load), which the tier
  builds and runs once per generation.
"""
