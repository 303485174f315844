"""The torch boundary (``elastic_harness.torchcompat``): the supported range, the host's check
before anything is launched, each probe and the fallback it switches to, undoable patches.

A name a torch lacks is simulated by deleting it from the real torch (``monkeypatch``,
restored after the test), or, for the CLI, in the process that runs it; a release below the
range by a package record of an older torch placed first on the path (``importlib.metadata``
reads it before the installed one), since no such torch is installed here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_harness.torchcompat import host, probe, release
from elastic_harness.torchcompat.host import TorchUnsupported
from tests.conftest import MLP, REPO
from tests.launch.test_rendezvous import join_all

pytestmark = pytest.mark.timeout(120)
KEY = b"k" * 32


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.reset()
    yield
    probe.reset()


# --- the range -------------------------------------------------------------------------------

@pytest.mark.parametrize(("version", "verdict"), [
    ("1.13.1", release.OLDER), ("2.10.2", release.OLDER), ("2.11.0", release.SUPPORTED),
    ("2.11.0a0+git1234", release.SUPPORTED), ("2.13.0+cpu", release.SUPPORTED),
    ("2.15.0+cu132", release.SUPPORTED), ("2.15.1", release.SUPPORTED),
    ("2.16.0.dev20260301+cpu", release.NEWER), ("3.0.0", release.NEWER),
])
def test_release_verdict(version, verdict):
    assert release.verdict(version) == verdict


def test_every_proven_release_is_in_the_range():
    assert all(release.verdict(v) == release.SUPPORTED for v in release.PROVEN)
    assert release.verdict(torch.__version__) == release.SUPPORTED


def test_an_older_release_is_one_line_naming_the_range():
    with pytest.raises(TorchUnsupported) as e:
        host.check_release("2.10.0")
    assert e.value.exit_code == 2 and "\n" not in e.value.message
    assert "torch 2.10.0 is older" in e.value.message and release.RANGE in e.value.message
    assert f"pip install 'torch{release.RANGE}'" in e.value.hint


def test_a_newer_release_that_passes_every_probe_runs_with_one_warning():
    lines = host.check_host(version="2.16.0")
    assert len(lines) == 1 and "torch" in lines[0] and "newer than the releases" in lines[0]
    assert host.check_host() == []  # this torch: in range, every probe passes


def test_a_missing_required_name_is_refused_naming_it(monkeypatch):
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.delattr(LocalElasticAgent, "_monitor_workers")  # the abstract one is left
    with pytest.raises(TorchUnsupported, match=r"has no LocalElasticAgent\._monitor_workers \(abstract\), "
                                               r"which elastic-harness's elastic agent needs"):
        host.check_host()


def test_a_renamed_field_of_torchs_rendezvous_state_is_refused_in_one_line_naming_it(monkeypatch):
    """The rendezvous reads torch's state only through ``rdzv.view``: each field is probed."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    fresh = dynamic_rendezvous._RendezvousState.__init__

    def renamed(state) -> None:  # a torch that calls the wait list something else
        fresh(state)
        state.waiting = state.__dict__.pop("wait_list")

    monkeypatch.setattr(dynamic_rendezvous._RendezvousState, "__init__", renamed)
    with pytest.raises(TorchUnsupported) as e:
        host.check_host()
    assert "\n" not in e.value.message
    assert "has no _RendezvousState.wait_list" in e.value.message and "sealed rendezvous state" in e.value.message


def test_a_missing_optional_name_is_one_warning_said_once(monkeypatch, caplog):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    lines = host.check_host()
    assert len(lines) == 1
    assert lines[0].startswith(f"restart join without skew off on torch {torch.__version__}: ")
    assert "dynamic_rendezvous._delay" in lines[0]
    with caplog.at_level(logging.WARNING, logger="elastic_harness.torchcompat"):
        assert not probe.on("rdzv-delay")  # the host said it: not again
        assert probe.on("rdzv-events")
    assert caplog.records == []


def test_on_says_a_feature_is_off_once_per_process(monkeypatch, caplog):
    monkeypatch.delattr(torch, "_foreach_copy_")
    with caplog.at_level(logging.WARNING, logger="elastic_harness.torchcompat"):
        assert [probe.on("foreach-copy") for _ in range(3)] == [False] * 3
    assert [r.getMessage() for r in caplog.records] == [
        f"one-call snapshot copy off on torch {torch.__version__}: a memory snapshot copies tensor by "
        "tensor (slower) (this torch has no torch._foreach_copy_)"]


