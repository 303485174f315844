"""Simulated nodes on one machine: each node is an ``elastic-harness agent`` subprocess.

Each agent runs in its own session (process group), so this module signals only what it
started, by process group. That group holds the agent, not its workers: torchelastic starts
every worker in a session of its own. Workers die with their agent through
``PR_SET_PDEATHSIG`` (``runtime.entry``), and agents with the ``run`` that started them
(``_die_with_host``); a fault that must reach workers alive (freezing a node) signals their
pids, which the chaos controller learns from ``worker`` events.

Separate hosts (``separate_hosts``, with ``netns``): each node also gets its own pid, UTS
and mount namespaces (``simhost``), so its pids and host name are its own. Pids the node
reports (events) are then translated (``host_pid``), and freezing or thawing a node signals
every process of its namespace.

On one shared host (no ``netns``), the agents are forks of one *host zygote* (``agent.zygote``
run with ``AGENT_MODULES`` on top of the workers' modules), started with the cluster: every
agent and its worker zygote (forked with it) skip the interpreter start and ``import torch``,
about 10 s of CPU per node on a 2-core machine, paid once per run instead. The zygote dies
with this process and each agent with the zygote (parent-death signals), so a killed ``run``
still takes its nodes along. A node's agent exits are those the zygote reports (``Hosted``).

Call order: ``start()`` once; ``poll()`` repeatedly; ``signal_node`` / ``add_node`` as chaos
requires; ``stop()`` at the end (safe to call twice).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.agent.zygote import Zygote, ZygoteLost
from elastic_harness.launch.config import agent_environ, worker_malloc_environ
from elastic_harness.launch.scratch import torch_environ
from elastic_harness.runtime.zygote import AFTER_RUN_DIR, preload_for
from elastic_harness.simcluster import pidns, simhost
from elastic_harness.simcluster.netns import NetnsTopology
from elastic_harness.spec import backends


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the OS has free now. The sockets stay bound until all are
    picked: ports taken one by one and released each time can repeat, and a server given the
    same port twice (an etcd member's client and metrics ports) dies after it started."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_host() -> None:
    """Simulated nodes belong to the ``run`` that started them: if it is killed outright,
    they go too (and their workers with them), instead of training on as orphans."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# What the host zygote imports on top of the workers' modules: an agent's (module doc).
AGENT_MODULES = ("torch.distributed.run", "elastic_harness.commands.agent", "elastic_harness.agent.node")


class Hosted:
    """A node's agent forked by the host zygote, with the part of ``Popen``'s interface a
    ``Node`` uses: its exit code is the one the zygote reports; a lost zygote took its
    agents along (parent-death signal)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        code = self.zygote.poll().get(self.pid)
        if code is None and self.zygote.lost():
            return -signal.SIGKILL
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
            self.zygote.poll(left)
        return code


@dataclass
class Node:
    index: int
    proc: subprocess.Popen | Hosted
    log_path: Path
    separate: bool = False  # its own pid namespace: ``proc`` is ``unshare``, its child the init
    _init: int | None = None

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the agent leads its own group

    def returncode(self) -> int | None:
        return self.proc.poll()

    def init(self) -> int | None:
        """Separate host: its init's pid here (``simhost``; found once), None before it runs."""
        if self._init is None and self.separate:
            self._init = pidns.init_of(self.proc.pid)
        return self._init


def host_name(tag: str, index: int) -> str:
    """Pure: the host name of simulated host ``index`` (unique per run: ``tag``)."""
    return f"eh{tag}-node{index}"


@dataclass(frozen=True)
class AgentArgs:
    """What every node's ``elastic-harness agent`` is started with (``LocalCluster.add_node``):
    the resolved job, its run directory, the rendezvous (id, endpoint, the spec's backend name)
    and any further flags."""

    job_path: Path
    run_dir: Path
    rdzv_id: str
    endpoint: str
    backend: str = "c10d"
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hosts:
    """Where a local run's nodes live: this machine's network (or a namespace each:
    ``netns``), one pid namespace (or one each: ``separate``), and the host zygote started
    for the agents, if any (``start_host_zygote``; never with namespaces)."""

    netns: bool = False
    separate: bool = False
    zygote: Zygote | None = None


def host_preload(tensorboard: bool) -> tuple[str, ...]:
    """Pure: what a host zygote imports as it starts (``AFTER_RUN_DIR`` follows once the run
    dir is known). ``tensorboard``: the job writes TensorBoard files (``metrics.tensorboard``,
    ``preload_for``); otherwise its writer is not imported: a third of a CPU second, before
    which no agent can start."""
    return tuple(m for m in preload_for(tensorboard=tensorboard) if m not in AFTER_RUN_DIR)


def start_host_zygote(tensorboard: bool = True) -> Zygote:
    """A host zygote (module doc), started now: it imports while its caller goes on with
    its own checks (``run`` starts it before it imports torch itself); ``host_preload``."""
    env = agent_environ()
    env.update(worker_malloc_environ(env))  # inherited by every fork (``launch.config``)
    zygote = Zygote(host_preload(tensorboard), also=AGENT_MODULES, env=env)
    zygote.start()
    return zygote


