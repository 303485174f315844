"""``bench buddy``'s summary (pure): what a copy costs when only some steps send one."""

from __future__ import annotations

import argparse

from elastic_harness.bench.recovery.buddy import summarize


def rank(copy_steps: list[float], sent: int) -> dict:
    flat = [0.010] * len(copy_steps)
    return {"wall": {"none": flat, "snapshot": flat, "copy": copy_steps},
            "cpu": {"none": flat, "snapshot": flat, "copy": flat},
            "save": {"snapshot": [0.001], "copy": [0.001]}, "copy_cost": [0.001], "copy_wall": [0.005],
            "sent": sent, "parts": {}}


def test_a_copy_sent_on_a_third_of_the_steps_is_costed_per_copy_not_by_the_median_step():
    # 3 of 9 copy-mode steps sent a copy, each 6 ms longer: the median step sent none.
    steps = [0.016, 0.010, 0.010] * 3
    out = summarize([rank(steps, 3), rank(steps, 3)], argparse.Namespace(hidden=64, depth=2, block=15))
    assert out["copy_extra_ms"] == 0.0, "the median hides it"
    assert out["copy_extra_mean_ms"] == 2.0
    assert out["copy_extra_per_copy_ms"] == 6.0
    assert out["copies_sent_share"] == round(3 / 9, 3)
