"""The in-memory checkpoint tier: each rank's last training state, kept in node-local memory
owned by its agent, so a restarted worker group resumes with a memory copy instead of a
storage read.

Which tier covers which fault:

- a worker process crashes, is killed, or is killed by the step watchdog: its agent lives,
  and so does its memory. The next generation restores from memory when every rank holds
  the same newest step at the same layout (world size, rank, tensor shapes); at most the
  steps since the last snapshot (``checkpoint.memory_every``, default every step) are redone.
- a node is lost (its agent dies) or the job is resized: that memory is gone or does not fit
  the new layout, so every rank falls back to the newest verified DCP checkpoint on storage
  (``checkpoint.every_steps``), as without this tier.

Pieces, in call order:

- ``host``: the agent creates two memory slots (memfds) per local rank before its first
  worker starts and holds them until it exits; the kernel frees them when it does, also on
  SIGKILL, and nothing is ever in ``/dev/shm``. Workers open them through ``/proc``.
- ``slots``: pure decisions: the slot header, which slot to write next, which snapshots fit
  this layout, the newest step every rank holds.
- ``region``: one slot's bytes (mmap), written then published: a rank killed while writing
  leaves that slot unpublished and the other slot intact.
- ``snapshot``: a state dict <-> tensor bytes plus a small pickled skeleton; restoring fills
  the tensors of the freshly built state in place, as DCP does.
- ``tier``: the worker side: ``MemoryTier.restore`` (collective) and ``save``.
"""
