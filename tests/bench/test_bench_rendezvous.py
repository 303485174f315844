"""``bench rendezvous``: its summary (pure), and one small run against a real etcd."""

from __future__ import annotations

import argparse
import json

import pytest

from elastic_harness.bench.rendezvous.main import summarize
from elastic_harness.cli import main


def test_the_ratios_are_v3_over_v2_medians():
    samples = {"etcd-v2": {"round": [0.30, 0.31, 0.90], "backend": [0.02, 0.03, 0.04], "calls": [5, 6, 6]},
               "etcd-v3": {"round": [0.27, 0.28, 0.30], "backend": [0.01, 0.01, 0.02], "calls": [4, 4, 5]}}
    out = summarize(samples, argparse.Namespace(nodes=2, repeats=3, rounds=1), "3.4.23")
    assert out["round_ratio_v3_over_v2"] == round((0.85 / 3) / (1.51 / 3), 3) and out["goal_met"]
    assert out["round_median_ratio_v3_over_v2"] == round(0.28 / 0.31, 3)
    assert out["backend_ratio_v3_over_v2"] == round(0.01 / 0.03, 3)
    assert out["etcd-v2"]["round_range_s"] == [0.3, 0.9] and out["etcd-v3"]["backend_calls_per_round"] == 4
    samples["etcd-v3"]["round"] = [0.5, 0.6, 0.7]
    assert not summarize(samples, argparse.Namespace(nodes=2, repeats=3, rounds=1), "x")["goal_met"]


@pytest.mark.timeout(180)
def test_a_small_run_prints_both_backends(tmp_path, capsys):
    out = tmp_path / "rdzv.json"
    assert main(["bench", "rendezvous", "--repeats", "1", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["etcd-v2"]["backend_calls_per_round"] > 0 and result["etcd-v3"]["backend_calls_per_round"] > 0
    assert result["round_ratio_v3_over_v2"] > 0
