"""Issue 42: no outsider stops a healthy job. A store client writing the change count, an
older sealed state written back, a key file others can read.

As in ``test_security``: torch's handlers (ours) in threads of this process against a real
c10d ``TCPStore`` (or a real etcd), the forger a plain client of the same store.
"""

from __future__ import annotations

import logging

import pytest

from elastic_harness.launch.changes import Counts
from tests.launch.test_rendezvous import join_all
from tests.security.test_security import KEY, handler, store  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(90)


def stop(handlers) -> None:
    for h in handlers:
        h._stop_heartbeats()
        getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


@pytest.mark.parametrize("forged", [b"\xff\x00garbage", b"9" * 23, b"41"])
def test_a_forged_change_count_is_refused_and_rewritten_and_the_job_goes_on(store, forged, caplog):  # noqa: F811
    """One write to ``torch.rendezvous.<id>.changes`` then any fault ended a c10d job: the
    agents' ``add`` on a value that is no number made the store drop their connections
    ("stoll"), and they took the store host for lost (exit 200). A bare number was taken as
    the count. Now the count is the job's own (sealed), a forged one is refused and
    rewritten, and the agents form their next round."""
    import torch.distributed as dist

    pair = [handler(f"127.0.0.1:{store.port}", "count") for _ in range(2)]
    counter = "torch.rendezvous.count.changes"
    try:
        assert join_all(pair) == [2, 2]
        forger = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        forger.set(counter, forged)
        with caplog.at_level(logging.WARNING, logger="elastic_harness.launch.sealed"):
            pair[0].group_failed()  # a worker crash: its agent writes the round broken, a counted change
            assert join_all(pair) == [2, 2], "the round after the fault formed"
        assert Counts(KEY, "torch.rendezvous.count").open(forger.get(counter)) is not None, "rewritten as the job's"
        assert any("refused the rendezvous change count" in r.getMessage() and counter in r.getMessage()
                   for r in caplog.records)
    finally:
        stop(pair)


def test_a_change_count_opens_only_as_this_jobs_for_this_rendezvous():
    counts = Counts(KEY, "torch.rendezvous.a")
    assert counts.open(counts.close(7)) == 7
    assert counts.close(7) != counts.close(7), "two writers of the same count write different values"
    assert Counts(KEY, "torch.rendezvous.b").open(counts.close(7)) is None, "another rendezvous' count"
    assert Counts(b"o" * 32, "torch.rendezvous.a").open(counts.close(7)) is None, "another job's key"
    for bad in (b"", b"7", b"9" * 23, b"\xff\x00garbage", b"7.ab.", counts.close(7).replace(b"7.", b"8.", 1)):
        assert counts.open(bad) is None, bad
