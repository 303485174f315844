"""Pure: which way each fault of a bench run was recovered, and the survivors that kept their
process, counted over faults.

Per fault, ``of_fault`` reads ``report.inplace``'s account (``FaultRow.recovered_how``): in
place or restarted, the survivors there were (the members before the fault it did not hit:
the ``worker`` events of the generation it hit) and how many of them have the same pid (on
the same node) in the generation that recovered, and whether the in-place path was taken
and fell back. ``tally`` sums them over a row's faults: a row says "3 of 3 survivors kept
their process, 0 of 1 faults fell back" from the events alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_harness.report.inplace import IN_PLACE, Recovered


def of_fault(how: Recovered | None) -> dict:
    """One fault's record (``how`` None: it was not recovered, nothing to count)."""
    if how is None:
        return {"way": None, "mode": None, "survivors": None, "survivors_kept": None, "fell_back": None,
                "in_place_phases": None}
    return {"way": how.way, "mode": how.mode,
            "survivors": None if how.survivors is None else len(how.survivors),
            "survivors_kept": how.survivors_kept, "fell_back": how.fell_back, "in_place_phases": how.phases_s}


def tally(records: Sequence[dict]) -> dict:
    """Over faults (``of_fault``'s records): how many were recovered in place, restarted or
    not recovered, how many fell back, the survivors and those that kept their process, and
    whether every survivor of every in-place fault kept it (None without such a fault)."""
    done = [r for r in records if r.get("way") is not None]
    in_place = [r for r in done if r["way"] == IN_PLACE]
    counted = [r for r in done if r.get("survivors") is not None]
    whole = [r for r in in_place if r.get("survivors") is not None]
    return {"faults": len(records), "in_place": len(in_place), "restarted": len(done) - len(in_place),
            "not_recovered": len(records) - len(done), "fell_back": sum(bool(r.get("fell_back")) for r in done),
            "survivors": sum(r["survivors"] for r in counted),
            "survivors_kept": sum(r["survivors_kept"] or 0 for r in counted),
            "modes": sorted({r["mode"] for r in in_place if r.get("mode")}),
            "every_survivor_kept": (all(r["survivors_kept"] == r["survivors"] for r in whole) if whole else None)}
