"""``report``'s account of how each fault was recovered (``report.inplace``): in place or
restarted, which members kept their process, the in-place phases. Pure, on synthetic events
written with round numbers; the real runs' reports are checked in tests/e2e/test_in_place.py."""

from __future__ import annotations

import pytest

from elastic_harness.commands.report import fault_json, how_line, render
from elastic_harness.report.inplace import IN_PLACE, RESTART, Member, hit, members_at
from elastic_harness.report.timeline import build
from tests.report.test_report import ev, steps

pytestmark = pytest.mark.timeout(60)


def worker(t, pid, rank, node, world_size, restart=0):
    return ev(t, "worker", pid, rank=rank, node=node, world_size=world_size, restart=restart)


def first_generation(nodes: tuple[str, str] = ("0", "1"), pids: tuple[int, int] = (10, 11)) -> list[dict]:
    """Ranks 0 and 1 (nodes and pids as given) train steps 1..20 from t=1 at 0.1 s/step."""
    return [ev(0.0, "start", 99, who="host"),
            worker(0.5, pids[0], 0, nodes[0], 2), worker(0.5, pids[1], 1, nodes[1], 2),
            ev(0.6, "rendezvous", pids[0], generation="g1", world_size=2, restart=0),
            ev(1.0, "resume", pids[0], fresh=True, step=0, world_size=2), *steps(pids[0], 1, 20, 1.0, 0.1)]


def node_lost_in_place(pids: tuple[int, int] = (10, 11), nodes: tuple[str, str] = ("0", "1")) -> list[dict]:
    """Node 1 SIGKILLed after step 20 (t=3.0); rank 0 left its step and parked at 3.25, had its
    place at 3.45, re-formed at 3.5 and re-pointed its run alone; restored at 3.6, stepped at 3.7."""
    me = pids[0]
    return [*first_generation(nodes, pids),
            ev(3.0, "fault", pids[1], kind="kill-node", target=1, step=20, rank=1, node=nodes[1]),
            ev(3.3, "workers", 5, node=nodes[0], state="broken", restart=0),
            ev(3.5, "reformed", me, rank=0, mode="repoint", phases_s={"leave": 0.1, "park": 0.2, "reform": 0.05}),
            ev(3.5, "workers", 5, node=nodes[0], state="started", restart=1, kept=[me], forked=[]),
            worker(3.52, me, 0, nodes[0], 1, restart=1),
            ev(3.53, "rendezvous", me, generation="g2", world_size=1, restart=1),
            ev(3.54, "recovery", me, generation="g2", mode="repoint", kept=[me], new=[], world_size=1),
            ev(3.6, "resume", me, step=20, world_size=1, source="memory"),
            *steps(me, 21, 25, 3.6, 0.1, world_size=1)]


def test_a_node_lost_in_place_says_who_kept_its_process_and_each_phase():
    (f,) = build(node_lost_in_place()).faults
    how = f.recovered_how
    assert (how.way, how.mode, how.tried, how.fell_back) == (IN_PLACE, "repoint", True, False)
    assert how.survivors == (Member(0, "0", 10),) and how.survivors_kept == 1 and how.new == ()
    assert [(k.before, k.after) for k in how.kept] == [(Member(0, "0", 10), Member(0, "0", 10))]
    assert how.phases_s == pytest.approx({"leave": 0.25, "park": 0.2, "reform": 0.05, "restore": 0.1,
                                          "first_step": 0.1})
    assert sum(how.phases_s.values()) == pytest.approx(f.recovery_s), "the phases add up to the recovery"
    line = how_line(how)
    assert line.startswith("in place (repoint); 1 of 1 survivor(s) kept their process; kept: rank 0 (pid 10)")
    assert "leave 0.250, park 0.200, re-form 0.050, restore 0.100, first step 0.100 s" in line
    text = "\n".join(render(build(node_lost_in_place()), "run"))
    assert "1 recovered (1 in place)" in text and "  #0 in place (repoint)" in text
    row = fault_json(f)["recovered_how"]
    assert row["survivors_kept"] == 1 and row["fell_back"] is False and row["kept"][0]["before"]["pid"] == 10


def test_a_crash_recovered_in_place_names_the_new_worker_and_a_moved_rank():
    """Rank 0 of two on one node crashes; rank 1 keeps its process and becomes rank 0 beside a
    new rank 1 (a rerun)."""
    events = [*first_generation(("0", "0")),
              ev(3.0, "fault", 10, kind="kill-worker", target=0, step=20, rank=0, node="0"),
              ev(3.4, "reformed", 11, rank=0, mode="rerun", phases_s={"leave": 0.05, "park": 0.2, "reform": 0.1}),
              worker(3.5, 11, 0, "0", 2, restart=1), worker(3.5, 12, 1, "0", 2, restart=1),
              ev(3.51, "rendezvous", 11, generation="g2", world_size=2, restart=1),
              ev(3.52, "recovery", 11, generation="g2", mode="rerun", kept=[11], new=[12], world_size=2),
              ev(3.8, "resume", 11, step=20, world_size=2, source="memory"), *steps(11, 21, 22, 3.8, 0.1)]
    how = build(events).faults[0].recovered_how
    assert (how.way, how.mode, how.survivors_kept, how.new) == (IN_PLACE, "rerun", 1, (Member(1, "0", 12),))
    assert "kept: rank 1 (pid 11, now rank 0); new: rank 1 (pid 12)" in how_line(how)


