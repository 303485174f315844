"""Checkpoint items that are not tensors are read weights-only: a shard cannot run code."""

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_harness.checkpoint.safe_load import WeightsOnlyLoadPlanner, load_item
from elastic_harness.errors import CheckpointError

pytestmark = pytest.mark.timeout(60)


class _Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mknod, (self.path,))


class Opaque:
    def __init__(self, v: int) -> None:
        self.v = v


def _bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    planted = tmp_path / "ran"
    buf = io.BytesIO(pickle.dumps(_Planted(str(planted))))
    # The same bytes run under torch's default planner (weights_only=False): the test's premise.
    with pytest.raises(CheckpointError, match="optim.param_groups.*weights-only load refuses"):
        load_item("optim.param_groups", buf)
    assert not planted.exists()
    with pytest.raises(RuntimeError):  # it unpickles the "magic number" first: the code runs
        torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert planted.exists()


def test_plain_values_load_and_a_custom_class_names_the_fix():
    groups = [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1], "amsgrad": False, "name": None}]
    assert load_item("optim.param_groups", _bytes(groups)) == groups
    with pytest.raises(CheckpointError) as e:
        load_item("extra.ema", _bytes({"obj": Opaque(3)}))
    assert "extra.ema" in e.value.args[0] and "add_safe_globals" in str(e.value.args)


def test_dcp_round_trip_through_the_planner(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"step": 7, "tag": "x"}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
        fresh = torch.nn.Linear(3, 2)
        opt2 = torch.optim.AdamW(fresh.parameters(), lr=5e-1)
        opt2.zero_grad()
        fresh(torch.ones(1, 3)).sum().backward()
        opt2.step()
        target = {"model": fresh.state_dict(), "optim": opt2.state_dict(), "meta": {"step": 0, "tag": ""}}
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True, planner=WeightsOnlyLoadPlanner())
    assert target["meta"] == {"step": 7, "tag": "x"}
    assert target["optim"]["param_groups"][0]["lr"] == 1e-3
    assert torch.equal(target["model"]["weight"], model.state_dict()["weight"])


def test_only_the_optional_keys_may_be_missing(tmp_path):
    """A checkpoint from before a field was added loads (the field keeps its default); a
    checkpoint that lacks any other key is refused as DCP refuses it."""
    from elastic_harness.runtime.state import TrainState

    old = {"train": {"step": torch.tensor(5), "cursor": torch.tensor(40)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(old, checkpoint_id=str(tmp_path), no_dist=True)
        fields = {"step": torch.tensor(0), "cursor": torch.tensor(0), "stream": torch.tensor(0),
                  "layout": torch.tensor(0)}
        target = {"train": dict(fields)}
        dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True,
                 planner=WeightsOnlyLoadPlanner(TrainState.OPTIONAL_KEYS))
        assert int(target["train"]["step"]) == 5 and int(target["train"]["stream"]) == 0
        with pytest.raises(BaseException, match="Missing key"):
            dcp.load({"train": dict(fields)}, checkpoint_id=str(tmp_path), no_dist=True,
                     planner=WeightsOnlyLoadPlanner(frozenset({"train.stream"})))
