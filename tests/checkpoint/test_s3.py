"""Checkpoints in S3: a real S3-compatible server (moto's server mode) on loopback.

The server picks its own port (``-p 0``) and is stopped by pid. Credentials and endpoint
reach the job only through the environment (``AWS_*``); the test checks that the secret
appears nowhere in what the run leaves behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import MLP, cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

SECRET = "not-a-real-secret-7f3a9c"
BUCKET = "eh-ckpts"


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory):
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(rb"Running on http://127\.0\.0\.1:(\d+)", log.read_bytes())):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "moto server did not start"
            time.sleep(0.05)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{int(m.group(1))}"}
        make_bucket(env)
        yield env
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def client(env: dict):
    """An S3 client for the test's own checks, configured explicitly (not via os.environ)."""
    import s3fs

    return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                             endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)


def make_bucket(env: dict) -> None:
    client(env).mkdir(BUCKET)


def ckpt(monkeypatch, capsys, env: dict, *args: str) -> tuple[int, str]:
    """``elastic-harness ckpt ARGS`` in this process, with the AWS_* environment set."""
    from elastic_harness.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    code = main(["ckpt", *args])
    return code, capsys.readouterr().out


def test_run_and_resume_with_checkpoints_in_s3(tmp_path, s3_env, monkeypatch, capsys):
    url = f"s3://{BUCKET}/jobs/mlp"
    sets = ["--set", f"checkpoint.dir={url}", "--set", "checkpoint.every_steps=5"]
    first = cli("run", str(MLP), *sets, "--set", "train.steps=10", run_dir=tmp_path, env=s3_env, timeout=180)
    assert first.code == 0, first.err
    assert [c["path"] for c in first.kinds("checkpoint")] == [f"{url}/step-0000005", f"{url}/step-0000010"]
    assert not (tmp_path / "checkpoints").exists()  # nothing went to local disk
    keys = client(s3_env).find(f"{BUCKET}/jobs/mlp")
    assert f"{BUCKET}/jobs/mlp/step-0000010/manifest.json" in keys
    assert f"{BUCKET}/jobs/mlp/step-0000010/.metadata" in keys
    assert [c["asynchronous"] for c in first.kinds("checkpoint")] == [True, False]

    again = cli("run", str(MLP), *sets, "--set", "train.steps=15", run_dir=tmp_path, env=s3_env, timeout=180)
    assert again.code == 0, again.err
    resume = again.kinds("resume")[-1]
    assert (resume["step"], resume["checkpoint"]) == (10, "step-0000010")
    assert again.kinds("checkpoint")[-1]["step"] == 15

    code, out = ckpt(monkeypatch, capsys, s3_env, "ls", str(tmp_path))  # follows checkpoint.dir
    assert code == 0 and url in out and "15      2" in out, out
    code, out = ckpt(monkeypatch, capsys, s3_env, "verify", url)
    assert code == 0 and "a resume would load step-0000015" in out, out
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"secret leaked into {path}"
    assert SECRET not in first.out + first.err + again.out + again.err


def test_lock_fence_and_quarantine_on_s3(s3_env, monkeypatch):
    """The object-store variants: a lock object (last writer wins, then read back), the
    generation record, and setting a checkpoint aside (copy, drop the manifest first, delete)."""
    import torch

    from elastic_harness.checkpoint import fence, layout, lock
    from elastic_harness.checkpoint.export import save_single_process
    from elastic_harness.checkpoint.storage import open_storage

    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    storage = open_storage(f"s3://{BUCKET}/lock-test")
    first = lock.Lease.acquire(storage, lock.Holder.this_process("a", "a-1"), beat_s=3600)
    with pytest.raises(lock.LockHeld, match="job 'a' .rendezvous id a-1"):
        lock.Lease.acquire(storage, lock.Holder.this_process("b", "b-2"), beat_s=3600)
    first.release()
    assert lock.read_record(storage) is None
    g = fence.bump(storage, "a")
    assert fence.read(storage) == g and fence.bump(storage, "a").number == g.number + 1

    save_single_process(storage, "step-0000001", {"model": {"w": torch.ones(4)}}, {"step": 1})
    storage.set_aside("step-0000001", "step-0000001.bad-test")
    listing = storage.listing()
    assert "step-0000001" not in listing and layout.MANIFEST in listing["step-0000001.bad-test"]
    assert layout.scan(listing) == [] and layout.parse_quarantined("step-0000001.bad-test") == 1
    with pytest.raises(FileNotFoundError):  # as on a local disk: a save's start tells "none" from "empty"
        storage.files("step-0000001")
    keys = client(s3_env).find(f"{BUCKET}/lock-test")
    assert f"{BUCKET}/lock-test/{fence.GENERATION_FILE}" in keys and not any("/step-0000001/" in k for k in keys)
