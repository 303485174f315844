"""The step's all-reduce (loss, drain, time-based save) starts when ``step.batches()`` ends
and is collected by ``step.done()``; a loss counted after the loop is still reported.

Two ranks through ``elastic-harness run``; the script knows every sample's loss (the
sample's own value), so the reported step losses can be checked exactly.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = '''
import json, sys
import torch
import elastic_harness as eh

run = eh.init()
model = torch.nn.Linear(1, 1, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
run.register(model, optimizer)
record = []
for step in run.steps(torch.arange(16.0).reshape(16, 1)):
    local = 0.0
    for x in step.batches():
        step.backward(model(x).squeeze(1) * 0 + x.squeeze(1))  # per-sample loss = its value
        local += float(x.sum())
        if step.number == 3:  # a loop left early: done() starts the all-reduce itself
            break
    started = step.shared is not None  # launched by the end of the loop, before done()
    if step.number == 2:  # a loss after the loop (every rank): must still be counted
        step.backward(model(x[:1]).squeeze(1) * 0 + 100.0)
        local += 100.0
    optimizer.step()
    optimizer.zero_grad()
    step.done()
    record.append({"step": step.number, "local": local, "started": started})
with open(sys.argv[1] + f"/rank-{run.rank}.json", "w") as f:
    json.dump(record, f)
run.close()
'''

def test_reported_losses_cover_every_backward_including_late_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "totals.py"
    script.write_text(SCRIPT)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: totals\nscript: {{path: {script}, args: [{out}]}}\nnproc_per_node: 2\nmax_restarts: 0\n"
        "train: {steps: 4, global_batch_size: 4, micro_batch_size: 1, log_every: 1}\n"
        "checkpoint: {every_steps: 0}\nmetrics: {tensorboard: false}\n")
    r = cli("run", str(job), run_dir=tmp_path / "run", timeout=240)
    assert r.code == 0, r.err[-3000:]
    ranks = [json.loads((out / f"rank-{k}.json").read_text()) for k in (0, 1)]
    assert [[s["started"] for s in rank] for rank in ranks] == [[True, True, False, True]] * 2
    losses = {e["step"]: e["loss"] for e in r.kinds("step")}
    for i in range(4):
        total = ranks[0][i]["local"] + ranks[1][i]["local"]
        assert losses[i + 1] == pytest.approx(total / 4, abs=1e-5), (i, losses)
