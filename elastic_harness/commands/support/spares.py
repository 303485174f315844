"""Hot spares of a local run (``nodes.spares``), on the host's side.

A spare is one more agent than ``nodes.max``: torch's dynamic rendezvous keeps it in its
redundancy list, joined (it keeps alive) but in no group, and lets it into the next round
as soon as a round has fewer than ``nodes.max`` participants: a lost node's place is taken
at the same world size, so nothing reshards and the data layout stays. ``run`` starts the
spares once the group formed (its first ``rendezvous`` event): started with the others, a
spare could win a place in the first round and leave a planned node idle, and nothing could
tell which node is the spare.

Bad input is refused or named here: spares while the job could still grow (``--nodes`` below
``nodes.max``: a spare would join as one more node), a fault aimed at a spare (a warning:
it trains nothing until it replaces someone), a spare whose agent ended before it ever
joined (a warning naming it: say, it could not reach the rendezvous).

Call order: ``check(...)`` before anything starts; ``Spares(...)``; ``observe(e, cluster)``
for each event the host reads; ``watch(cluster, joined)`` on each pass of its loop.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from typing import Any

from elastic_harness.errors import HarnessError


def check(spares: int, nodes: int, max_nodes: int) -> None:
    """Refuse spares a job would take in as nodes (``HarnessError``: one line, exit 2)."""
    if spares and nodes != max_nodes:
        raise HarnessError(f"nodes.spares={spares} with --nodes {nodes} below nodes.max={max_nodes}: a spare "
                           "would join the job as one more node, not wait as a spare",
                           f"start --nodes {max_nodes} (the group full), or set nodes.spares=0")


def faults_on_spares(faults: Sequence[Any], nodes: int, spares: int) -> list[str]:
    """Pure: a warning for each node fault aimed at a spare (indexes ``nodes``..``nodes +
    spares - 1``): legal, but it hits a node that trains nothing yet."""
    from elastic_harness.chaos.vocabulary import KINDS, fault_text

    out = []
    for f in faults:
        if KINDS[f.kind].target == "node" and nodes <= f.target < nodes + spares:
            out.append(f"fault '{fault_text(f)}' hits node {f.target}, a spare: it trains nothing until it "
                       "replaces a lost node, so the fault tests the spare's own loss only")
    return out


class Spares:
    def __init__(self, count: int, first_index: int, say=None) -> None:
        self.count, self.first = count, first_index
        self.indexes = list(range(first_index, first_index + count))
        self.started = False
        self._warned: set[int] = set()
        self._say = say or (lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))

    def observe(self, e: dict, cluster: Any, events: Any) -> None:
        """Start the spares once the group formed (the first ``rendezvous`` event)."""
        if self.count and not self.started and e.get("event") == "rendezvous":
            self.started = True
            for index in self.indexes:
                cluster.add_node(index)
            events.emit("spares", nodes=[str(i) for i in self.indexes], world_size=e.get("world_size"))

    def watch(self, codes: dict[int, int | None], joined: Collection[str]) -> None:
        """Name, once, each spare whose agent ended before it ever joined the job."""
        for index in self.indexes:
            code = codes.get(index)
            if code not in (None, 0) and str(index) not in joined and index not in self._warned:
                self._warned.add(index)
                self._say(f"spare node {index} ended (exit {code}) before it ever joined the job: it cannot "
                          f"replace a lost node (see its log, logs/agent-{index}.log: could it reach the "
                          "rendezvous?)")

    def is_spare(self, index: int) -> bool:
        return index in self.indexes
