"""The step in flight finished without the lost node (docs/in-place.md, "The step in flight"):
under DDP a node killed in the middle of a step's backward pass, or of its gradient
reduction, costs the survivors no step: they compute the lost share as extra micro-batches
and take the step at the new membership. The result is the uninterrupted run's within the
tolerance of a change of reduction order (docs/tolerance.md), and every sample is used once
(the audit by content). Under HSDP a node is a whole replica: the survivors finish the step
the same way after their training function runs again (its mesh is built for the new
membership), from the step before it in their own memory. Where the step cannot be finished
(FSDP without replicas: tests/e2e/test_in_place.py), it is redone after a restore, said once."""

from __future__ import annotations

import pytest

from elastic_harness.data.sampler import rank_share
from tests.audit import audit
from tests.conftest import MLP, cli, final_ckpt, model_of
from tests.e2e.test_e2e_core import assert_close
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

N, G, STEPS = 1024, 30, 40
RECORD = ["--set", "train.record_samples=true", "--set", f"train.steps={STEPS}"]


def nodes(n: int) -> list[str]:
    return ["--nodes", str(n), "--nproc-per-node", "1", "--set", "nodes.min=1", "--set", f"nodes.max={n}"]


@pytest.fixture(scope="module")
def three_node_reference(tmp_path_factory):
    r = cli("run", str(MLP), *nodes(3), *RECORD, run_dir=tmp_path_factory.mktemp("ref3"))
    assert r.code == 0, r.err
    return r


@pytest.mark.parametrize("n, during", [(2, "backward"), (3, "reduction")])
def test_a_node_lost_mid_step_costs_the_survivors_no_step(three_node_reference, tmp_path, n, during):
    """The last node is SIGKILLed in step 21's backward pass (2 nodes: one survivor carries
    the whole batch) or in its gradient reduction (3 nodes: two survivors split the lost
    share)."""
    r = cli("run", str(MLP), *nodes(n), *RECORD, "--chaos", f"kill-node:{n - 1}@20+{during}", run_dir=tmp_path)
    assert r.code == 0, r.err
    (finished,) = r.kinds("finished")
    assert (finished["step"], finished["lost_dp_ranks"], finished["world_size"]) == (21, [n - 1], n - 1)
    assert finished["extra_samples"] == G // n // (n - 1), "rank 0's part of the lost rank's share, no more"
    assert sorted(finished["phases_s"]) == ["extra", "reduce", "repoint"] and min(finished["phases_s"].values()) >= 0
    assert all(e["mode"] == "finish" for e in r.kinds("reformed")) and len(r.kinds("reformed")) == n - 1
    (rec,) = r.kinds("recovery")
    first = {e["rank"]: e["pid"] for e in r.kinds("worker") if e["restart"] == 0}
    assert sorted(rec["kept"]) == sorted(first[k] for k in range(n - 1)) and rec["new"] == []
    assert [e for e in r.kinds("resume") if not e.get("fresh")] == [], "nothing restored: no step redone"
    assert "is redone" not in r.err
    audit(tmp_path, N, G, STEPS)
    reference = three_node_reference.run_dir if n == 3 else None
    if reference is None:
        ref = cli("run", str(MLP), *RECORD, run_dir=tmp_path.parent / f"{tmp_path.name}-ref")
        assert ref.code == 0, ref.err
        reference = ref.run_dir
    diff = assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(reference)))
    print(f"{n} nodes, a node lost mid-{during}, vs uninterrupted: {diff}")


def test_a_fault_while_the_step_is_finished_falls_back_to_a_restore_said_once(tmp_path):
    """Node 2 of 3 lost in step 21; rank 1 dies while the survivors finish it: the finishing's
    reduction fails on rank 0, the step is redone after a restore (said once), rank 1's node
    starts a new worker, and nothing is lost or taken twice."""
    r = cli("run", str(MLP), *nodes(3), *RECORD, "--chaos", "kill-node:2@20", run_dir=tmp_path,
            env={"ELASTIC_HARNESS_INPLACE_FAULT": "finish:1"})
    assert r.code == 0, r.err
    assert r.kinds("finished") == []
    redone = [line for line in r.err.splitlines() if "is redone after a restore" in line]
    assert len(redone) == 1 and "a fault came while it was being finished" in redone[0], r.err
    audit(tmp_path, N, G, STEPS)


OWN_HOOK = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
import elastic_harness as eh

