"""The fault vocabulary: per kind, what it hits, who fires it, what it needs, and how.

Pure data and pure decisions; the code that carries faults out reads its recipe here:
``chaos.inject`` on the host (the ``run`` supervisor) and ``runtime.faults`` inside a
worker. The job spec lists the same kind names (``FaultSpec.kind``; ``spec`` may import
nothing of ours, so a test keeps the two lists equal).

Who fires a fault:

- **the worker it hits**, right after the step it names, when the kind is
  ``worker_fires`` and the fault is keyed by step (``@STEP``): a host watching events
  would see the step late. Rank faults are fired by that global rank, node faults by the
  node's local rank 0 against its own agent, so only this job's processes are signalled.
- **the host** otherwise: time-keyed faults (``@Ns``), ``add-node``, ``hang-node``,
  ``partition``/``heal``, and every fault requested while the job runs (``chaos`` command),
  which fires as soon as the host sees it (``FIRE_NOW_S``).

How (``Kind.how``): ``signal`` sends ``Kind.signal`` to ``Kind.reaches``:

- ``rank``: the rank's own process;
- ``agent``: the node's agent process only (it forwards SIGTERM to its workers);
- ``agent-group``: the agent's process group and its workers. A worker firing such a fault
  signals the agent, every process under it and itself, in that order
  (``runtime.faults.node_processes``); the workers also carry ``PR_SET_PDEATHSIG``, which
  would end them one parent's exit later;
- ``node``: the agent's process group and every worker of the node: torchelastic starts
  workers in their own sessions and a SIGSTOP passes to no one.

``start-node`` starts one more agent; ``link-down``/``link-up`` take a node's network link
down or up, which needs simulated hosts (``run --netns``, as root).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from elastic_harness.errors import HarnessError, SpecError
from elastic_harness.spec import FaultSpec

# at_seconds of a fault that fires as soon as the host sees it: due() fires a time-keyed
# fault once elapsed >= at_seconds, and FaultSpec refuses 0 (0 means "not time-keyed").
FIRE_NOW_S = 0.001


@dataclass(frozen=True)
class Kind:
    name: str
    target: Literal["rank", "node", "none"]  # what the number after ':' names
    how: Literal["signal", "start-node", "link-down", "link-up"]
    signal: signal.Signals | None = None  # how == "signal": which one
    reaches: Literal["rank", "agent", "agent-group", "node", ""] = ""  # how == "signal": whom (module doc)
    worker_fires: bool = False  # a step-keyed fault of this kind is fired by the worker it hits
    needs_netns: bool = False
    doc: str = ""
    failure: bool = True  # what it does is a failure the job recovers from (not a node added, a link healed)


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("kill-worker", "rank", "signal", signal.SIGKILL, "rank", worker_fires=True,
         doc="SIGKILL global rank R; the agent restarts the group from the last checkpoint"),
    Kind("hang", "rank", "signal", signal.SIGSTOP, "rank", worker_fires=True,
         doc="SIGSTOP rank R; the step watchdog kills it after timeouts.step"),
    Kind("preempt", "node", "signal", signal.SIGTERM, "agent", worker_fires=True,
         doc="SIGTERM node N's agent: its workers drain and save, the agent exits 143"),
    Kind("kill-node", "node", "signal", signal.SIGKILL, "agent-group", worker_fires=True,
         doc="SIGKILL node N's agent and workers; survivors go on if >= nodes.min"),
    Kind("hang-node", "node", "signal", signal.SIGSTOP, "node",
         doc="SIGSTOP node N's agent and workers; the rest go on without it"),
    Kind("add-node", "none", "start-node", failure=False,
         doc="start another agent; the group drains, saves and grows"),
    Kind("partition", "node", "link-down", needs_netns=True,
         doc="take node N's link down (--netns); an isolated agent stops itself"),
    Kind("heal", "node", "link-up", needs_netns=True, failure=False, doc="bring node N's link back up (--netns)"),
)}


def fired_by_worker(f: FaultSpec) -> bool:
    """Is ``f`` fired inside the worker it hits (a step-keyed fault of a worker kind)?"""
    return KINDS[f.kind].worker_fires and bool(f.at_step)


def fire_now(f: FaultSpec) -> FaultSpec:
    """``f`` as a fault the host fires as soon as it sees it, whatever its kind or timing."""
    return FaultSpec(kind=f.kind, target=f.target, at_seconds=FIRE_NOW_S, duration=f.duration)


def check_netns(faults: Iterable[FaultSpec], netns: bool) -> None:
    """Refuse faults that need simulated hosts when the job has none (the one home of that rule)."""
    needing = sorted({f.kind for f in faults if KINDS[f.kind].needs_netns})
    if needing and not netns:
        names = " and ".join(f"'{k}'" for k in needing)
        raise HarnessError(f"{names} faults need simulated hosts with their own network",
                           "run with --netns (as root)")


def check_targets(faults: Sequence[FaultSpec], ranks: int, nodes: int, steps: int = 0) -> None:
    """Refuse targets that can never exist: a fault on them would wait forever or crash.

    ``ranks`` is the largest world size (nodes.max x nproc_per_node); ``nodes`` the number of
    node indexes the run can have (nodes started plus one per ``add-node``); ``steps`` the
    job's ``train.steps`` (0: not checked): a fault after the last step would never fire.
    """
    for f in faults:
        if steps and f.at_step > steps:
            raise HarnessError(f"fault '{fault_text(f)}' is keyed to step {f.at_step}, but this job "
                               f"trains {steps} steps only, so it would never fire",
                               f"pick a step from 1 to {steps}, or raise train.steps")
        kind = KINDS[f.kind]
        limit, what = (ranks, "rank") if kind.target == "rank" else (nodes, "node")
        if kind.target != "none" and f.target >= limit:
            raise HarnessError(f"fault '{f.kind}' targets {what} {f.target}, but this job has "
                               f"{what}s 0..{limit - 1} only", f"pick a {what} from 0 to {limit - 1}")


def fault_text(f: FaultSpec) -> str:
    """``f`` in the form ``--chaos`` takes (``parse_fault`` reads it back)."""
    target = "" if KINDS[f.kind].target == "none" else f":{f.target}"
    when = f"@{f.at_step}" if f.at_step else f"@{f.at_seconds:g}s"
    return f"{f.kind}{target}{when}{'+' + f.during if f.during else ''}"


# KIND[:TARGET][@STEP[+PHASE] | @SECONDSs]; every part is checked, nothing is guessed.
_FAULT = re.compile(r"(?P<kind>[^:@]*)(?::(?P<target>[^@]*))?(?:@(?P<when>[^+]*)(?:\+(?P<during>.*))?)?",
                    re.DOTALL)
_NUMBER = re.compile(r"[0-9]+")
_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?s")
FORM = ("KIND[:TARGET][@STEP[+backward|+reduction]|@SECONDSs], e.g. kill-worker:1@20, kill-node:1@30s "
        "or kill-node:1@20+backward")


def parse_fault(text: str, flag: str = "--chaos") -> FaultSpec:
    """Parse the text form of a fault; no ``@`` means now. Raises ``SpecError`` naming the fix."""
    m = _FAULT.fullmatch(text)
    kind = KINDS.get(m["kind"])
    if kind is None:
        raise SpecError(flag, f"{text!r}: kind {m['kind']!r} is not one of {', '.join(KINDS)}", FORM)
    raw: dict = {"kind": kind.name}
    if m["target"] is not None:
        if kind.target == "none":
            raise SpecError(flag, f"{text!r}: {kind.name} takes no target", f"e.g. {kind.name}@100")
        if not _NUMBER.fullmatch(m["target"]):
            raise SpecError(flag, f"{text!r}: target {m['target']!r} is not a {kind.target} number "
                                  "(0, 1, ...)", FORM)
        raw["target"] = int(m["target"])
    when = m["when"]
    if when is None:
        raw["at_seconds"] = FIRE_NOW_S
    elif _NUMBER.fullmatch(when) and int(when) > 0:
        raw["at_step"] = int(when)
    elif _SECONDS.fullmatch(when) and float(when[:-1]) > 0:
        raw["at_seconds"] = float(when[:-1])
    else:
        raise SpecError(flag, f"{text!r}: {'@' + when!r} is not a step (1, 2, ...) or seconds (30s, 2.5s)", FORM)
    if m["during"] is not None:
        if m["during"] not in ("backward", "reduction"):
            raise SpecError(flag, f"{text!r}: '+{m['during']}' is not +backward or +reduction", FORM)
        raw["during"] = m["during"]
    from elastic_harness.spec.loader import build

    return build(FaultSpec, raw, flag)
