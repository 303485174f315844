"""``train.epochs``: the step count it resolves to (``data.epochs``), the one-length rule of
the spec, where it is resolved (the host's preflight) and what refuses it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elastic_harness.data.epochs import samples_per_epoch, steps_for_epochs, unresolved_epochs
from elastic_harness.data.sampler import EpochOrder
from elastic_harness.data.stream import Packing, Stream
from elastic_harness.errors import HarnessError, SpecError, UsageError
from elastic_harness.spec import load_job, parse_job
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("epochs", "size", "g"), [(1, 10, 5), (3, 10, 4), (2, 7, 3), (1, 5, 5), (4, 9, 16)])
def test_the_steps_of_n_epochs_use_every_sample_of_them_once(epochs, size, g):
    """ceil(N x S / G) steps of the continuous stream: each of the N passes whole, and the
    overflow (< G) is the start of pass N + 1, as the sampler rolls epochs over."""
    steps = steps_for_epochs(epochs, size, g)
    assert (steps - 1) * g < epochs * size <= steps * g
    order = EpochOrder(seed=3, dataset_size=size)
    used = order.indices(0, steps * g)
    for e in range(epochs):
        assert sorted(used[e * size:(e + 1) * size]) == list(range(size))
    assert used[epochs * size:] == order.indices(epochs * size, steps * g)  # from pass N + 1 on


def test_a_stream_is_sized_by_its_lengths_or_refused_with_the_fix():
    opener = lambda shard: iter(())  # noqa: E731 - never read: sizing must not open a shard
    assert samples_per_epoch(Stream(["a", "b"], opener, lengths=[3, 4])) == 7
    assert samples_per_epoch(list(range(11))) == 11
    with pytest.raises(UsageError, match="Stream\\(lengths="):
        samples_per_epoch(Stream(["a", "b"], opener))
    with pytest.raises(UsageError, match="packs documents") as e:
        samples_per_epoch(Stream(["a"], opener, lengths=[5], pack=Packing(8)))
    assert "train.steps" in e.value.hint


def test_steps_and_epochs_together_are_one_error():
    with pytest.raises(SpecError, match="both train.steps and train.epochs") as e:
        parse_job("name: j\ntask: {target: 'm:f'}\ntrain: {steps: 5, epochs: 2}\n")
    assert e.value.path == "train"
    with pytest.raises(SpecError, match="both"):
        load_job(MLP, ["train.epochs=2"])  # mlp.yaml says steps: 60
    spec = parse_job("name: j\ntask: {target: 'm:f'}\ntrain: {epochs: 2}\n")
    assert spec.train.epochs == 2
    # a resolved spec (what workers read) names both keys, epochs 0
    assert parse_job("name: j\ntask: {target: 'm:f'}\ntrain: {steps: 7, epochs: 0}\n").train.steps == 7
    with pytest.raises(SpecError, match="train.epochs"):
        parse_job("name: j\ntask: {target: 'm:f'}\ntrain: {epochs: -1}\n")


def _mlp_with_epochs(epochs: int, *more: str):
    spec = load_job(MLP, list(more))
    return dataclasses.replace(spec, train=dataclasses.replace(spec.train, epochs=epochs))


def test_the_host_resolves_epochs_into_steps_from_the_tasks_dataset():
    from elastic_harness.commands.run import preflight
    from elastic_harness.spec import dump_job

    notes: list[str] = []
    spec = preflight(_mlp_with_epochs(3), MLP, note=notes.append)  # 1024 samples, G 30
    assert (spec.train.steps, spec.train.epochs) == (103, 0)  # ceil(3072 / 30)
    assert notes == ["train.epochs 3 = 103 steps (ceil(3 x 1024 samples / global batch 30))"]
    assert parse_job(dump_job(spec)) == spec  # workers load it back


def test_a_script_job_with_epochs_is_refused_before_anything_starts(tmp_path):
    from elastic_harness.commands.run import preflight

    script = tmp_path / "train.py"
    script.write_text("")
    spec = parse_job(f"name: j\nscript: {{path: {str(script)!r}}}\ntrain: {{epochs: 2}}\n")
    with pytest.raises(HarnessError, match="script's dataset") as e:
        preflight(spec, Path(script))
    assert "train.steps = ceil(" in e.value.hint


def test_a_worker_given_unresolved_epochs_names_the_steps_to_set():
    e = unresolved_epochs(2, 1000, 64)
    assert "train.steps=32" in e.hint and "train.epochs 2" in e.message


def test_kubernetes_manifests_refuse_epochs_with_the_fix(cli_here, tmp_path):
    from tests.cli.test_bad_args import assert_one_line_error

    job = tmp_path / "job.yaml"
    job.write_text(MLP.read_text().replace("  steps: 60\n", "  epochs: 2\n"))
    r = cli_here("k8s", "render", job, "--flavor", "plain")
    assert_one_line_error(r, "train.epochs is resolved into train.steps by `run`/`submit`", "set train.steps")