class LocalCluster:
    def __init__(self, agents: AgentArgs, nodes: int, netns: NetnsTopology | None = None,
                 separate_hosts: bool = False, zygote: Zygote | None = None) -> None:
        if separate_hosts and netns is None:
            raise AssertionError("separate hosts need their own network namespaces")
        self.separate_hosts = separate_hosts
        self.agents, self.run_dir, self.initial = agents, agents.run_dir, nodes
        self.netns = netns
        self.nodes: dict[int, Node] = {}
        self._stopped = False
        self._zygote = zygote if netns is None else None  # ``stop`` ends it

    def start(self) -> None:
        if self.netns is None and self._zygote is None:
            self._zygote = start_host_zygote()
        if self._zygote is not None:  # torch's caches in the run dir, as the agents set them
            with contextlib.suppress(ZygoteLost):
                self._zygote.import_more(AFTER_RUN_DIR, torch_environ(self.run_dir, os.environ))
        for i in range(self.initial):
            self.add_node(i)

    def add_node(self, index: int | None = None) -> Node:
        index = max(self.nodes, default=-1) + 1 if index is None else index
        a = self.agents
        cmd = [
            sys.executable, "-m", "elastic_harness", "agent", str(a.job_path),
            "--run-dir", str(a.run_dir), "--rdzv-endpoint", a.endpoint,
            "--rdzv-id", a.rdzv_id, "--rdzv-backend", a.backend, "--node", str(index),
            "--no-progress", "--no-summary",  # the host prints the progress, writes the summary
            *a.extra,
        ]
        if backends.BY_NAME[a.backend].hosts_store:
            # One agent hosts the c10d store; it is explicit so no two agents race for it.
            cmd.append("--is-host" if index == 0 else "--no-host")
        env = agent_environ()
        if self.netns is None:
            # One machine: every socket of the job (stores, gloo) on loopback (docs/security.md).
            cmd += ["--local-addr", "127.0.0.1"]
            env["GLOO_SOCKET_IFNAME"] = "lo"
            env["NCCL_SOCKET_IFNAME"] = "lo"  # NCCL's bootstrap sockets (GPU jobs)
        else:
            # Its own address: gloo and the agent bind there, not to the shared hostname.
            host = self.netns.hosts.get(index) or self.netns.add_host(index)
            cmd = [*cmd, "--local-addr", host.addr]
            if self.separate_hosts:
                cmd = simhost.command(host_name(self.netns.tag, index), host.addr,
                                      self.run_dir / runfiles.TMP, cmd)
            cmd = self.netns.wrap(index, cmd)
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        log_dir = self.run_dir / runfiles.LOGS
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / runfiles.agent_log(index)
        node = Node(index, self._hosted(cmd, env, log_path) or self._started(cmd, env, log_path), log_path,
                    separate=self.separate_hosts)
        self.nodes[index] = node
        return node

    def _hosted(self, cmd: list[str], env: dict[str, str], log_path: Path) -> Hosted | None:
        """The agent ``cmd`` (``python -m elastic_harness ...``) forked by the host zygote,
        or None without one (namespaces) or once it is gone."""
        if self._zygote is None or self._zygote.lost():
            return None
        try:
            pid = self._zygote.spawn_agent(cmd[2], cmd[3:], env, str(log_path))
        except ZygoteLost:
            return None
        return Hosted(self._zygote, pid)

    @staticmethod
    def _started(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, preexec_fn=_die_with_host)

    def poll(self) -> dict[int, int | None]:
        return {i: n.returncode() for i, n in self.nodes.items()}

    def running(self) -> list[int]:
        return [i for i, code in self.poll().items() if code is None]

    def signal_node(self, index: int, sig: int) -> None:
        """Send ``sig`` to the node's process group: its agent (workers have their own
        sessions; a SIGKILL reaches them through their parent-death signal). A separate
        host's init passes other signals on to its agent; SIGSTOP and SIGCONT go to every
        process of the host, as a host that freezes and thaws."""
        node = self.nodes[index]
        if node.returncode() is not None:
            return
        if node.separate and sig in (signal.SIGSTOP, signal.SIGCONT):
            for pid in self.host_processes(index):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pgid, sig)

    def agent_pid(self, index: int) -> int:
        """The process to signal for node ``index``'s agent (here): the agent, or its host's
        init, which passes the signal on (``simhost``)."""
        node = self.nodes[index]
        return (node.init() or node.proc.pid) if node.separate else node.proc.pid

    def host_processes(self, index: int) -> list[int]:
        """Separate host: every process of node ``index``'s namespace (pids here); else []."""
        node = self.nodes[index]
        init = node.init()
        ns = pidns.namespace(init) if init is not None else None
        return sorted(pidns.members(ns).values()) if ns is not None else []

    def host_pid(self, index: int, pid: int) -> int | None:
        """Pid ``pid`` as node ``index`` reported it (in its events), here; None if that
        process is gone. The same number on a shared host."""
        node = self.nodes.get(index)
        if node is None or not node.separate:
            return pid
        init = node.init()
        ns = pidns.namespace(init) if init is not None else None
        return pidns.members(ns).get(pid) if ns is not None else None

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM every live node, wait up to ``grace_s``, then SIGKILL what is left."""
        if self._stopped:
            return
        self._stopped = True
        for i in self.running():
            self.signal_node(i, signal.SIGCONT)  # a frozen node cannot handle SIGTERM
            self.signal_node(i, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for node in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for node in self.nodes.values():
            # Even if the agent exited: a safety net for anything left in its group (not its
            # workers, which are not in it and die with the agent by PR_SET_PDEATHSIG).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.pgid, signal.SIGKILL)
            node.proc.wait()
        if self._zygote is not None:
            self._zygote.stop()