run = eh.init()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
run.register(model, optimizer)
model.register_comm_hook(dist.group.WORLD, allreduce_hook)  # after register(): still the script's
data = torch.arange(64.0).reshape(16, 4)
for step in run.steps(data):
    for x in step.batches():
        step.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    step.done()
run.close()
'''


def test_a_script_hook_registered_after_register_is_kept_and_the_step_is_redone(tmp_path):
    """A script registers its own DDP communication hook after ``run.register``: DDP takes
    one hook, so the harness does not take that slot first; the run trains with the script's
    hook, and a node lost mid-step is redone after a restore, said once with that reason."""
    script = tmp_path / "own_hook.py"
    script.write_text(OWN_HOOK)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: own-hook\nscript: {{path: {script}}}\nnproc_per_node: 1\n"
                   "train: {steps: 10, global_batch_size: 4, micro_batch_size: 2}\n"
                   "checkpoint: {every_steps: 0}\nmetrics: {tensorboard: false}\n")
    r = cli("run", str(job), *nodes(2), "--chaos", "kill-node:1@4+backward", run_dir=tmp_path / "run")
    assert r.code == 0, r.err[-3000:]
    redone = [line for line in r.err.splitlines() if "is redone after a restore" in line]
    assert len(redone) == 1 and "communication hook of its own" in redone[0], r.err[-3000:]
    assert r.kinds("finished") == []


HSDP = ["--nodes", "2", "--nproc-per-node", "2", "--set", "nodes.min=1", "--set", "nodes.max=2",
        "--set", "parallelism={shard: 2, tensor: 1}", "--set", "train.record_samples=true", "--set", "train.steps=16",
        "--set", "finish_hsdp_step=true"]


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    r = cli("run", str(MLP), *HSDP, run_dir=tmp_path_factory.mktemp("hsdp-ref"))
    assert r.code == 0, r.err
    return r


@pytest.mark.parametrize("during", ["backward", "reduction", "told"])
def test_a_replica_lost_mid_step_under_hsdp_costs_the_survivors_no_step(hsdp_reference, tmp_path, during):
    """2 nodes x 2 ranks, HSDP (replicate 2, shard 2): node 1, a whole replica, is SIGKILLed in
    step 9's backward pass or in its replica all-reduce; node 0's two ranks finish step 9 with
    their kept shard-local gradients and the lost replica's 14 samples as extra micro-batches.
    ``told``: rank 0 starts step 9 only once its agent told it of the loss (forced), so the
    node's reduce-scatters of the step all run after that word: they are left running."""
    env = {"ELASTIC_HARNESS_INPLACE_FAULT": "told:0@9"} if during == "told" else None
    chaos = "kill-node:1@8+backward" if during == "told" else f"kill-node:1@8+{during}"
    r = cli("run", str(MLP), *HSDP, "--chaos", chaos, run_dir=tmp_path, env=env)
    assert r.code == 0, r.err
    redone = [line for line in r.err.splitlines() if "is redone after a restore" in line]
    if during == "reduction" and redone:
        # Node 1's other rank may finish its replica all-reduce with rank 1 before the kill lands:
        # rank 1's step 9 is then whole and rank 0's is not. The survivors disagree, and the step is
        # redone, said once (docs/in-place.md). This is the only other outcome allowed.
        assert len(redone) == 1 and "step 9 is redone" in redone[0] and "not every survivor" in redone[0], r.err
        assert r.kinds("finished") == []
    else:
        assert redone == [], r.err[-3000:]
        (finished,) = r.kinds("finished")
        assert (finished["step"], finished["lost_dp_ranks"], finished["world_size"]) == (9, [2, 3], 2)
        lost = sum(rank_share(G, 4, d)[1] - rank_share(G, 4, d)[0] for d in (2, 3))
        assert finished["extra_samples"] == lost // 2, "rank 0's half of the lost replica's share, no more"
        assert [e["mode"] for e in r.kinds("reformed")] == ["finish", "finish"]
    (rec,) = r.kinds("recovery")
    first = {e["rank"]: e["pid"] for e in r.kinds("worker") if e["restart"] == 0}
    assert sorted(rec["kept"]) == sorted(first[k] for k in range(2)) and rec["new"] == []
    # the mesh is built again for one replica: the state is the step before, from the survivors' own memory
    (restored,) = [e for e in r.kinds("resume") if not e.get("fresh")]
    assert (restored["step"], restored["source"]) == (8, "memory"), restored
    audit(tmp_path, N, G, 16)
    diff = assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(hsdp_reference.run_dir)))
    print(f"HSDP 2x2, a replica lost mid-{during}, vs uninterrupted: {diff}")
