"""A real Slurm on this machine for tests: munged, slurmctld and slurmd, started and stopped
by pid, all state in a temp dir, OS-picked ports.

One node named after this host (``CPUs=2``), ``proctrack/linuxproc`` and ``task/none``
(no cgroups needed), munge with its own key and socket. Two settings make requeues quick
enough for a test: ``cred_expire=5`` (a requeued job waits cred_expire + 1 s before it is
eligible again; the default is 120 s) and ``sched_interval=1`` (the main scheduling loop
runs every second instead of every minute). Jobs still in the queue at the end are killed
(``scancel``) and waited for before the daemons stop, so nothing a job started outlives it.

Missing binaries fail the fixture with the fix (``bash .ci/setup`` installs Debian's
``slurm-wlm`` and ``munge``); the tests that use it are never skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port, wait_until

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _conf(root: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=eh-test", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.sock,cred_expire=5", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SwitchType=switch/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "ReturnToService=2", "MailProg=/bin/true",
        "SchedulerParameters=sched_interval=1", f"NodeName={host} CPUs=2 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
    ])


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ours(env: dict) -> list[str]:
    out = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True,
                         env=env, timeout=30)
    return out.stdout.split()


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Yields the environment (``SLURM_CONF``) under which Slurm's commands reach it."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run `bash .ci/setup` (installs slurm-wlm and munge)")
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, socket.gethostname().split(".")[0]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [_start(["munged", "--foreground", "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
                     f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                     f"--seed-file={root}/munged.seed"], root / "munged.out", env)]
    try:
        wait_until(lambda: (root / "munge.sock").exists() or procs[0].poll() is not None, 30, "munged's socket")
        procs.append(_start(["slurmctld", "-D", "-c", "-f", str(conf)], root / "slurmctld.out", env))
        procs.append(_start(["slurmd", "-D", "-f", str(conf)], root / "slurmd.out", env))
        wait_until(lambda: _idle(env) or any(p.poll() is not None for p in procs), 60, "the Slurm node to be idle")
        dead = [p.args[0] for p in procs if p.poll() is not None]
        assert not dead, f"{dead} exited; see {root}/*.log"
        yield {"SLURM_CONF": str(conf)}
    finally:
        with contextlib.suppress(Exception):
            for job in _ours(env):
                subprocess.run(["scancel", "--full", "--signal=KILL", job], env=env, timeout=30)
                subprocess.run(["scancel", job], env=env, timeout=30)
            wait_until(lambda: not _ours(env), 60, "the test's Slurm jobs to end")
        for proc in reversed(procs):
            _stop(proc)


def _idle(env: dict) -> bool:
    out = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.strip() == "idle"
