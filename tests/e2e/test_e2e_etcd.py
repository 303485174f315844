"""Issue 37: a job on etcd's v3 API, given the wrong etcd: one line, exit 2, nothing trained,
nothing lost (the checkpoints of an earlier run byte for byte), against real etcd servers."""

from __future__ import annotations

import hashlib

import pytest

from elastic_harness import exitcodes
from tests.conftest import MLP, cli
from tests.servers import etcd_enable_auth, etcd_server, make_tls

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
        for case, (sets, words) in cases.items():
            args = [a for s in ["rendezvous.backend=etcd", "train.steps=20", *sets] for a in ("--set", s)]
            r = cli("run", str(MLP), *args, run_dir=run_dir)
            assert r.code == exitcodes.PERMANENT, (case, r.code, r.err)
            lines = [line for line in r.err.splitlines() if words in line]
            assert len(lines) == 1 and "nothing was trained" in lines[0], (case, r.err)
            assert "Traceback" not in r.err, case
            assert not r.kinds("step") and not r.kinds("rendezvous"), case
            assert digests(run_dir) == kept, f"{case}: the checkpoints changed"
