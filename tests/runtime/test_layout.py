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


def _verdict(ok: bool, reason: str = "", kind: str = ""):
    from elastic_harness.checkpoint.integrity import Verdict

    return Verdict(ok, reason, kind)


def test_choose_takes_the_newest_that_verifies_and_says_what_it_passed_over():
    from elastic_harness.checkpoint.layout import choose

    listing = {step_dirname(s): DONE for s in (10, 20, 30)}
    listing[step_dirname(40)] = ["__0_0.distcp"]  # interrupted save
    listing["step-0000030.bad-20260101T000000-abc123"] = DONE  # set aside earlier: never looked at
    asked = []

    def verify(name):
        asked.append(name)
        return _verdict(name == step_dirname(10), "x checksum mismatch (corrupt)", "corrupt")

    c = choose(listing, verify)
    assert c.chosen.step == 10 and asked == [step_dirname(30), step_dirname(20), step_dirname(10)]
    assert [(s.step, s.kind) for s in c.failed] == [(30, "corrupt"), (20, "corrupt")]
    assert [(s.step, s.kind) for s in c.incomplete] == [(40, "incomplete")]
    assert c.complete == 3
    again = choose(listing, verify, exclude={step_dirname(30)})
    assert [s.step for s in again.failed] == [20]
    none = choose({step_dirname(5): DONE}, lambda n: _verdict(False, "unreadable", "unreadable"))
    assert none.chosen is None and none.complete == 1


def test_quarantined_names_are_never_step_dirs_nor_counted_for_retention():
    from elastic_harness.checkpoint.layout import parse_quarantined, quarantine_name

    bad = quarantine_name(step_dirname(30), "20260101T000000-abc123")
    assert parse_step(bad) is None and parse_quarantined(bad) == 30
    listing = {step_dirname(s): DONE for s in (10, 20)} | {bad: DONE}
    dirs = scan(listing, require_manifest=True)
    assert [d.step for d in dirs] == [10, 20] and to_purge(dirs, keep=2) == []


def test_checkpoint_root_is_one_answer_for_every_caller():
    from elastic_harness.checkpoint.where import checkpoint_root, inside, is_url

    assert checkpoint_root("", "/runs/a") == "/runs/a/checkpoints"
    assert checkpoint_root("s3://b/p/", "/runs/a") == "s3://b/p"
    assert checkpoint_root("file:///data/ck", "/runs/a") == "/data/ck"
    assert checkpoint_root("/data/ck", "/runs/a") == "/data/ck"
    assert checkpoint_root("ck", "/runs/a") == "/runs/a/ck"  # relative to the run dir, not the cwd
    assert checkpoint_root("../shared", "/runs/a") == "/runs/shared"
    assert inside("/runs/a/checkpoints", "/runs/a") and inside("/runs/a/ck", "/runs/a/")
    assert not inside("/runs/ab", "/runs/a") and not inside("s3://b/p", "/runs/a")
    assert is_url("s3://b") and is_url("memory://x") and not is_url("file:///x") and not is_url("/x")
