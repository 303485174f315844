"""Issue 37: the etcd v3 rendezvous backend, against real etcd servers (Debian's 3.4, its
v2 API off unless a test says otherwise): compare-and-swap on the mod revision, leases,
the store, fail-over between members, TLS and authentication, and every refusal as one line.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import pickle
import subprocess
import threading
import urllib.request
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_harness.rendezvous import etcd_gateway, etcd_v3, sealed
from elastic_harness.rendezvous.etcd_gateway import Gateway, Settings
from elastic_harness.rendezvous.etcd_v3 import EtcdMisconfigured
from tests.launch.test_rendezvous import (
    a_broken_round_wakes_a_running_agent,
    a_waiting_agent_is_woken_by_the_round_it_waits_for,
    join_all,
)
from tests.servers import (
    etcd_cluster,
    etcd_enable_auth,
    etcd_server,
    free_port,
    free_ports,
    make_tls,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
KEY = b"k" * 32


@pytest.fixture
def etcd(tmp_path):
    (tmp_path / "etcd").mkdir()
    with etcd_server(tmp_path / "etcd" / "data") as endpoint:
        yield endpoint


def params(endpoint: str, run_id: str = "r", **conf) -> RendezvousParameters:
    base = dict(join_timeout=30, last_call_timeout=1, start_last_call_timeout=5, close_timeout=10,
                heartbeat_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=3, read_timeout=10)
    return RendezvousParameters("etcd-v3", endpoint, run_id, 1, 2, **{**base, **conf})


def backend(endpoint: str, run_id: str = "r", **conf):
    return etcd_v3.create_backend(params(endpoint, run_id, **conf), sealed.StateSeal(KEY, run_id))


def raw(endpoint: str, path: str, body: dict) -> dict:
    """A plain v3 gateway call, as any client that reaches etcd could make."""
    req = urllib.request.Request(f"http://{endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


# --- compare-and-swap, sealing, leases ------------------------------------------------------


def test_set_state_is_a_compare_and_swap_on_the_mod_revision(etcd):
    (a, _), (b, _) = backend(etcd), backend(etcd)
    assert a.get_state() is None
    state, token, won = a.set_state(b"first")
    assert (state, won) == (b"first", True)
    assert b.set_state(b"second") == (b"first", token, False), "no token: only if the key is absent"
    state, newer, won = b.set_state(b"second", token)
    assert (state, won) == (b"second", True) and newer > token
    assert a.set_state(b"stale", token) == (b"second", newer, False), "an old token loses"
    assert a.get_state() == (b"second", newer)
    assert a.set_state(b"x", "not-a-revision") == (b"second", newer, False)


def test_the_state_is_sealed_and_a_forgery_is_refused(etcd, tmp_path, caplog):
    (a, _) = backend(etcd)
    a.set_state(pickle.dumps({"ours": 1}))
    a.get_state()  # what every sync does: the state this agent last saw authentic
    kv = raw(etcd, "kv/range", {"key": base64.b64encode(a.key).decode()})["kvs"][0]
    stored = base64.b64decode(kv["value"])  # the stored text: base64 of tag + state
    assert base64.b64decode(stored).endswith(pickle.dumps({"ours": 1})), "state after its tag"
    stranger = sealed.StateSeal(b"o" * 32, "r")
    stranger.open(stored)
    assert stranger.refused == 1, "sealed under the job's key: another key refuses it"
    assert int(kv["lease"]) > 0, "the state key rides on the agent's lease"

    class Plant:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    forged = base64.b64encode(base64.b64encode(pickle.dumps(Plant()))).decode()
    raw(etcd, "kv/put", {"key": base64.b64encode(a.key).decode(), "value": forged})
    with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
        state, forged_token = a.get_state()
    assert pickle.loads(state) == {"ours": 1}, "the last authentic state"
    assert not (tmp_path / "pwned").exists()
    assert any("not signed with this job's key" in r.getMessage() for r in caplog.records)
    assert a.set_state(pickle.dumps({"ours": 2}), forged_token)[2], "the next write replaces it"


def test_a_lease_lost_while_stopped_is_granted_anew(etcd):
    (a, store) = backend(etcd)
    _, token, _ = a.set_state(b"one")
    kv = raw(etcd, "kv/range", {"key": base64.b64encode(a.key).decode()})["kvs"][0]
    raw(etcd, "lease/revoke", {"ID": kv["lease"]})  # as if it lapsed: the key goes with it
    state, token = a.get_state()  # written back from the last authentic state, on a new lease
    assert state == b"one"
    state, _, won = a.set_state(b"two", token)
    assert (state, won) == (b"two", True)
    raw(etcd, "lease/revoke", {"ID": raw(etcd, "kv/range", {"key": base64.b64encode(a.key).decode()})["kvs"][0]["lease"]})
    assert store.add("n", 2) == 2, "the store's writes take a new lease too"
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_the_lease_is_renewed_a_third_into_its_ttl(etcd):
    now = [0.0]
    gateway = Gateway(Settings((etcd,)))
    lease = etcd_v3.Lease(gateway, ttl_s=30, clock=lambda: now[0])
    first = lease.id()
    now[0] = 9.0
    assert lease.id() == first  # not yet due
    now[0] = 11.0
    assert lease.id() == first  # renewed: etcd still had it
    ttl = raw(etcd, "lease/timetolive", {"ID": first})
    assert int(ttl["TTL"]) > 25
    raw(etcd, "lease/revoke", {"ID": first})
    now[0] = 30.0
    assert lease.id() != first, "a lease etcd no longer has is replaced at its renewal"


# --- the store ---------------------------------------------------------------------------------


def test_the_store_sets_gets_adds_and_waits(etcd):
    (_, one), (_, two) = backend(etcd), backend(etcd)
    one.set("addr", "10.0.0.1")
    assert two.get("addr") == b"10.0.0.1" and two.check(["addr"]) and not two.check(["addr", "port"])
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(two.get("port")))
    waiter.start()
    one.set("port", b"29500")
    waiter.join(10)
    assert got == [b"29500"]
    counts = []
    adders = [threading.Thread(target=lambda s=s: counts.append(s.add("n", 1))) for s in (one, two) * 4]
    for t in adders:
        t.start()
    for t in adders:
        t.join(20)
    assert sorted(counts) == list(range(1, 9)), "every add is atomic"
    with pytest.raises(DistStoreError, match="Timeout"):
        two.wait(["never"], timedelta(milliseconds=200))


def test_two_agents_form_a_round_through_torchs_handler(etcd, monkeypatch, tmp_path):
    """The whole handler (torch's dynamic rendezvous on this backend, made through torch's
    registry) forms a group of two, and again after both rejoin."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elastic_harness.rendezvous.handler import create_handler

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    (tmp_path / "job.key").write_text(KEY.hex())
    (tmp_path / "job.key").chmod(0o600)  # a key every user can read is refused (``jobkey.check_private``)
    first = create_handler(params(etcd, "pair"), key=KEY)  # names etcd-v3 in torch's registry
    second = get_rendezvous_handler(params(etcd, "pair", key_file=str(tmp_path / "job.key")))
    assert first.get_backend() == second.get_backend() == "etcd-v3"
    assert type(second) is type(first), "torch's registry builds our handler for etcd-v3"
    pair = [first, second]
    try:
        assert join_all(pair) == [2, 2]
        assert join_all(pair) == [2, 2]
    finally:
        for h in pair:
            h._stop_heartbeats()