def restarted(events: list[dict], *, fell_back: bool) -> list[dict]:
    """After the fault: every worker anew (pids 20, 21), no generation entered in place; with
    ``fell_back``, rank 0 had parked and been kept by its agent first, then ended."""
    tried = [ev(3.5, "workers", 5, node="0", state="started", restart=1, kept=[10], forked=[12])] if fell_back else []
    return [*events[:events.index(next(e for e in events if e["event"] == "fault")) + 1], *tried,
            worker(4.5, 20, 0, "0", 2, restart=2), worker(4.5, 21, 1, "1", 2, restart=2),
            ev(4.6, "rendezvous", 20, generation="g3", world_size=2, restart=2),
            ev(4.9, "resume", 20, step=20, world_size=2, source="memory"), *steps(20, 21, 22, 4.9, 0.1)]


def test_a_restart_says_so_and_counts_the_survivors_that_lost_their_process():
    events = restarted(node_lost_in_place(), fell_back=False)
    events[events.index(next(e for e in events if e["event"] == "fault"))].update(kind="kill-worker", target=1)
    how = build(events).faults[0].recovered_how
    assert (how.way, how.mode, how.phases_s, how.kept) == (RESTART, None, None, ())
    assert how.survivors == (Member(0, "0", 10),) and how.survivors_kept == 0 and not how.fell_back
    assert len(how.new) == 2
    assert how_line(how).startswith("restarted; 0 of 1 survivor(s) kept their process; new: rank 0 (pid 20)")
    assert "1 recovered (0 in place)" in "\n".join(render(build(events), "run"))


def test_a_fault_whose_in_place_path_failed_fell_back():
    how = build(restarted(node_lost_in_place(), fell_back=True)).faults[0].recovered_how
    assert (how.way, how.tried, how.fell_back) == (RESTART, True, True)
    assert how_line(how).startswith("restarted (the in-place path failed); 0 of 1 survivor(s)")


def test_members_are_told_apart_by_node_and_pid():
    """Simulated hosts have pid namespaces of their own: both ranks can be pid 7. The survivor
    is node 0's pid 7, and it kept its process; node 1's pid 7 was hit."""
    how = build(node_lost_in_place(pids=(7, 7))).faults[0].recovered_how
    assert how.survivors == (Member(0, "0", 7),) and how.survivors_kept == 1 and how.new == ()
    assert [(k.before, k.after) for k in how.kept] == [(Member(0, "0", 7), Member(0, "0", 7))], \
        "node 1's pid 7 is not node 0's: it did not go on"


def test_members_are_the_newest_generation_and_a_fault_hits_its_target():
    events = node_lost_in_place()
    assert members_at(events, 3.0) == (Member(0, "0", 10), Member(1, "1", 11))
    assert members_at(events, 4.0) == (Member(0, "0", 10),), "rank 1 of the 2-rank generation is not a member"
    assert members_at(events, 0.1) == ()
    two = members_at(events, 3.0)
    assert hit({"kind": "kill-node", "target": 1}, two) == (Member(1, "1", 11),)
    assert hit({"kind": "kill-worker", "target": 0}, two) == (Member(0, "0", 10),)
    assert hit({"kind": "add-node", "target": 0}, two) == ()
    assert hit({"kind": "SIGKILL", "cause": "exit", "target": 1}, two) == (Member(1, "1", 11),)
    assert hit({"kind": "lost peer", "cause": "exit", "peer_lost": True, "target": 0}, two) is None
    assert hit({"kind": "node lost", "cause": "node-lost", "target": 0}, two) is None


def test_a_fault_not_recovered_has_no_account():
    events = [e for e in node_lost_in_place() if not (e["event"] == "step" and e["step"] > 20)]
    assert build(events).faults[0].recovered_how is None


def node_lost_mid_step_finished() -> list[dict]:
    """Node 1 SIGKILLed inside step 21 (t=3.0): rank 0 left the step, re-formed alone and
    finished step 21 in place at 3.6 (no restore), its step event at 3.7."""
    me = 10
    return [*first_generation(),
            ev(3.0, "fault", 11, kind="kill-node", target=1, step=20, rank=1, node="1"),
            ev(3.5, "reformed", me, rank=0, mode="finish", phases_s={"leave": 0.1, "park": 0.2, "reform": 0.05}),
            ev(3.5, "workers", 5, node="0", state="started", restart=1, kept=[me], forked=[]),
            worker(3.52, me, 0, "0", 1, restart=1),
            ev(3.53, "rendezvous", me, generation="g2", world_size=1, restart=1),
            ev(3.54, "recovery", me, generation="g2", mode="repoint", kept=[me], new=[], world_size=1),
            ev(3.6, "finished", me, step=21, lost_dp_ranks=[1], world_size=1, extra_samples=15),
            *steps(me, 21, 25, 3.6, 0.1, world_size=1)]


def test_a_step_finished_in_place_is_a_recovery_with_nothing_loaded_and_no_step_lost():
    (f,) = build(node_lost_mid_step_finished()).faults
    assert (f.loaded, f.resumed_from, f.steps_lost, f.source) == (None, 20, 0, "the step in flight")
    how = f.recovered_how
    assert (how.way, how.mode, how.survivors_kept) == (IN_PLACE, "finish", 1)
    assert "re-form 0.050, finish the step 0.100, first step 0.100 s" in how_line(how)
