"""Our rendezvous state backends (``rendezvous.sealed``): torch's public ``RendezvousBackend``
interface, the state sealed, made through torch's handler registry (no torch backend class
subclassed); real c10d rounds show garbage and a deleted key never end or stall an agent."""

from __future__ import annotations

import base64

import pytest

from elastic_harness.rendezvous import sealed
from tests.launch.test_rendezvous import join_all

pytestmark = pytest.mark.timeout(120)
KEY = b"k" * 32


def test_a_value_of_another_rendezvous_id_or_key_is_refused():
    ours, other_id, other_key = (sealed.StateSeal(KEY, "r"), sealed.StateSeal(KEY, "q"),
                                 sealed.StateSeal(b"o" * 32, "r"))
    for stranger in (other_id, other_key):
        assert ours.authentic(base64.b64encode(stranger.close(b"x"))) is None
    import pickle

    fresh = ours.open(b"\xff\xfe not even text")
    assert type(pickle.loads(fresh)).__name__ == "_RendezvousState"


def test_both_backends_are_ours_on_torchs_public_interface():
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

    for ours in (sealed.SealedC10dBackend, sealed.SealedEtcdBackend):
        assert issubclass(ours, RendezvousBackend)
        assert not issubclass(ours, (C10dRendezvousBackend, EtcdRendezvousBackend))


# --- real c10d rounds -------------------------------------------------------------------------

@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def handler(port: int, run_id: str, read_timeout: int = 30):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous.handler import create_handler

    conf = dict(join_timeout=30, last_call_timeout=1, start_last_call_timeout=3, close_timeout=10,
                heartbeat_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=3, is_host=False,
                read_timeout=read_timeout)
    return create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 1, 2, **conf), key=KEY)


def test_the_agent_gets_our_backend_through_torchs_registry(store, tmp_path):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from elastic_harness import jobkey
    from elastic_harness.rendezvous.handler import handler_for

    jobkey.ensure(tmp_path / "job.key")
    params = RendezvousParameters("c10d", f"127.0.0.1:{store.port}", "registry", 1, 1, is_host=False,
                                  key_file=str(tmp_path / "job.key"), join_timeout=30)
    h = handler_for(params)
    try:
        assert h.get_backend() == "harness-c10d"
        assert isinstance(h._backend_name, str) and not isinstance(getattr(h, "_backend", None), C10dRendezvousBackend)
        assert join_all([h]) == [1]
    finally:
        h._stop_heartbeats()
        getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_a_deleted_state_key_reads_as_no_state_without_waiting_for_it(store):
    """torch's backend ``get``s the key, which blocks until it exists (the store's read
    timeout: 300 s here, past this test's bound); ours reads it with ``compare_set``."""
    import torch.distributed as dist

    h = handler(store.port, "deleted", read_timeout=300)
    try:
        assert join_all([h]) == [1]
        dist.TCPStore("127.0.0.1", store.port, is_master=False).delete_key("torch.rendezvous.deleted")
        h._state_holder.sync()
        assert h._state_holder.state.round == 0  # no state: a fresh one
    finally:
        h._stop_heartbeats()
        getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_a_forgery_before_any_authentic_state_reads_as_a_fresh_state(store):
    """Garbage under the key before any agent wrote: it reads as torch's fresh state (a
    pickled empty ``_RendezvousState``: torch cannot unpickle an empty value), and the first
    round forms over it."""
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", store.port, is_master=False).set("torch.rendezvous.early", b"!!garbage!!")
    pair = [handler(store.port, "early") for _ in range(2)]
    try:
        assert join_all(pair) == [2, 2]
    finally:
        for h in pair:
            h._stop_heartbeats()
            getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes
