"""A real Slurm on this machine for tests: munged, slurmctld and slurmd, started and stopped
by pid, all state in a temp dir, OS-picked ports.

``slurm_cluster(root, nodes=N)``: nodes ``n0`` .. ``n<N-1>``, each slurmd in a network
namespace of its own (``elastic_harness.simcluster.netns``: its own address on a private bridge) and a
UTS namespace (its own hostname), entered with ``nsenter --net`` rather than ``ip netns
exec`` so /sys keeps the machine's cgroup mounts, which slurmd reads. Each also gets a mount
namespace whose /etc/hosts names both nodes: jobs on either node resolve ``n0`` and ``n1``
to their namespace addresses (the batch script rendezvouses on the first node by name),
and torch and gloo bind to the namespace address, not to loopback. slurmctld stays in
the root namespace, reached on the bridge's address.

Also: ``proctrack/linuxproc`` and ``task/none`` (no cgroups needed), munge with its
own key and socket, ``cred_expire=5`` (a requeued job waits cred_expire + 1 s before it is
eligible again; the default is 120 s) and ``sched_interval=1`` (the main scheduling loop
runs every second instead of every minute), ``KillWait=2`` (a cancelled job's leftovers get
SIGKILL after 2 s, not 30: the tests' stops use ``scancel --signal``, which it does not
affect). Jobs still in the queue at the end are killed
and waited for before the daemons stop, so nothing a job started outlives the fixture.

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

from elastic_harness.simcluster.netns import NetnsTopology
from tests.servers import free_ports, wait_until

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "nsenter", "unshare")


def _conf(root: Path, controller: str, nodes: list[str]) -> str:
    ctld_port, slurmd_port = free_ports(2)
    return "\n".join([
        "ClusterName=eh-test", f"SlurmctldHost={controller}", f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.sock,cred_expire=5", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SwitchType=switch/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "ReturnToService=2", "MailProg=/bin/true",
        "SchedulerParameters=sched_interval=1", "KillWait=2", *nodes,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
    ])


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every daemon at once, then wait for each (a daemon's own shutdown takes
    seconds; one after the other it added up to most of a minute); SIGKILL after 20 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _slurm(env: dict, *cmd: str) -> str:
    return subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=30).stdout


def _daemons(root: Path, nodes: int, topology: NetnsTopology) -> tuple[str, list[str], list[list[str]]]:
    """(controller, NodeName lines, slurmd commands) for ``nodes`` nodes in namespaces."""
    conf = str(root / "slurm.conf")
    topology.setup()
    hosts = [topology.add_host(i) for i in range(nodes)]
    (root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{h.addr} n{h.index}\n" for h in hosts))
    lines = [f"NodeName=n{h.index} NodeAddr={h.addr} NodeHostname=n{h.index} CPUs={os.cpu_count()} State=UNKNOWN"
             for h in hosts]
    commands = [["nsenter", f"--net=/var/run/netns/{h.namespace}", "unshare", "--uts", "--mount", "sh", "-c",
                 f"mount --bind {root}/hosts /etc/hosts && hostname n{h.index} && exec slurmd -D -f {conf}"]
                for h in hosts]
    return f"{socket.gethostname().split('.')[0]}({topology.gateway})", lines, commands


@contextlib.contextmanager
def slurm_cluster(root: Path, nodes: int = 2) -> Iterator[dict[str, str]]:
    """Yields the environment (``SLURM_CONF``) under which Slurm's commands reach it."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run `bash .ci/setup` (installs slurm-wlm and munge)")
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    topology = NetnsTopology()
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    procs: list[subprocess.Popen] = []
    try:
        controller, lines, slurmds = _daemons(root, nodes, topology)
        (root / "slurm.conf").write_text(_conf(root, controller, lines))
        procs.append(_start(["munged", "--foreground", "--force", f"--socket={root}/munge.sock", f"--key-file={key}",
                             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                             f"--seed-file={root}/munged.seed"], root / "munged.out", env))
        wait_until(lambda: (root / "munge.sock").exists() or procs[0].poll() is not None, 30, "munged's socket")
        procs.append(_start(["slurmctld", "-D", "-c", "-f", str(root / "slurm.conf")], root / "slurmctld.out", env))
        for i, cmd in enumerate(slurmds):
            procs.append(_start(cmd, root / f"slurmd-{i}.out", env))
        wait_until(lambda: _slurm(env, "sinfo", "--noheader", "--format=%T").split() == ["idle"]
                   or any(p.poll() is not None for p in procs), 60, "the Slurm nodes to be idle")
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"{dead} exited; see {root}/*.log and *.out"
        yield {"SLURM_CONF": str(root / "slurm.conf")}
    finally:
        with contextlib.suppress(Exception):
            for job in _slurm(env, "squeue", "--noheader", "--format=%i").split():
                subprocess.run(["scancel", "--full", "--signal=KILL", job], env=env, timeout=30)
                subprocess.run(["scancel", job], env=env, timeout=30)
            wait_until(lambda: not _slurm(env, "squeue", "--noheader", "--format=%i").split(), 60,
                       "the test's Slurm jobs to end")
        _stop(procs[1:])  # the Slurm daemons, then munge, which they authenticate through
        _stop(procs[:1])
        topology.teardown()
