"""Issue 37: a job on etcd's v3 API, given the wrong etcd: one line, exit 2, nothing trained,
nothing lost (the checkpoints of an earlier run byte for byte), against real etcd servers."""

from __future__ import annotations

import hashlib

import pytest

from elastic_harness import exitcodes
from tests.conftest import MLP, cli, read_jsonl
from tests.servers import etcd_enable_auth, etcd_server, make_tls, restartable_etcd, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def digests(run_dir) -> dict[str, str]:
    ckpts = run_dir / "checkpoints"
    return {p.relative_to(ckpts).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpts.rglob("*")) if p.is_file()}


def test_etcd_mistakes_are_one_line_exit_2_and_lose_nothing(tmp_path):
    run_dir = tmp_path / "run"
    first = cli("run", str(MLP), "--set", "train.steps=10", run_dir=run_dir)
    assert first.code == 0, first.err
    kept = digests(run_dir)
    assert any(name.endswith("manifest.json") for name in kept)
    tls = make_tls((tmp_path / "tls").mkdir() or tmp_path / "tls")
    (tmp_path / "password").write_text("guess\n")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with etcd_server(tmp_path / "a" / "data") as plain, \
            etcd_server(tmp_path / "b" / "data", v2=True, gateway=False) as v2_only:
        etcd_enable_auth(plain, "job", "the-real-one")
        cases = {
            "wrong credentials": ([f"rendezvous.endpoint={plain}", "rendezvous.etcd_user=job",
                                   f"rendezvous.etcd_password_file={tmp_path / 'password'}"], "refused user 'job'"),
            "TLS asked of a plain etcd": ([f"rendezvous.endpoint={plain}", "rendezvous.etcd_protocol=https",
                                           f"rendezvous.etcd_ca_cert={tls.ca}"], "does not speak TLS"),
            "a v2-only etcd": ([f"rendezvous.endpoint={v2_only}"], "no etcd v3 API"),
        }
        # torch's etcd-v2 rendezvous against an etcd with v2 off: exit 200 said "re-run once it
        # is up" of an etcd that was up; it is the job's configuration
        cases["etcd-v2 against an etcd without v2"] = (["rendezvous.backend=etcd-v2", f"rendezvous.endpoint={plain}"],
                                                       "has no v2 API, which rendezvous.backend: etcd-v2 needs")
        for case, (sets, words) in cases.items():
            args = [a for s in ["rendezvous.backend=etcd", "train.steps=20", *sets] for a in ("--set", s)]
            r = cli("run", str(MLP), *args, run_dir=run_dir)
            assert r.code == exitcodes.PERMANENT, (case, r.code, r.err)
            lines = [line for line in r.err.splitlines() if words in line]
            assert len(lines) == 1 and "nothing was trained" in lines[0], (case, r.err)
            assert "Traceback" not in r.err and "fix: fix it" not in r.err, case
            assert not r.kinds("step") and not r.kinds("rendezvous"), case
            assert digests(run_dir) == kept, f"{case}: the checkpoints changed"


def test_a_job_rides_out_its_only_etcd_member_restarting(tmp_path):
    """Restarting the only etcd member while a job ran ended the job 3-5 s later (exit 200,
    after draining), isolation_timeout or not. The rendezvous' calls now ride out an etcd
    that no member answers for up to rendezvous.isolation_timeout after its last answer:
    the job trains through the restart and finishes, with no restart of its own."""
    import subprocess
    import sys

    from tests.conftest import REPO, communicate_bounded

    run_dir = tmp_path / "run"
    steps = lambda: [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "step"]  # noqa: E731
    (tmp_path / "etcd").mkdir()
    with restartable_etcd(tmp_path / "etcd" / "data") as etcd:
        cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
               "--set", "rendezvous.backend=etcd", "--set", f"rendezvous.endpoint={etcd.endpoint}",
               "--set", "train.steps=400", "--set", "checkpoint.every_steps=100"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                start_new_session=True)
        wait_until(lambda: steps() or proc.poll() is not None, 180, "the job to train")
        etcd.stop()
        down_at = max(steps())
        # etcd stays down while the job trains on (keep-alives and polls find no member)
        wait_until(lambda: max(steps()) >= down_at + 40 or proc.poll() is not None, 120, "40 steps without etcd")
        etcd.start()
        out, err = communicate_bounded(proc, 300, "the job")
    assert proc.returncode == 0, err
    assert "finished: 400 steps" in out and ", restarts 0," in out, out
