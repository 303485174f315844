"""Where a run's scratch files go: inside its run dir, never the system temp dir.

A run must leave nothing in ``$TMPDIR`` (``/tmp``) or ``/dev/shm``, even when it is
SIGKILLed as a whole and nothing gets to clean up, so what torch would put there is placed
in ``RUN_DIR/tmp`` and ``RUN_DIR/cache`` instead. What torch 2.13 writes to the temp dir
during a run (read in its source, then checked by ``tests/e2e/test_leftovers.py``):

- ``torchinductor_$USER``: ``torch._dynamo`` creates its compile cache when imported, and
  DDP and FSDP import it. ``TORCHINDUCTOR_CACHE_DIR`` moves it (a user's own setting wins).
- the step watchdog's FIFO (torchelastic's file timer): ``launch.watchdog`` makes it at
  ``watchdog_fifo``. An agent that is SIGKILLed leaves its FIFO behind; the next agent on
  the same host removes those whose process is gone (``stale_fifos``).
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
_FIFO = re.compile(r"watchdog-(?P<host>.+)-(?P<pid>\d+)\.fifo")


def torch_environ(run_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """Pure: variables to add to an agent's environment (its workers inherit them)."""
    if environ.get(INDUCTOR_CACHE_VAR):
        return {}
    return {INDUCTOR_CACHE_VAR: str(Path(run_dir) / runfiles.CACHE / "torchinductor")}


def watchdog_fifo(run_dir: Path, host: str, pid: int) -> Path:
    """The step watchdog FIFO of agent ``pid`` on ``host``: one per agent, in the run dir."""
    return Path(run_dir) / runfiles.TMP / f"watchdog-{_safe(host)}-{pid}.fifo"


def stale_fifos(names: Iterable[str], host: str, alive: Callable[[int], bool]) -> list[str]:
    """Pure: the watchdog FIFOs among ``names`` left by dead agents on ``host``.

    Only this host's can be judged (a pid means nothing elsewhere); ``alive(pid)`` answers
    for this host. Names that are not watchdog FIFOs are never chosen.
    """
    out = []
    for name in names:
        m = _FIFO.fullmatch(name)
        if m and m["host"] == _safe(host) and not alive(int(m["pid"])):
            out.append(name)
    return sorted(out)


def _safe(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"
