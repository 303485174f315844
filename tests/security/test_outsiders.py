"""Issue 42: no outsider stops a healthy job. A store client writing the change count, an
older sealed state written back, a key file others can read.

As in ``test_security``: torch's handlers (ours) in threads of this process against a real
c10d ``TCPStore`` (or a real etcd), the forger a plain client of the same store.
"""

from __future__ import annotations

import base64
import logging

import pytest

from elastic_harness.rendezvous.changes import Counts
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
        with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
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


# --- a refused read is never the base of a write; an older state written back is refused ---

def c10d_backend(port: int, run_id: str):
    import torch.distributed as dist

    from elastic_harness.rendezvous import sealed

    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    return sealed.SealedC10dBackend(client, run_id, sealed.StateSeal(KEY, run_id))


def test_etcd_a_refused_read_is_never_the_base_of_a_write(tmp_path, caplog):
    """a saw S1; b wrote S2 on it; an outsider put garbage over S2. a's read is refused: its
    base is S2, the newest value of the key's history it may use (it used to be a's own S1,
    with the garbage's revision as token, so a's next write erased b's S2 for good)."""
    from tests.launch.test_etcd_v3 import backend, raw
    from tests.servers import etcd_server

    (tmp_path / "etcd").mkdir()
    with etcd_server(tmp_path / "etcd" / "data") as etcd:
        (a, _), (b, _) = backend(etcd, "base"), backend(etcd, "base")
        _, token, _ = a.set_state(b"S1")
        assert b.get_state()[0] == b"S1"
        b.set_state(b"S2", b.get_state()[1])
        key = base64.b64encode(a.key).decode()
        for i in range(5):  # a short burst
            raw(etcd, "kv/put", {"key": key, "value": base64.b64encode(b"garbage %d" % i).decode()})
        with caplog.at_level(logging.WARNING):
            state, token = a.get_state()
        assert state == b"S2", "the base of a's next write is b's S2, not a's own S1"
        assert "not signed with this job's key" in caplog.text
        assert a.set_state(b"S3 on S2", token)[2], "a's write replaces the garbage"
        assert b.get_state()[0] == b"S3 on S2"


def test_etcd_an_older_state_written_back_is_refused_and_said(tmp_path, caplog):
    """A sealed state of this job captured earlier and written back (a replay) was taken as
    current, without a word: a round stalled 121 s. Now it is refused with one line, and the
    agent goes on from the newest state (the history's, here its own)."""
    from tests.launch.test_etcd_v3 import backend, raw
    from tests.servers import etcd_server

    (tmp_path / "etcd").mkdir()
    with etcd_server(tmp_path / "etcd" / "data") as etcd:
        (a, _), (b, _) = backend(etcd, "replay"), backend(etcd, "replay")
        key = base64.b64encode(a.key).decode()
        _, token, _ = a.set_state(b"round 1")
        old = raw(etcd, "kv/range", {"key": key})["kvs"][0]["value"]
        a.set_state(b"round 2", token)
        assert b.get_state()[0] == b"round 2"
        raw(etcd, "kv/put", {"key": key, "value": old})  # the outsider writes round 1 back
        with caplog.at_level(logging.WARNING):
            assert a.get_state()[0] == b"round 2" and b.get_state()[0] == b"round 2"
        assert "refused an older rendezvous state of 'replay'" in caplog.text


def test_c10d_a_state_written_from_a_refused_read_does_not_erase_a_newer_one(store, caplog):  # noqa: F811
    """c10d keeps no history: a, which refused garbage, writes from its own older S1; b,
    which wrote S2 on S1, refuses a's write as older than what it saw and writes S2 back
    (its next write), and a takes it: the newest state wins, not the last writer."""
    a, b = c10d_backend(store.port, "c10d-base"), c10d_backend(store.port, "c10d-base")
    _, token, _ = a.set_state(b"S1")
    _, token, _ = b.set_state(b"S2", b.get_state()[1])
    store.set("torch.rendezvous.c10d-base", b"garbage")
    state, token = a.get_state()
    assert state == b"S1"  # all a has: the store holds nothing else
    assert a.set_state(b"S1 again", token)[2]
    with caplog.at_level(logging.WARNING):
        state, token = b.get_state()
    assert state == b"S2" and "refused an older rendezvous state" in caplog.text
    assert b.set_state(b"S2 kept", token)[2]
    assert a.get_state()[0] == b"S2 kept", "a takes the newer state"


# --- a key file others can read ---------------------------------------------------------------

def test_a_key_file_every_user_can_read_is_refused_in_one_line_before_any_launch(cli_here, tmp_path, monkeypatch):
    """``chmod 644`` on the key named by ``ELASTIC_HARNESS_KEY_FILE`` was used without a word,
    though whoever reads it can seal a rendezvous state that torch unpickles. Refused now:
    exit 2, one line and its fix, nothing started (a key its group can read is named, not
    refused: ``jobkey.check_private``)."""
    from elastic_harness import jobkey
    from tests.conftest import MLP

    path = tmp_path / "job.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o644)
    monkeypatch.setenv(jobkey.KEY_FILE_VAR, str(path))
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run", "--set", "train.steps=5")
    assert r.code == 2 and "Traceback" not in r.err, r.err
    line, fix = r.err.strip().splitlines()
    assert str(path) in line and "every user of this machine (mode 0644)" in line and "not used" in line
    assert f"chmod 600 {path}" in fix
    assert not (tmp_path / "run" / "events.jsonl").exists(), "nothing was launched"
    path.chmod(0o640)
    assert jobkey.check_private(path, path.stat().st_mode).startswith(f"the job's key {path} can be read by its group")
    assert jobkey.check_private(path, path.stat().st_mode, shared_group=False) == "", "a group of no one else"
    path.chmod(0o600)
    assert jobkey.check_private(path, path.stat().st_mode) == ""
    assert jobkey.exposure(0o100602) == "others", "replaceable by anyone: refused too"
