"""Where a run's scratch files go: inside its run dir, never the system temp dir.

A run must leave nothing in ``$TMPDIR`` (``/tmp``) or ``/dev/shm``, even when it is
SIGKILLed as a whole and nothing gets to clean up, so what torch would put there is placed
in ``RUN_DIR/tmp`` and ``RUN_DIR/cache`` instead. What torch 2.13 writes to the temp dir
during a run (read in its source, then checked by ``tests/e2e/test_leftovers.py``):

- ``torchinductor_$USER``: ``torch._dynamo`` creates its compile cache when imported, and
  DDP and FSDP import it. ``TORCHINDUCTOR_CACHE_DIR`` moves it (a user's own setting wins).
- the step watchdog's FIFO (torchelastic's file timer): ``agent.watchdog`` makes it at
  ``watchdog_fifo``, named by a random token, beside a lock file its agent holds locked
  (``flock``) for its life. An agent that is SIGKILLed leaves both behind; the next agent
  to start removes those whose lock nobody holds (``stale_fifos``). Not by host name and
  pid: agents sharing a run dir from different pid namespaces (containers, ``run
  --separate-hosts``) with the same host name took each other's live FIFOs for stale ones
  (a pid of one namespace means nothing in another), and a lock is what the kernel
  releases when its holder dies, wherever it ran.
- ``torchelastic_*``: torchelastic's log dirs, only made without a log dir
  (``DefaultLogsSpecs()``, ``torchrun`` without ``--log-dir``); the harness always gives
  one (``RUN_DIR/logs``), and so does ``bench recovery`` for the torchrun it compares with.
  The workers' error files (``error.json``, written by ``@record``) live under it too.

Not used here, so not handled: torchelastic's ``file`` rendezvous store (``mkstemp``) and
its standalone etcd server's data dir. ``torch.multiprocessing.spawn`` (``bench
checkpoint`` only) names an error file per child in the temp dir and leaves the one a
failing child wrote; that bench points ``tempfile`` at its own scratch dir meanwhile.

torchelastic honours ``TMPDIR`` (it asks ``tempfile``), which is how the tests watch it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from elastic_harness import runfiles

INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
_FIFO = re.compile(r"watchdog-(?P<token>[0-9a-f]{8,64})\.fifo")


def torch_environ(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """Pure: variables to add to an agent's environment (its workers inherit them)."""
    if environ.get(INDUCTOR_CACHE_VAR):
        return {}
    return {INDUCTOR_CACHE_VAR: str(Path(run_dir) / runfiles.CACHE / "torchinductor")}


def watchdog_fifo(run_dir: Path, token: str) -> Path:
    """The step watchdog FIFO of the agent that drew ``token`` (hex): one per agent, in the
    run dir; its lock file is ``fifo_lock(fifo)``."""
    return Path(run_dir) / runfiles.TMP / f"watchdog-{token}.fifo"


def fifo_lock(fifo: Path) -> Path:
    """The lock file its agent holds locked while ``fifo`` is in use."""
    return fifo.with_suffix(".lock")


def stale_fifos(names: Iterable[str], held: Callable[[str], bool]) -> list[str]:
    """Pure: the watchdog FIFOs among ``names`` left by agents that are gone: their lock
    (``fifo_lock``) is held by nobody (``held(lock name)`` tries it). A FIFO without a lock
    file is being set up (the lock is made first) or was left by an older version: left
    alone. Names that are not watchdog FIFOs are never chosen."""
    present = set(names)
    out = []
    for name in present:
        lock = name[: -len(".fifo")] + ".lock"
        if _FIFO.fullmatch(name) and lock in present and not held(lock):
            out.append(name)
    return sorted(out)
