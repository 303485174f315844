"""``bench rendezvous-scale`` (issue 36, item 5): its fits, and one small real measurement."""

from __future__ import annotations

import pytest

from elastic_harness.bench.rendezvous import scale

pytestmark = pytest.mark.timeout(120)


def test_fits_recover_known_growth():
    ns = [2, 4, 8, 16]
    a, b = scale.fit(ns, [3 * n + 0.5 * n * n for n in ns])
    assert a == pytest.approx(3) and b == pytest.approx(0.5)
    c, slope = scale.line(ns, [600 + 230 * n for n in ns])
    assert c == pytest.approx(600) and slope == pytest.approx(230)


def test_the_extrapolation_names_each_figure_at_the_target():
    rows = [{"nodes": n, "state_bytes": 600 + 200 * n, "keep_alive_per_s": {"calls": 5 * n, "bytes_sent": n * n,
                                                                             "bytes_received": n * n},
             "node_loss": {"calls": n * n, "bytes_sent": 10 * n, "bytes_received": 0, "lost_races": n}}
            for n in (2, 4, 8)]
    out = scale.extrapolate(rows, 100)
    assert out["state_bytes"]["at"] == 20600 and out["keep_alive_calls_per_s"]["at"] == 500
    assert out["keep_alive_bytes_per_s"]["at"] == 20000 and out["node_loss_calls"]["at"] == 10000


def test_bad_node_counts_are_one_line(cli_here):
    r = cli_here("bench", "rendezvous-scale", "--nodes", "1,2")
    assert r.code == 2 and "--nodes needs counts of 2 or more" in r.err
    r = cli_here("bench", "rendezvous-scale", "--nodes", "two")
    assert r.code == 2 and "is not a list of numbers" in r.err


def test_three_light_agents_form_idle_and_lose_one():
    row = scale.measure(3, idle_s=1.0)
    assert row["nodes"] == 3 and row["state_bytes"] > 0
    assert row["form"]["writes"] >= 3, "each agent wrote itself into round 0"
    assert row["keep_alive_per_s"]["calls"] > 0
    assert row["node_loss"]["writes"] >= 4, "two survivors left the round and joined the next"
