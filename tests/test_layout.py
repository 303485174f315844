"""Which checkpoint to load and which to purge (pure)."""

from __future__ import annotations

from elastic_harness.checkpoint.layout import (
    load_candidates,
    parse_step,
    scan,
    step_dirname,
    to_purge,
)

DONE = [".metadata", "manifest.json", "__0_0.distcp"]


def test_names_round_trip():
    assert step_dirname(120) == "step-0000120"
    assert parse_step("step-0000120") == 120
    assert parse_step("step-0000120.corrupt") is None
    assert parse_step("checkpoints") is None


def test_incomplete_dirs_are_never_candidates():
    listing = {
        step_dirname(10): DONE,
        step_dirname(20): DONE,
        step_dirname(30): ["__0_0.distcp"],  # crashed before .metadata
        step_dirname(40): [".metadata", "__0_0.distcp"],  # crashed before the manifest
        "junk": DONE,
    }
    dirs = scan(listing, require_manifest=True)
    assert [d.step for d in load_candidates(dirs)] == [20, 10]
    assert [d.step for d in load_candidates(scan(listing))] == [40, 20, 10]


def test_purge_keeps_newest_k_milestones_and_protected():
    listing = {step_dirname(s): DONE for s in range(10, 110, 10)}
    listing[step_dirname(110)] = ["__0_0.distcp"]
    dirs = scan(listing, require_manifest=True)
    purged = [d.step for d in to_purge(dirs, keep=3)]
    assert purged == [10, 20, 30, 40, 50, 60, 70]
    purged = [d.step for d in to_purge(dirs, keep=3, keep_every=50, protected={20})]
    assert purged == [10, 30, 40, 60, 70]
    assert 110 not in [d.step for d in to_purge(dirs, keep=2)]


def test_nothing_purged_below_keep():
    dirs = scan({step_dirname(1): DONE, step_dirname(2): DONE}, require_manifest=True)
    assert to_purge(dirs, keep=2) == []