def test_a_probe_that_raises_counts_as_off_and_never_raises(monkeypatch):
    def broken() -> list[str]:
        raise RuntimeError("surprise")

    monkeypatch.setitem(probe.FEATURES, "mesh-dp", probe.FEATURES["mesh-dp"].__class__(
        "mesh-dp", "mesh['dp']", "x", broken))
    assert probe.missing("mesh-dp") == ("(probe failed: RuntimeError: surprise)",)
    assert not probe.on("mesh-dp")


def test_a_job_at_a_url_needs_fsspec_storage(monkeypatch, tmp_path):
    from elastic_harness.spec import parse_job
    from elastic_harness.torchcompat import dcp

    monkeypatch.setattr(dcp, "_dcp_dir", lambda: tmp_path)  # a DCP without the fsspec module
    s3 = parse_job("name: j\ntask: {target: elastic_harness.tasks.mlp:MLPRegression}\n"
                   "checkpoint: {dir: 's3://bucket/p'}\n")
    assert host.needs(s3) == ("fsspec-storage",)
    with pytest.raises(TorchUnsupported, match="which elastic-harness's checkpoints at a URL needs"):
        host.check_host(need=host.needs(s3))
    probe.reset()
    assert "checkpoints at a URL off" in host.check_host()[0]  # a local job: a warning only


# --- the fallbacks -----------------------------------------------------------------------------

def force_off(monkeypatch, key: str) -> None:
    """Feature ``key`` as a torch that lacks its names would probe it."""
    monkeypatch.setitem(probe._missing, key, ("(hidden by the test)",))


def test_worker_side_fallbacks_keep_results_equal(monkeypatch):
    from torch import nn

    from elastic_harness.runtime.buffers import persistent_buffers
    from elastic_harness.torchcompat import nn as cnn

    for key in ("foreach-copy", "buffer-persistence", "compiled-unwrap", "lr-scheduler-check",
                "replicate-check", "mesh-dp", "cuda-fork-check"):
        force_off(monkeypatch, key)
    targets, sources = [torch.zeros(3), torch.zeros(2, 2)], [torch.arange(3.0), torch.ones(2, 2)]
    cnn.copy_all(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=True))
    bn = nn.BatchNorm1d(4)
    bn.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert len(persistent_buffers(bn)) == 4  # running mean/var, count, and scratch (broadcast too)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    assert cnn.unwrap_compiled(model) is model and not cnn.scheduler_built_over(opt)
    assert not cnn.replicate_applied(model) and not cnn.cuda_in_bad_fork()
    assert cnn.flatten_mesh(object(), "dp") is None


# --- rendezvous: patches undone, rounds formed without torch's internals -----------------------

@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{server.port}"
    del server


def handler(endpoint: str, run_id: str):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous.handler import create_handler

    conf = dict(join_timeout=30, last_call_timeout=1, start_last_call_timeout=3, close_timeout=10,
                heartbeat_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=2, is_host=False,
                read_timeout=30)
    return create_handler(RendezvousParameters("c10d", endpoint, run_id, 1, 2, **conf), key=KEY)


def test_module_patches_and_handler_hooks_are_undone(store):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elastic_harness.rendezvous import handler as rendezvous
    from elastic_harness.torchcompat import rdzv

    theirs = (dr.get_method_name, dr.construct_and_record_rdzv_event, dr._delay)
    h = handler(store, "undo")
    try:
        assert (dr.get_method_name, dr.construct_and_record_rdzv_event, dr._delay) == (
            rendezvous.method_name, rendezvous.record_event, rendezvous.delay)
        undo = h.install_liveness()  # a second hook over the first: undone one at a time
        holder = rdzv.state_holder(h)
        assert "_sanitize" in vars(holder)
        undo()
        assert "_sanitize" not in vars(holder)  # torch's method again
    finally:
        h._stop_heartbeats()
        getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes
    rdzv.undo_module_patches()
    assert (dr.get_method_name, dr.construct_and_record_rdzv_event, dr._delay) == theirs


