"""What an agent tells its workers when their group must leave the step (``agent.keeper.leave_word``):
the word is *remote* (another node's failure) unless a worker of this node said a collective failed. A remote word
lets an HSDP node finish its backward's collectives within the node (``runtime.inplace``); a word
for this node's own failure must cut them, since a rank of the node may be the one lost or stalled."""

from __future__ import annotations

import pytest

from elastic_harness.agent.keeper import leave_word

pytestmark = pytest.mark.timeout(30)


def test_a_peer_groups_failure_alone_is_another_nodes():
    assert leave_word(None, None) == ("a peer's group failed", True)


def test_the_watchdogs_verdict_is_evidence_against_another_node():
    verdict = "n1: its host refused its agent's beacon (process gone); this node's workers made no progress"
    assert leave_word(None, verdict) == (verdict, True)


@pytest.mark.parametrize("reason, verdict", [
    ("a collective failed: connection closed by peer", None),  # a worker of this node said so
    ("a collective failed: broken pipe", "n1: silent for 4.0 s"),
])
def test_a_collective_failed_on_this_node_is_not_remote(reason, verdict):
    assert leave_word(reason, verdict) == (reason, False)  # that collective may have been within the node
