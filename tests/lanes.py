"""Tests that must have the machine to themselves while pytest-xdist runs the others in
parallel (``pytest -n 2 --dist loadgroup``; the README's command still runs one at a time).

``@pytest.mark.alone``: no other test of this session runs while it does. Each test takes a
lock shared between the session's workers (``flock`` on a file in the session's temp dir,
the parent of every worker's): shared by ordinary tests, exclusive by an ``alone`` one. A
gate taken before either keeps new ordinary tests from starting while an ``alone`` test
waits for the ones under way to end, so it is never starved. Without xdist (one process)
nothing is locked. The lock is taken outside the test's timeout (pytest-timeout starts its
timer inside), and waiting for it is bounded by the timeouts of the tests it waits for.

``xdist_group`` (xdist's own mark, with ``--dist loadgroup``) is the other tool: the tests of
one group run one after the other on one worker, while tests of other groups run beside
them. ``DETECTION`` is the group of the tests that time a failure's detection or a
survivor's way through a recovery (keep-alive expiry against the stall verdict, watchdogs,
the bound a survivor has to leave its step, restart budgets): two of them never run at
once, so each has at most one other test beside it, as on one loaded core. Tests that share
an expensive module-scoped reference run are one group of their own, so it is computed once.
A test takes one group only (xdist joins several into a new name).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest

ALONE = "alone"
GATE, LOCK = "lanes.gate", "lanes.lock"
DETECTION = pytest.mark.xdist_group("detection")


def session_dir(config: pytest.Config) -> Path | None:
    """The temp dir every worker of this session shares, or None outside an xdist worker."""
    if not hasattr(config, "workerinput") or config.option.basetemp is None:
        return None
    return Path(config.option.basetemp).parent  # a worker's basetemp is SESSION/popen-gwN


@contextlib.contextmanager
def turn(directory: Path, alone: bool) -> Iterator[None]:
    """Hold the session's lock for one test: exclusive when ``alone``, shared otherwise."""
    with open(directory / GATE, "a") as gate, open(directory / LOCK, "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if alone:  # keep the gate until the tests under way have ended: none starts meanwhile
            fcntl.flock(lock, fcntl.LOCK_EX)
            fcntl.flock(gate, fcntl.LOCK_UN)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield  # closing the files releases both


def wants_alone(item: pytest.Item) -> bool:
    return item.get_closest_marker(ALONE) is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Each test of an xdist worker holds the session's lock (``turn``) while it runs: set up,
    called and torn down. Taken outside its timeout, which starts inside this wrapper."""
    where = session_dir(item.config)
    if where is None:
        return (yield)
    with turn(where, wants_alone(item)):
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers the end-to-end tests come first (in their order), the fast tier after:
    the scheduler hands tests out in this order (under ``--dist loadgroup`` after the groups,
    which xdist hands out first, largest first), so the minutes-long ones start early and the
    second-long ones fill the gaps at the end, instead of one worker running the suite's last
    long test while the other has nothing left. Every worker sorts alike (xdist requires one
    collection)."""
    if session_dir(config) is not None:
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)