def test_a_watch_yields_each_put_of_its_key_and_ends_when_closed(etcd):
    g = Gateway(Settings(endpoints=(etcd,)))
    key = etcd_gateway.b64(b"/w")
    start = int(g.call("kv/range", {"key": key})["header"]["revision"]) + 1
    watch = g.watch(b"/w", start)
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.extend(watch.revisions()))
    reader.start()
    puts = [int(g.call("kv/put", {"key": key, "value": ""})["header"]["revision"]) for _ in range(3)]
    g.call("kv/deleterange", {"key": key})  # not a put: not yielded
    puts.append(int(g.call("kv/put", {"key": key, "value": ""})["header"]["revision"]))
    wait_until(lambda: len(seen) == 4, 30, "the watch to see the four puts")
    watch.close()  # from another thread: the blocked read ends
    reader.join(10)
    assert not reader.is_alive() and seen == puts


def etcd_agent(endpoint: str, run_id: str):
    from elastic_harness.rendezvous.handler import create_handler

    return create_handler(params(endpoint, run_id), key=KEY)


def test_etcd_pushes_a_broken_round_to_a_running_agent(etcd, monkeypatch):
    """As with a c10d store (``test_rendezvous``): the write that breaks the round also puts
    the change key, and the running agent's watch wakes it, not its next poll."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    a_broken_round_wakes_a_running_agent([etcd_agent(etcd, "push") for _ in range(2)])


def test_etcd_wakes_a_waiting_agent_when_its_round_completes(etcd, monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    a_waiting_agent_is_woken_by_the_round_it_waits_for(lambda: etcd_agent(etcd, "wake"), monkeypatch)


def test_a_store_unreadable_for_a_moment_does_not_end_a_running_group(tmp_path, monkeypatch, caplog):
    """A running agent asks torch's handler every monitor interval whether a node waits.
    While the store cannot be read, that is "none" with one warning, until the peers would
    have expired this node (keep-alive interval x attempts); then the error goes up. torch's
    own handler raises at the first failed read, and its agent then closes the rendezvous
    for every node."""
    from elastic_harness.rendezvous.handler import create_handler

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with etcd_cluster(tmp_path, members=1) as [(endpoint, proc)]:
        handler = create_handler(params(endpoint, "alone", start_last_call_timeout=0.2, keep_alive_interval=1,
                                        keep_alive_max_attempt=2), key=KEY)
        try:
            assert handler.next_rendezvous().world_size == 1
            proc.kill()
            proc.wait()
            with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.handler"):
                wait_until(lambda: handler.num_nodes_waiting() == 0 and "Cannot read the rendezvous state" in caplog.text,
                           30, "the warning of a state that cannot be read")
                with pytest.raises(RendezvousConnectionError):
                    wait_until(lambda: handler.num_nodes_waiting() < 0, 30, "the error, after the expiry bound")
        finally:
            handler._stop_heartbeats()


# --- members ---------------------------------------------------------------------------------


def test_a_dead_member_is_skipped_and_the_cluster_teaches_the_rest(tmp_path):
    with etcd_cluster(tmp_path) as members:
        (first, p0), (second, _), (third, _) = members
        dead = f"127.0.0.1:{free_port()}"
        gateway = Gateway(Settings((dead, first)))
        assert gateway.call("kv/range", {"key": etcd_gateway.b64("x")}) is not None
        gateway.learn_members()
        assert set(gateway.endpoints) == {dead, first, second, third}
        a = etcd_v3.EtcdV3Backend(gateway, "m", sealed.StateSeal(KEY, "m"), etcd_v3.Lease(gateway))
        _, token, _ = a.set_state(b"before")
        p0.kill()
        p0.wait()
        assert a.set_state(b"after", token)[2], "the write goes to a live member"
        assert a.get_state()[0] == b"after"


def test_a_cluster_without_quorum_for_a_moment_is_waited_for(tmp_path):
    """Two of three members down: the last one answers "unavailable" (no quorum). The call
    asks again until its timeout, so a member back meanwhile serves it (stop 38's second
    CI failure: an agent's read while the cluster lost a member ended the job)."""
    with etcd_cluster(tmp_path) as members:
        (first, _), (_, p1), (_, p2) = members
        for p in (p1, p2):
            p.kill()
            p.wait()
        restarted = []

        def sleep(seconds: float) -> None:  # the gateway pauses only after "unavailable"
            if not restarted:
                restarted.append(subprocess.Popen(p1.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                  start_new_session=True))

        gateway = Gateway(Settings((first,), timeout=60), sleep=sleep)
        try:
            assert gateway.call("kv/put", {"key": etcd_gateway.b64("x"), "value": etcd_gateway.b64("1")}) is not None
            assert restarted, "the first answer was 'unavailable', and the call asked again"
        finally:
            for p in restarted:
                p.terminate()
                p.wait()


def test_no_member_reachable_is_a_connection_error_worth_a_retry():
    with pytest.raises(RendezvousConnectionError, match="no etcd member answered"):
        backend(",".join(f"127.0.0.1:{port}" for port in free_ports(2)))


# --- refusals: one line each, a mistake to fix -------------------------------------------------


def test_an_etcd_without_the_v3_api_is_refused(tmp_path):
    (tmp_path / "e").mkdir()
    with (etcd_server(tmp_path / "e" / "data", v2=True, gateway=False) as endpoint,
          pytest.raises(EtcdMisconfigured, match="no etcd v3 API") as e):
        backend(endpoint)
    assert "etcd-v2" in str(e.value) and "\n" not in str(e.value)


def test_tls_settings_must_match_the_server(tmp_path):
    tls = make_tls(tmp_path)
    (tmp_path / "e").mkdir()
    with etcd_server(tmp_path / "e" / "data", tls=tls) as endpoint:
        good = dict(protocol="https", ca_cert=tls.ca, ssl_cert=tls.client_cert, ssl_cert_key=tls.client_key)
        store = backend(endpoint, **good)[1]
        store.set("tls", "ok")
        assert store.get("tls") == b"ok"
        cases = [({"protocol": "http"}, "speaks https"),
                 ({**good, "ssl_cert": "", "ssl_cert_key": ""}, "refused the TLS handshake with no client"),
                 ({**good, "ca_cert": tls.other_ca}, "is not trusted"),
                 ({**good, "ssl_cert": str(tmp_path / "missing.crt")}, "cannot load rendezvous.etcd_cert")]
        for conf, words in cases:
            with pytest.raises(EtcdMisconfigured, match=words):
                backend(endpoint, **conf)


def test_tls_asked_of_a_plain_etcd_is_refused(etcd, tmp_path):
    tls = make_tls(tmp_path)
    with pytest.raises(EtcdMisconfigured, match="does not speak TLS"):
        backend(etcd, protocol="https", ca_cert=tls.ca, ssl_cert=tls.client_cert, ssl_cert_key=tls.client_key)


def test_authentication(etcd, tmp_path):
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    with pytest.raises(EtcdMisconfigured, match="authentication off"):
        backend(etcd, user="job", password_file=str(password))
    etcd_enable_auth(etcd, "job", "s3cret")
    state, _, won = backend(etcd, user="job", password_file=str(password))[0].set_state(b"authenticated")
    assert (state, won) == (b"authenticated", True)
    with pytest.raises(EtcdMisconfigured, match="requires authentication"):
        backend(etcd)
    (tmp_path / "wrong").write_text("guess")
    with pytest.raises(EtcdMisconfigured, match="refused user 'job'"):
        backend(etcd, user="job", password_file=str(tmp_path / "wrong"))
    with pytest.raises(EtcdMisconfigured, match="cannot read rendezvous.etcd_password_file"):
        backend(etcd, user="job", password_file=str(tmp_path / "missing"))


def test_an_expired_token_is_renewed(etcd, tmp_path):
    (tmp_path / "password").write_text("pw")
    etcd_enable_auth(etcd, "job", "pw")
    a, _ = backend(etcd, user="job", password_file=str(tmp_path / "password"))
    gateway = a._gateway
    for member in gateway._tokens:
        gateway._tokens[member] = "expired.1"  # what a member answers after --auth-token-ttl
    assert a.set_state(b"again")[2]


def test_tls_asked_of_a_plain_server_that_resets_the_handshake_is_refused(tmp_path):
    """A plain-http member may answer a ClientHello with a connection reset rather than a
    close (seen once in a few hundred runs against etcd 3.4): that too is "does not speak
    TLS", exit 2, not an unreachable member. A server that does exactly that, every time."""
    import socket
    import struct

    tls = make_tls(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                first = conn.recv(4096)
                if first[:1] == b"\x16":  # a TLS handshake record: reset it
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                else:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(EtcdMisconfigured, match="does not speak TLS"):
            backend(f"127.0.0.1:{port}", protocol="https", ca_cert=tls.ca, ssl_cert=tls.client_cert,
                    ssl_cert_key=tls.client_key)
    finally:
        stop.set()
        with contextlib.suppress(OSError):  # a close alone does not end a blocked accept()
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        server.join(10)
        assert not server.is_alive()


def test_a_deleted_state_key_is_written_again_from_the_last_authentic_state(etcd, caplog):
    """Deleting the key (by hand, or a writer's lease that ended) must not read as a fresh
    rendezvous: a closed one would reopen. An agent that saw the state writes it back,
    create-only, and says so; one that never saw a state still reads none."""
    (a, _), (b, _) = backend(etcd, "deleted"), backend(etcd, "deleted")
    closed = pickle.dumps({"closed": True})
    a.set_state(closed)
    key = base64.b64encode(a.key).decode()
    raw(etcd, "kv/deleterange", {"key": key})
    assert b.get_state() is None, "b never saw a state: nothing to restore"
    with caplog.at_level(logging.WARNING):
        state, token = a.get_state()
    assert state == closed and "was deleted from the store" in caplog.text
    assert raw(etcd, "kv/range", {"key": key}).get("kvs"), "the key is back"
    assert b.get_state() == (closed, token)
