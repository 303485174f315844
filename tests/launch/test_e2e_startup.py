"""Agents that start seconds apart still form one group at start-up (real agents, one run).

The second agent is started 4 s after the first (``add-node@4s``), with the later-round last
call at 1 s. Before the per-round last call (``rendezvous.handler``), the first agent closed
round 0 alone 1 s after joining, and the second then forced a membership change (two
worker generations, sizes 1 then 2). Now round 0 waits ``start_last_call_timeout`` for more.
"""

from __future__ import annotations

import pytest

from tests.conftest import MLP, cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_a_late_second_agent_joins_the_first_group(tmp_path):
    r = cli("run", str(MLP), "--nodes", "1", "--nproc-per-node", "1",
            "--set", "nodes.min=1", "--set", "nodes.max=2", "--set", "train.steps=20",
            "--set", "rendezvous.last_call_timeout=1", "--chaos", "add-node@4s", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["add-node"]
    sizes = [g["world_size"] for g in r.kinds("rendezvous")]
    assert sizes == [2], f"one generation of both nodes expected, got world sizes {sizes}"
