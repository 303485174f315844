"""End to end: under FSDP a lost node's shards come back from the survivors' memory (its
buddy copies, ``memtier.buddy``), resharded to the new world size, like a storage restore."""

from __future__ import annotations

import pytest

from tests.audit import audit
from tests.conftest import MLP, cli, read_jsonl
from tests.e2e.test_e2e_core import STEPS, G, N
from tests.lanes import DETECTION
from tests.memtier.test_e2e_memory import assert_storage_twin_matches

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

FSDP = ["--set", "parallelism=fsdp"]
LOST_NODE = [*FSDP, "--nodes", "2", "--set", "nodes.min=1", "--set", "nodes.max=2", "--nproc-per-node", "1",
             "--set", "train.record_samples=true", "--set", "checkpoint.memory_budget=0",
             "--chaos", "kill-node:1@35"]


def test_a_lost_fsdp_node_restores_from_buddy_copies_like_storage(tmp_path):
    """Two nodes, one rank each, FSDP: node 1 is killed at step 35. The survivor holds its
    own shard and its copy of node 1's, reshards both to world size 1 in memory (no storage
    read, at most one step redone); the same run restored from storage at that step ends
    bit-identical."""
    r = cli("run", str(MLP), *LOST_NODE, run_dir=tmp_path / "memory")
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-node"]
    copies = r.kinds("buddy")
    assert copies and copies[0]["of_rank"] == 1 and copies[0]["bytes"] > 0
    after_loss = r.kinds("resume")[-1]
    step = after_loss["step"]
    assert after_loss["source"] == "buddy" and step >= 35 - 1, after_loss
    assert (after_loss["saved_world_size"], after_loss["world_size"]) == (2, 1)
    assert "checkpoint" not in after_loss and after_loss["receivers"] == 0
    assert f"restored from buddy at step {step}" in r.out + r.err
    # Steps redone: those every rank finished at world size 2 after the restored one. A rank
    # writes a step's sample line before its compute, so a rank's last line at world size 2
    # is a step it began; the one before it, it finished (the killed rank may begin a step
    # or two after the fault's, as its agent's SIGKILL reaches it).
    began = [max(s["step"] for s in read_jsonl(tmp_path / "memory" / "samples" / f"rank-{r}.jsonl")
                 if s["world_size"] == 2) for r in (0, 1)]
    assert min(began) - 1 - step <= 1, (began, step)
    seen = audit(tmp_path / "memory", N, G, STEPS)
    assert seen["world_sizes"][STEPS] == 1
    # The twin: FSDP at world size 2 up to that step, saved to storage (no memory tier),
    # then resumed from storage at world size 1 (DCP reshards it).
    assert_storage_twin_matches(r, tmp_path / "storage", step, FSDP)
