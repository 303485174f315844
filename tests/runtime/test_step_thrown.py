"""A step thrown away under a re-formation in place (``Step.thrown``) starts no vote: its
generation is gone, and the next one's members that did not throw it (a survivor parked
for a join at a step's end) never meet that all-reduce. A rank that launched it was one
collective ahead of its peers from then on (gloo aborted it on the sizes)."""

from __future__ import annotations

import pytest

from elastic_harness.runtime.step import Step

pytestmark = pytest.mark.timeout(30)


class Hook:
    """What ``Step.batches`` asks of its hook; ``throws``: the generation broke under the step
    and the step could not be finished in place (``RunInPlace.finish`` marks it thrown)."""

    model = None

    def __init__(self, throws: bool) -> None:
        self.throws, self.votes = throws, []

    def begin_batches(self, step: Step) -> None:
        pass

    def end_batches(self, reduce: bool = True) -> None:
        pass

    def finish_in_flight(self, step: Step) -> None:
        if self.throws:
            step.thrown = True

    def start_vote(self, step: Step) -> None:
        self.votes.append(step.number)


@pytest.mark.parametrize("throws", [False, True])
def test_only_a_step_that_was_not_thrown_starts_its_vote(throws):
    hook = Hook(throws)
    step = Step(hook, 7, plan=[[0, 1], [2, 3]], batches=["a", "b"])
    assert list(step.batches()) == ["a", "b"]
    assert hook.votes == ([] if throws else [7])
