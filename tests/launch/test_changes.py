"""``rendezvous.changes``: word of a rendezvous change pushed through a real c10d store, from the
signal up to the agent's wait between monitor passes."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import textwrap
import threading

import pytest

from elastic_harness.rendezvous.changes import ChangeSignal

pytestmark = pytest.mark.timeout(60)

KEY = "torch.rendezvous.changes-test"
JOB_KEY = b"k" * 32


@pytest.fixture
def server():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    opened: list[ChangeSignal] = []

    def signal() -> ChangeSignal:
        s = ChangeSignal(client(store.port), KEY, lambda: client(store.port), JOB_KEY)
        opened.append(s)
        return s

    yield store, signal
    for s in opened:
        s.close()


def client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=10))


def test_a_change_wakes_a_waiter_whichever_comes_first(server):
    _, signal = server
    writer, reader = signal(), signal()
    seen = reader.version  # read before the state: a change after it is never missed
    writer.announce()
    assert reader.wait_beyond(seen, timeout=20)
    seen = reader.version
    done = threading.Event()
    threading.Thread(target=lambda: (reader.wait_beyond(seen, timeout=20), done.set())).start()
    writer.announce()  # the waiter may or may not be waiting yet: either way it wakes
    assert done.wait(20)
    assert reader.version > seen


def test_no_change_no_wake(server):
    _, signal = server
    writer, reader = signal(), signal()
    seen = reader.version
    assert not reader.wait_beyond(seen, timeout=0.2)
    writer.announce()
    assert reader.wait_beyond(seen, timeout=20)


def test_listeners_hear_each_change_on_the_signals_thread(server):
    _, signal = server
    writer, reader = signal(), signal()
    heard = threading.Event()
    reader.listen(heard.set)
    writer.announce()
    assert heard.wait(20)


def test_close_ends_the_thread_and_later_waits_are_sleeps(server):
    _, signal = server
    reader = signal()
    thread = reader._thread if reader.version >= 0 else None
    assert thread is not None and thread.is_alive()
    reader.close()  # its thread leaves its wait by announcing one change (everyone reads once)
    assert not thread.is_alive()
    assert not reader.wait_beyond(reader.version, timeout=0.1)
    reader.close()  # twice is fine


def test_a_store_that_goes_away_ends_the_thread_not_the_agent():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    reader = ChangeSignal(client(port), KEY, lambda: client(port), JOB_KEY)
    seen = reader.version
    thread = reader._thread
    del store  # the store's host is gone
    thread.join(20)
    assert not thread.is_alive() and reader.failed
    assert not reader.wait_beyond(seen, timeout=0.1)


def test_a_process_hosting_the_store_ends_normally_with_a_signal_open(tmp_path):
    """Its thread inside the store's wait would abort the interpreter's exit ("terminate
    called without an active exception"): ``close_all`` runs at exit."""
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from elastic_harness.rendezvous.changes import ChangeSignal
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        connect = lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False)
        signal = ChangeSignal(connect(), {KEY!r}, connect, {JOB_KEY!r})
        assert signal.version == 0
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
    assert "terminate called" not in proc.stderr
