"""Fixtures the memory-tier tests share."""

from __future__ import annotations

import pytest

from elastic_harness.memtier.host import HostSlots, slot_paths
from elastic_harness.memtier.region import Region


@pytest.fixture
def slots():
    """One rank's slots in real memory files (``HostSlots``), closed after the test."""
    host = HostSlots.create(1)
    regions = [Region(p) for p in slot_paths(host.describe(), 0)]
    yield regions
    for r in regions:
        r.close()
    host.close()
