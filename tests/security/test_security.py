"""Issue 22, security: the job's key, sealed rendezvous state, sockets bound to one address.

The rendezvous tests run torch's own handlers (ours: ``rendezvous.handler.create_handler``)
in threads of this process against a real c10d ``TCPStore``; the forger is a plain store
client writing to the rendezvous key, as anyone who reaches the port could.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import shutil
import stat
import threading

import pytest

from elastic_harness import jobkey
from elastic_harness.listen import is_loopback, listener
from tests.cli.test_bad_args import assert_one_line_error
from tests.launch.test_rendezvous import join_all

pytestmark = pytest.mark.timeout(90)
KEY = b"s" * 32


class Plant:
    """A pickle that creates ``path`` when unpickled: proof of code execution if it exists."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# --- the key -------------------------------------------------------------------------------


def test_key_is_created_once_0600_and_reused(tmp_path):
    path = tmp_path / jobkey.KEY_FILE
    first = jobkey.ensure(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert jobkey.ensure(path) == first == jobkey.read(path) and len(first) == 32
    assert not [p for p in tmp_path.iterdir() if p.name != jobkey.KEY_FILE], "no temp file left"


def test_concurrent_creators_agree_on_one_key(tmp_path):
    path = tmp_path / jobkey.KEY_FILE
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(jobkey.ensure(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(keys) == 8 and len(set(keys)) == 1


def test_key_path_prefers_the_provided_file(tmp_path):
    assert jobkey.key_path(tmp_path, {}) == tmp_path / "job.key"
    assert str(jobkey.key_path(tmp_path, {jobkey.KEY_FILE_VAR: "/etc/eh/job.key"})) == "/etc/eh/job.key"


def test_missing_key_is_one_line_naming_the_fix(tmp_path):
    with pytest.raises(jobkey.KeyError_) as e:
        jobkey.read(tmp_path / "nope")
    assert "ELASTIC_HARNESS_KEY_FILE" in e.value.hint


def test_seal_binds_key_and_context():
    blob = jobkey.seal(KEY, b"state", b"rdzv:a")
    assert jobkey.unseal(KEY, blob, b"rdzv:a") == b"state"
    assert jobkey.unseal(KEY, blob, b"rdzv:b") is None  # another rendezvous id
    assert jobkey.unseal(b"x" * 32, blob, b"rdzv:a") is None  # another job's key
    assert jobkey.unseal(KEY, blob[:-1] + b"X", b"rdzv:a") is None
    assert jobkey.unseal(KEY, b"short", b"rdzv:a") is None


# --- sockets -------------------------------------------------------------------------------


def test_listener_binds_the_given_address_only():
    sock = listener("127.0.0.1", 0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        sock.close()


@pytest.mark.parametrize(("host", "resolved", "want"), [
    ("127.0.0.1", ["127.0.0.1"], ("127.0.0.1", False)),
    ("10.1.2.3", ["10.1.2.3"], ("10.1.2.3", False)),
    ("[::1]", ["::1"], ("::1", False)),
    ("localhost", ["127.0.0.1"], ("127.0.0.1", False)),
    ("node-0", ["10.1.2.3"], ("10.1.2.3", False)),  # the job's address for this node
    ("node-0", ["127.0.1.1", "10.1.2.3"], ("10.1.2.3", False)),
    ("node-0", ["127.0.1.1"], ("0.0.0.0", True)),  # ambiguous: others may resolve it elsewhere
])
def test_bind_address(host, resolved, want):
    from elastic_harness.listen import bind_address

    assert bind_address(host, resolved) == want


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True), ("0.0.0.0", False),
    ("::", False), ("192.0.2.2", False), ("::ffff:127.0.0.1", True), ("*", False)])
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_rendezvous_config_names_the_key_file(tmp_path):
    from elastic_harness.launch.config import node_options, rdzv_configs
    from elastic_harness.spec import parse_job

    spec = parse_job("", ["task.target=elastic_harness.tasks.mlp:MLPRegression",
                          "rendezvous.endpoint=127.0.0.1:1"])
    opts = node_options(spec, tmp_path, {}, {})
    assert rdzv_configs(spec, opts)["key_file"] == str(tmp_path / "job.key")
    opts = node_options(spec, tmp_path, {}, {jobkey.KEY_FILE_VAR: "/secret/job.key"})
    assert rdzv_configs(spec, opts)["key_file"] == "/secret/job.key"
    standalone = node_options(spec, tmp_path, {"standalone": True}, {}, pick_port=lambda: 5)
    assert standalone.local_addr == "127.0.0.1"


# --- sealed rendezvous state ---------------------------------------------------------------


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def handler(endpoint: str, run_id: str, key: bytes = KEY, backend: str = "c10d"):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous.handler import create_handler

    conf = dict(join_timeout=30, last_call_timeout=1, start_last_call_timeout=5, close_timeout=10,
                heartbeat_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=3, read_timeout=30)
    if backend == "c10d":
        conf["is_host"] = False
    return create_handler(RendezvousParameters(backend, endpoint, run_id, 1, 2, **conf), key=key)


def test_forged_rendezvous_state_is_refused_and_the_job_goes_on(store, tmp_path, caplog):
    """A pickle written to the rendezvous key by a store client: never unpickled (its file
    is not created), one line logged, and the agents form their next round as before."""
    import torch.distributed as dist

    endpoint = f"127.0.0.1:{store.port}"
    pair = [handler(endpoint, "forged") for _ in range(2)]
    try:
        assert join_all(pair) == [2, 2]
        planted = tmp_path / "pwned"
        forger = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        forger.set("torch.rendezvous.forged", base64.b64encode(pickle.dumps(Plant(planted))))
        with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
            for h in pair:
                h._state_holder.sync()  # what every poll and heartbeat does
                h._state_holder.sync()  # the same forged value again: not logged twice
            assert join_all(pair) == [2, 2], "a restart after the forgery forms the group again"
        assert not planted.exists(), "the forged pickle ran"
        refusals = [r for r in caplog.records if "not signed with this job's key" in r.getMessage()]
        assert 1 <= len(refusals) <= 2  # one line per agent that read it (each logs it once)
        forger.set("torch.rendezvous.forged", b"!!not base64!!")  # garbage ended the job before
        for h in pair:
            h._state_holder.sync()
        assert join_all(pair) == [2, 2]
    finally:
        for h in pair:
            h._stop_heartbeats()
            getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_non_utf8_bytes_in_the_rendezvous_key_are_refused_and_overwritten(store, caplog):
    """Issue 33: bytes that are not even UTF-8 ended the agent (torch decoded the token, the
    raw value read back, as UTF-8). Now they read as the last authentic state, the next
    write replaces them, and the agents form their next round."""
    import torch.distributed as dist

    from elastic_harness.rendezvous import sealed

    pair = [handler(f"127.0.0.1:{store.port}", "garbage") for _ in range(2)]
    try:
        assert join_all(pair) == [2, 2]
        forger = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        forger.set("torch.rendezvous.garbage", b"\xff\xfe\x80 not a state")
        with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
            for h in pair:
                h._state_holder.sync()
                assert h._state_holder.state.participants, "the last authentic state, not an empty one"
            assert join_all(pair) == [2, 2], "a restart after the garbage forms the group again"
        stored = forger.get("torch.rendezvous.garbage")
        assert sealed.StateSeal(KEY, "garbage").authentic(stored) is not None, "overwritten by the agents"
        lines = [r.getMessage() for r in caplog.records if "not signed with this job's key" in r.getMessage()]
        assert lines and all("'torch.rendezvous.garbage'" in line for line in lines), lines
    finally:
        for h in pair:
            h._stop_heartbeats()
            getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_a_deleted_rendezvous_key_is_written_again_and_closing_survives(store, caplog):
    """Issue 33: a deleted key made every read block for ``read_timeout`` (torch's store
    ``get`` waits for the key), and the job's end with it. Reads and writes now go on at
    once, the key is written again, and a rendezvous closed after a deletion reads closed."""
    import time

    import torch.distributed as dist

    pair = [handler(f"127.0.0.1:{store.port}", "deleted") for _ in range(2)]
    key = "torch.rendezvous.deleted"
    try:
        assert join_all(pair) == [2, 2]
        for h in pair:
            h._state_holder._cache_duration = 0  # every sync reads the store (a join sets its own)
        forger = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
            forger.delete_key(key)
            t0 = time.monotonic()
            pair[1]._state_holder.sync()  # a read: took read_timeout (30 s here), then raised
            assert time.monotonic() - t0 < 10 and forger.check([key]), "written again from the last state"
            assert pair[1]._state_holder.state.participants
            forger.delete_key(key)
            pair[0].set_closed()  # what an agent's shutdown does at the job's end
            assert pair[1].is_closed(), "the closing state survives the deletion"
        assert any("was deleted from the store" in r.getMessage() and key in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        for h in pair:
            h._stop_heartbeats()
            getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_a_writer_in_a_loop_is_named_without_flooding_the_log(caplog):
    """One line at the first refusal, then at most one per ``LOG_EVERY_S`` saying how many
    more came and that something outside the job keeps writing the key."""
    from elastic_harness.rendezvous import sealed

    now = [0.0]
    seal = sealed.StateSeal(KEY, "loop", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
        for i in range(50):
            now[0] = i * 0.1
            seal.open(b"\xff%d" % i)
        now[0] = sealed.LOG_EVERY_S + 1
        seal.open(b"\xffagain")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and seal.refused == 51, lines
    assert "49 more" in lines[1] and "keeps writing 'torch.rendezvous.loop'" in lines[1]


def test_forged_etcd_rendezvous_state_is_refused_and_the_job_goes_on(tmp_path, caplog, monkeypatch):
    """The same through a real etcd (v2 API), the forger a plain etcd client (the v3 backend:
    tests/launch/test_etcd_v3.py)."""
    import etcd

    from tests.servers import etcd_server

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    (tmp_path / "etcd").mkdir()
    with etcd_server(tmp_path / "etcd" / "data", v2=True) as endpoint:
        pair = [handler(endpoint, "forged-etcd", backend="etcd-v2") for _ in range(2)]
        try:
            assert join_all(pair) == [2, 2]
            planted = tmp_path / "pwned"
            host, port = endpoint.rsplit(":", 1)
            forger = etcd.Client(host=host, port=int(port))
            forger.write("/torch/elastic/rendezvous/forged-etcd",
                         base64.b64encode(pickle.dumps(Plant(planted))).decode())
            with caplog.at_level(logging.WARNING, logger="elastic_harness.rendezvous.sealed"):
                for h in pair:
                    h._state_holder.sync()
                assert join_all(pair) == [2, 2]
            assert not planted.exists(), "the forged pickle ran"
            assert any("not signed with this job's key" in r.getMessage() for r in caplog.records)
            forger.delete("/torch/elastic/rendezvous/forged-etcd")  # deleted: not a fresh rendezvous
            pair[0]._state_holder._backend.get_state()  # a sync's read (the holder may serve its cache)
            assert forger.read("/torch/elastic/rendezvous/forged-etcd").value, "written back"
            assert join_all(pair) == [2, 2]
        finally:
            for h in pair:
                h._stop_heartbeats()
                getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


def test_another_jobs_key_cannot_join(store):
    """State sealed with another key reads as forged: its agent is not let in."""
    from elastic_harness.rendezvous import sealed

    seal = sealed.StateSeal(KEY, "r")
    stranger = sealed.StateSeal(b"o" * 32, "r")
    fresh = seal.open(base64.b64encode(stranger.close(pickle.dumps({"evil": 1}))))
    assert type(pickle.loads(fresh)).__name__ == "_RendezvousState" and seal.refused == 1
    good = seal.open(base64.b64encode(seal.close(b"ours")))
    assert good == b"ours"
    assert seal.open(b"garbage") == b"ours", "after a refusal: the last authentic state"
    assert seal.open(b"\xff\xfe") == b"ours" and seal.open(sealed.ABSENT) == b"ours", "not UTF-8; the empty marker"


def test_rendezvous_store_host_binds_only_the_endpoint_host(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous import sealed
    from tests.sockets import listening_sockets

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    sock = listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "bind", 1, 1, is_host=True, read_timeout=10)
    backend, store = sealed.create_c10d_backend(params, sealed.StateSeal(KEY, "bind"))
    mine = [a for a, p, _ in listening_sockets({os.getpid()}) if p == port]
    assert mine and all(is_loopback(a) for a in mine), mine


# --- signed checkpoints --------------------------------------------------------------------


def _forge_metadata(step_dir, planted: str) -> None:
    """What someone with write access to the checkpoint directory does: plant a pickle as
    ``.metadata`` and recompute every unkeyed checksum and size in the manifest."""
    import hashlib
    import json
    import zlib

    evil = pickle.dumps(Plant(planted))
    (step_dir / ".metadata").write_bytes(evil)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = manifest["files"][".metadata"]
    entry.update(size=len(evil), crc32=f"{zlib.crc32(evil):08x}", sha256=hashlib.sha256(evil).hexdigest())
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _one_rank(rank: int, port: int, root: str) -> None:
    """Save steps 1 and 2 signed; forge step 2's .metadata; resume. Then a legacy unsigned
    checkpoint: refused with the fix named, loadable once trusted."""
    import datetime as dt
    import json
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from elastic_harness.checkpoint import integrity
    from elastic_harness.checkpoint.collective import Ranks
    from elastic_harness.checkpoint.manager import Checkpoints
    from elastic_harness.checkpoint.site import Site
    from elastic_harness.checkpoint.storage import LocalStorage
    from elastic_harness.errors import CheckpointError
    from elastic_harness.spec import CheckpointSpec
    from tests.checkpoint.test_ckpt_manager import Events

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=dt.timedelta(seconds=60))
    out: dict = {}

    def manager(where: Path, key):
        storage = LocalStorage(where)
        storage.ensure()
        events = Events()
        site = Site(storage, Ranks(0, 1, dist.group.WORLD), events, {"task": "t", "job": "j"}, key=key)
        return Checkpoints.build(site, CheckpointSpec(async_save=False, verify="size")), events

    def state(v: float) -> dict:
        return {"model": {"w": torch.full((8,), v)}, "train": {"step": torch.tensor(int(v))}}

    try:
        signed = Path(root) / "signed"
        mgr, _ = manager(signed, KEY)
        for step in (1, 2):
            mgr.saver.save(step, state(float(step)), blocking=True)
        mgr.saver.close()
        _forge_metadata(signed / "step-0000002", str(Path(root) / "pwned"))
        mgr, events = manager(signed, KEY)
        target = state(0.0)
        loaded = mgr.restorer.restore(target)
        out["loaded"], out["value"] = loaded.step, float(target["model"]["w"][0])
        out["quarantined"] = [(e["name"], e["kind"]) for e in events.seen if e["event"] == "quarantine"]
        mgr.saver.close()

        legacy = Path(root) / "legacy"
        mgr, _ = manager(legacy, None)  # as written before checkpoints were signed
        mgr.saver.save(3, state(3.0), blocking=True)
        mgr.saver.close()
        mgr, _ = manager(legacy, KEY)
        try:
            mgr.restorer.restore(state(0.0))
            out["legacy"] = "loaded"
        except CheckpointError as e:
            out["legacy"] = str(e)
        out["legacy_left_in_place"] = (legacy / "step-0000003").is_dir()
        out["trusted"] = integrity.trust(LocalStorage(legacy), "step-0000003", KEY).ok
        target = state(0.0)
        out["after_trust"] = mgr.restorer.restore(target).step
        mgr.saver.close()
    finally:
        dist.destroy_process_group()
        (Path(root) / "rank0.json").write_text(json.dumps(out))


def test_forged_metadata_with_recomputed_checksums_is_refused_before_unpickling(tmp_path):
    from tests.servers import spawn_ranks

    (out,) = spawn_ranks(_one_rank, tmp_path, nprocs=1)
    assert not (tmp_path / "pwned").exists(), "the planted .metadata was unpickled"
    assert out["loaded"] == 1 and out["value"] == 1.0, "resumed from the older, authentic checkpoint"
    assert out["quarantined"] == [["step-0000002", "forged"]]
    assert "unsigned" in out["legacy"] and "ckpt trust" in out["legacy"], out["legacy"]
    assert out["legacy_left_in_place"] and out["trusted"] and out["after_trust"] == 3


def test_manifest_signature_covers_every_file(tmp_path):
    from elastic_harness.checkpoint import integrity

    manifest = {"step": 3, "files": {".metadata": {"size": 1, "crc32": "00", "sha256": "ab"},
                                     "__0_0.distcp": {"size": 9, "crc32": "11"}}}
    signed = integrity.sign(manifest, KEY)
    assert integrity.check_signature(signed, KEY).ok
    assert integrity.check_signature(signed, b"o" * 32).kind == "forged"
    assert integrity.check_signature(manifest, KEY).kind == "unsigned"
    for change in (("__0_0.distcp", "crc32", "12"), ("__0_0.distcp", "size", 10), (".metadata", "sha256", "ac")):
        tampered = json_copy(signed)
        tampered["files"][change[0]][change[1]] = change[2]
        assert integrity.check_signature(tampered, KEY).kind == "forged", change
    tampered = json_copy(signed)
    tampered["step"] = 4
    assert not integrity.check_signature(tampered, KEY).ok


def json_copy(value):
    import json

    return json.loads(json.dumps(value))


def test_run_dir_is_private_and_holds_the_key(tmp_path):
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.spec import parse_job

    spec = parse_job("", ["task.target=elastic_harness.tasks.mlp:MLPRegression",
                          f"checkpoint.dir={tmp_path / 'elsewhere' / 'ckpts'}"])
    run_dir = tmp_path / "runs" / "job"
    with prepare(run_dir, spec, holder=Holder.this_process("job", "id-1")):
        pass
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(run_dir) == mode(run_dir.parent) == 0o700
    assert mode(tmp_path / "elsewhere" / "ckpts") == 0o700
    assert mode(run_dir / jobkey.KEY_FILE) == 0o600
    key = jobkey.read(run_dir / jobkey.KEY_FILE)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    os.chmod(shared, 0o750)  # a group run dir made beforehand keeps its mode
    with prepare(shared, spec, holder=Holder.this_process("job", "id-2")):
        pass
    assert mode(shared) == 0o750
    with prepare(run_dir, spec, holder=Holder.this_process("job", "id-3")):
        assert jobkey.read(run_dir / jobkey.KEY_FILE) == key, "a later submission keeps the key"


def test_a_provided_key_file_must_exist(tmp_path):
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.spec import parse_job

    spec = parse_job("", ["task.target=elastic_harness.tasks.mlp:MLPRegression"])
    with pytest.raises(jobkey.KeyError_, match="cannot read the job's key"):
        prepare(tmp_path / "run", spec, holder=Holder.this_process("job", "id"), key_file=tmp_path / "nope")
    assert not (tmp_path / "run" / jobkey.KEY_FILE).exists(), "no key of its own beside a provided one"


def _signed_run(run_dir):
    """A run dir whose key signed a checkpoint (step 5); its listing."""
    from elastic_harness.checkpoint.export import save_single_process
    from elastic_harness.checkpoint.storage import LocalStorage

    storage = LocalStorage(run_dir / "checkpoints")
    storage.ensure()
    key = jobkey.ensure(run_dir / jobkey.KEY_FILE)
    save_single_process(storage, "step-0000005", {"model": {"w": __import__("torch").ones(3)}}, {"step": 5}, key=key)
    return storage, sorted(storage.listing())


def test_a_missing_or_replaced_key_is_named_and_nothing_is_set_aside(cli_here, tmp_path):
    """Issue 33: with job.key gone, a new key was made silently and every good checkpoint
    set aside as forged on resume. Now the run is refused before anything starts (exit 2),
    naming the file and the fix, with the checkpoints and the run dir as they were."""
    from tests.conftest import MLP

    run_dir = tmp_path / "run"
    storage, before = _signed_run(run_dir)
    (run_dir / jobkey.KEY_FILE).unlink()
    r = cli_here("run", MLP, "--run-dir", run_dir)
    assert r.code == 2 and f"{run_dir / jobkey.KEY_FILE} is missing" in r.err, r.err
    assert "ckpt trust" in r.err and "--step 5" in r.err and "--fresh" in r.err and "Traceback" not in r.err
    assert not (run_dir / jobkey.KEY_FILE).exists() and sorted(storage.listing()) == before
    jobkey.ensure(run_dir / jobkey.KEY_FILE)  # another key than the one that signed them
    r = cli_here("run", MLP, "--run-dir", run_dir)
    assert r.code == 2 and "are not signed with the key in" in r.err and sorted(storage.listing()) == before, r.err
    r = cli_here("ckpt", "trust", run_dir, "--step", 5, "--yes")  # the fix it names: review, re-sign
    assert r.code == 0, r.err


def test_a_fresh_run_dir_still_makes_its_key_and_fresh_starts_over(tmp_path):
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.spec import parse_job

    spec = parse_job("", ["task.target=elastic_harness.tasks.mlp:MLPRegression"])
    with prepare(tmp_path / "new", spec, holder=Holder.this_process("job", "a")):
        assert (tmp_path / "new" / jobkey.KEY_FILE).is_file()
    run_dir = tmp_path / "run"
    _signed_run(run_dir)
    (run_dir / jobkey.KEY_FILE).unlink()
    with prepare(run_dir, spec, fresh=True, holder=Holder.this_process("job", "b")):
        assert (run_dir / jobkey.KEY_FILE).is_file(), "--fresh moved the checkpoints aside: a new key"


@pytest.mark.parametrize("bad", ["missing", "short", "directory"])
def test_a_bad_provided_key_file_is_one_line_before_any_launch(cli_here, tmp_path, monkeypatch, bad):
    """Issue 33: a bad ELASTIC_HARNESS_KEY_FILE gave "agents exited with {0: 2}", exit 1."""
    from tests.conftest import MLP

    path = tmp_path / "key"
    if bad == "short":
        path.write_text("abcd\n")
    elif bad == "directory":
        path.mkdir()
    monkeypatch.setenv(jobkey.KEY_FILE_VAR, str(path))
    r = cli_here("run", MLP, "--run-dir", tmp_path / "run")
    assert r.code == 2 and jobkey.KEY_FILE_VAR in r.err and str(path) in r.err, r.err
    assert len(r.err.strip().splitlines()) == 2 and "Traceback" not in r.err  # the line and its fix


def test_ckpt_commands_check_signatures_and_trust_signs(cli_here, tmp_path):
    """An unsigned (legacy) checkpoint: verify says so, export refuses it with the fix named,
    ``ckpt trust`` signs it, then both accept it; a copy away from its key needs --key/--trust."""
    import shutil

    import torch

    from elastic_harness.checkpoint.export import save_single_process
    from elastic_harness.checkpoint.storage import LocalStorage

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    storage = LocalStorage(ckpts)
    storage.ensure()
    jobkey.ensure(run_dir / jobkey.KEY_FILE)
    save_single_process(storage, "step-0000005", {"model": {"w": torch.ones(3)}}, {"step": 5})  # unsigned
    r = cli_here("ckpt", "verify", run_dir)
    assert r.code == 1 and "step-0000005: UNSIGNED" in r.out and "ckpt trust" in r.out
    r = cli_here("ckpt", "export", run_dir, "--to", tmp_path / "m.pt")
    assert r.code == 2 and "unsigned checkpoint" in r.err and "ckpt trust" in r.err
    assert not (tmp_path / "m.pt").exists()
    r = cli_here("ckpt", "trust", run_dir)  # no bulk signing: one named step at a time
    assert r.code == 2 and "--step" in r.err and cli_here("ckpt", "verify", run_dir).code == 1
    r = cli_here("ckpt", "trust", run_dir, "--step", 5)  # shown, but nobody said yes (no terminal)
    assert r.code == 2 and "model.w" in r.out and "--yes" in r.err and cli_here("ckpt", "verify", run_dir).code == 1
    r = cli_here("ckpt", "trust", run_dir, "--step", 5, "--yes")
    assert r.code == 0 and "step-0000005: signed with" in r.out
    assert cli_here("ckpt", "verify", run_dir).code == 0
    assert cli_here("ckpt", "export", run_dir, "--to", tmp_path / "m.pt").code == 0
    elsewhere = tmp_path / "copy"
    shutil.copytree(ckpts, elsewhere)
    r = cli_here("ckpt", "export", elsewhere, "--to", tmp_path / "n.pt")
    assert r.code == 2 and "no job.key" in r.err and "--trust" in r.err
    r = cli_here("ckpt", "export", elsewhere, "--to", tmp_path / "n.pt", "--key", run_dir / jobkey.KEY_FILE)
    assert r.code == 0
    other = tmp_path / "other.key"
    jobkey.ensure(other)
    r = cli_here("ckpt", "verify", elsewhere, "--key", other)
    assert r.code == 1 and "FORGED" in r.out
    r = cli_here("ckpt", "export", elsewhere, "--to", tmp_path / "o.pt", "--trust")
    assert r.code == 0 and "you vouch" in r.err


def test_a_legacy_run_is_never_read_silently(cli_here, tmp_path):
    """A run dir from before signing (no job.key, unsigned checkpoints): `verify` refuses it
    naming the fix; `ckpt trust --key` creates the key and signs; then it is read."""
    import torch

    from elastic_harness.checkpoint.export import save_single_process
    from elastic_harness.checkpoint.storage import LocalStorage

    run_dir = tmp_path / "old-run"
    storage = LocalStorage(run_dir / "checkpoints")
    storage.ensure()
    save_single_process(storage, "step-0000003", {"model": {"w": torch.ones(2)}}, {"step": 3})
    r = cli_here("verify", run_dir, run_dir)
    assert r.code == 2 and "no job.key" in r.err and "ckpt trust" in r.err
    r = cli_here("ckpt", "trust", run_dir, "--step", 3, "--yes", "--key", run_dir / "job.key")
    assert r.code == 0 and stat.S_IMODE(os.stat(run_dir / "job.key").st_mode) == 0o600
    r = cli_here("verify", run_dir, run_dir)
    assert r.code == 0, r.err


def test_trust_will_not_resign_a_runs_own_checkpoint_nor_call_a_damaged_one_fine(cli_here, tmp_path):
    """`ckpt trust RUN --key OTHER --yes` showed the run's own signed checkpoint as "unsigned"
    and re-signed it, after which the run refused it ("the key was replaced"); on a signed
    step with a damaged shard, trust said "nothing to do" (rc 0) while `ckpt verify` said
    CORRUPT."""
    run_dir = tmp_path / "run"
    storage, listing = _signed_run(run_dir)
    manifest = (run_dir / "checkpoints" / "step-0000005" / "manifest.json").read_bytes()
    r = cli_here("ckpt", "trust", run_dir, "--step", 5, "--key", tmp_path / "other.key", "--yes")
    assert_one_line_error(r, "is signed with its own run's key", "copy the step directory")
    assert (run_dir / "checkpoints" / "step-0000005" / "manifest.json").read_bytes() == manifest, "not re-signed"
    assert not (tmp_path / "other.key").exists(), "no key made for nothing"
    ok = cli_here("ckpt", "trust", run_dir, "--step", 5, "--yes")
    assert ok.code == 0 and "already signed with" in ok.out and "verifies in full" in ok.out
    shard = next(p for p in (run_dir / "checkpoints" / "step-0000005").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    damaged = cli_here("ckpt", "trust", run_dir, "--step", 5, "--yes")
    assert damaged.code == 1 and "but CORRUPT" in damaged.out and "nothing to do" not in damaged.out
    assert cli_here("ckpt", "verify", run_dir).code == 1, "the same verdict as verify"
    other = tmp_path / "other"  # the fix named: a copy in the run of that key, trusted there
    shutil.copytree(run_dir / "checkpoints" / "step-0000005", other / "checkpoints" / "step-0000005")
    (other / "checkpoints" / "step-0000005" / shard.name).write_bytes(shard.read_bytes()[:-1] + bytes([data[-1] ^ 0xFF]))
    copied = cli_here("ckpt", "trust", other, "--step", 5, "--key", other / "job.key", "--yes")
    assert copied.code == 0 and "(signed, but not with" in copied.out, copied.out
    assert cli_here("ckpt", "verify", other).code == 0
