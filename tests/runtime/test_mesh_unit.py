"""runtime.mesh's checks and the task path's bad inputs: no process group, no agent."""

from __future__ import annotations

import pytest
import torch

from elastic_harness.errors import TaskError
from elastic_harness.runtime.mesh import check_divides, check_plan
from elastic_harness.tasks.llama import PLAN, TinyLlamaLM
from tests.conftest import JOBS


def meta_model(**args):
    with torch.device("meta"):
        return TinyLlamaLM(**args).build_model()


def test_the_built_in_plan_names_only_modules_the_model_has():
    check_plan(meta_model(), PLAN, "task")


def test_a_plan_naming_missing_modules_is_refused_naming_them():
    plan = {**PLAN, "layers.*.attention.wqq": "colwise", "blocks.0.mlp": "rowwise"}
    with pytest.raises(TaskError) as e:
        check_plan(meta_model(), plan, "task TinyLlamaLM")
    assert "layers.*.attention.wqq, blocks.0.mlp" in str(e.value)
    assert "attention.wq," not in str(e.value)


def test_a_tensor_degree_that_does_not_divide_a_split_dimension_is_refused():
    check_divides({"heads": 4, "hidden": 128}, 2, "task")
    with pytest.raises(TaskError, match="tensor degree 4 does not divide heads 2"):
        check_divides({"heads": 2, "hidden": 128}, 4, "task")


@pytest.mark.parametrize(("sets", "words"), [
    (["task.args.plan={layers.*.attention.wx: colwise}"], "names module(s) the model lacks: layers.*.attention.wx"),
    (["task.args.heads=2", "parallelism.shard=1", "parallelism.tensor=4"], "tensor degree 4 does not divide heads 2"),
    (["task.target=elastic_harness.tasks.charlm:CharLM", "task.args={}"], "has no parallelize(model, mesh)"),
])
def test_run_refuses_a_plan_that_cannot_fit_before_anything_starts(cli_here, sets, words):
    r = cli_here("run", JOBS / "llama_mesh.yaml", "--set", "nodes.max=1", *[a for s in sets for a in ("--set", s)])
    assert r.code == 2, r.err
    assert words in r.err and "Traceback" not in r.err