def test_rounds_form_and_a_lost_node_goes_without_torchs_rendezvous_internals(store, monkeypatch):
    """As on a torch whose probes find none of the private rendezvous names (torch itself
    left whole: it uses them too): nothing is patched or hooked, the timeouts are torch's
    own with the start last call, two agents form a group, and when one is lost the
    survivor forms the next round alone once its keep-alives expire. No AttributeError."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from elastic_harness.rendezvous import handler as rendezvous
    from elastic_harness.torchcompat import rdzv

    for key in ("rdzv-events", "rdzv-delay", "rdzv-state", "rdzv-fast-path", "rdzv-early-close"):
        force_off(monkeypatch, key)
    theirs = (dr.get_method_name, dr._delay)
    pair = [handler(store, "bare") for _ in range(2)]
    try:
        assert (dr.get_method_name, dr._delay) == theirs and rdzv.PATCHED == {}
        timeout = rdzv.settings(pair[0]).timeout
        assert type(timeout) is dr.RendezvousTimeout and timeout.last_call.total_seconds() == 3
        assert "_sanitize" not in vars(pair[0]._state_holder)  # no hook
        assert join_all(pair) == [2, 2]
        assert rendezvous.group_running(pair[0]) is True  # cannot tell: as if a group ran
        pair[1]._stop_heartbeats()  # node 1 is gone: no keep-alives, no goodbye
        assert pair[0].next_rendezvous().world_size == 1
    finally:
        for h in pair:
            h._stop_heartbeats()
            getattr(h, "stop_changes", lambda: None)()  # its change thread, before the store goes


# --- the CLI refuses before anything is launched ------------------------------------------------

def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_dir_with_a_checkpoint(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000010"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not touched")
    (step / "__0_0.distcp").write_bytes(os.urandom(64))
    return run


def cli_in(tmp_path: Path, argv: list[str], prelude: str = "", env: dict | None = None):
    code = ("import sys\n" + prelude + "from elastic_harness.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                          cwd=tmp_path, env={**os.environ, **(env or {})})


def assert_refused(r, run: Path, before: dict, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("  fix:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0], r.stderr
    assert snapshot(run) == before, "a refusal touched the run directory"
    assert not (run / "events.jsonl").exists(), "something was launched"


def test_run_and_agent_refuse_an_older_torch(tmp_path):
    fake = tmp_path / "old-torch"
    (fake / "torch-2.9.0.dist-info").mkdir(parents=True)
    (fake / "torch-2.9.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    run = run_dir_with_a_checkpoint(tmp_path)
    before = snapshot(run)
    env = {"PYTHONPATH": os.pathsep.join([str(fake), str(REPO)])}
    for argv in (["run", str(MLP), "--run-dir", str(run)],
                 ["agent", str(MLP), "--run-dir", str(run), "--rdzv-id", "r", "--standalone"]):
        r = cli_in(tmp_path, argv, env=env)
        assert_refused(r, run, before, "torch 2.9.0 is older than elastic-harness supports", release.RANGE)


def test_run_refuses_a_torch_built_without_distributed(tmp_path):
    run = run_dir_with_a_checkpoint(tmp_path)
    before = snapshot(run)
    prelude = "import torch.distributed\ntorch.distributed.is_available = lambda: False\n"
    r = cli_in(tmp_path, ["run", str(MLP), "--run-dir", str(run)], prelude)
    assert_refused(r, run, before, "was built without torch.distributed")


def test_run_refuses_a_torch_missing_a_required_private_name(tmp_path):
    run = run_dir_with_a_checkpoint(tmp_path)
    before = snapshot(run)
    prelude = ("from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
               "del LocalElasticAgent._start_workers\n")
    r = cli_in(tmp_path, ["run", str(MLP), "--run-dir", str(run)], prelude)
    assert_refused(r, run, before, "LocalElasticAgent._start_workers", "elastic agent", release.RANGE)


def test_without_version_counters_a_capture_is_never_intact(monkeypatch):
    """``tensor-versions`` off: a failing rank keeps nothing (memory_on_failure does nothing),
    rather than trusting tensors it cannot tell unchanged."""
    from elastic_harness.memtier import snapshot

    state = {"w": torch.ones(4)}
    assert snapshot.intact(snapshot.capture(state))
    cap = snapshot.capture(state)
    state["w"].add_(1)
    assert not snapshot.intact(cap)
    force_off(monkeypatch, "tensor-versions")
    assert not snapshot.intact(snapshot.capture({"w": torch.ones(4)}))
