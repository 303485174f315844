"""Every store call of a rendezvous handler, counted at its client (``bench rendezvous-scale``).

A wrapper around the handler's c10d store client (and its change thread's, ``rendezvous.changes``)
that reports each call with its bytes both ways. Bench-only: no agent counts its calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_harness.torchcompat import rdzv


class _CountingStore:
    """A store client that reports each call: ``tally(op, bytes sent, bytes received, lost)``
    (``lost``: a compare-and-set that found another value)."""

    def __init__(self, store: Any, tally: Callable[[str, int, int, bool], None]) -> None:
        self._store, self._tally = store, tally

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._tally("get", len(key), len(value), False)
        return value

    def check(self, keys: list[str]) -> bool:
        found = self._store.check(keys)
        self._tally("check", sum(len(k) for k in keys), 1, False)
        return found

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._tally("add", len(key) + 8, 8, False)
        return value

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)
        self._tally("set", len(key) + len(value), 0, False)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self._store.wait(keys, *timeout)  # a change counted (``rendezvous.changes``): the reply wakes
        self._tally("wait", sum(len(k) for k in keys), 1, False)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self._store.compare_set(key, expected, desired)
        sent = len(key) + len(expected) + len(desired)
        self._tally("compare_set", sent, len(value), _as_bytes(value) != _as_bytes(desired))
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def count_store_calls(handler: Any, tally: Callable[[str, int, int, bool], None]) -> None:
    """Count every store call ``handler``'s c10d backend makes (``bench rendezvous-scale``)."""
    backend = rdzv.state_backend(handler)
    if backend is None:
        raise RuntimeError("this torch keeps its rendezvous backend out of reach (torchcompat: rdzv-state)")
    backend._store = _CountingStore(backend._store, tally)
    if getattr(backend, "changes", None) is not None:  # its thread's waits, each change's count
        backend.changes.route_calls(lambda store: _CountingStore(store, tally))
