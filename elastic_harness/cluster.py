"""Simulated nodes on one machine: each node is an ``elastic-harness agent`` subprocess.

Each agent runs in its own session (process group), so this module signals only what it
started, by process group. That group holds the agent, not its workers: torchelastic starts
every worker in a session of its own. Workers die with their agent through
``PR_SET_PDEATHSIG`` (``runtime.entry``), and agents with the ``run`` that started them
(``_die_with_host``); a fault that must reach workers alive (freezing a node) signals their
pids, which the chaos controller learns from ``worker`` events.

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
from elastic_harness.launch.config import agent_environ
from elastic_harness.netns import NetnsTopology


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_host() -> None:
    """Simulated nodes belong to the ``run`` that started them: if it is killed outright,
    they go too (and their workers with them), instead of training on as orphans."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Node:
    index: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session: the agent leads its own group

    def returncode(self) -> int | None:
        return self.proc.poll()


class LocalCluster:
    def __init__(
        self,
        job_path: Path,
        run_dir: Path,
        nodes: int,
        rdzv_id: str,
        endpoint: str,
        backend: str = "c10d",
        extra_args: tuple[str, ...] = (),
        netns: NetnsTopology | None = None,
    ) -> None:
        self.job_path, self.run_dir, self.initial = job_path, run_dir, nodes
        self.rdzv_id, self.endpoint, self.backend = rdzv_id, endpoint, backend
        self.extra_args = extra_args
        self.netns = netns
        self.nodes: dict[int, Node] = {}
        self._stopped = False

    def start(self) -> None:
        for i in range(self.initial):
            self.add_node(i)

    def add_node(self, index: int | None = None) -> Node:
        index = max(self.nodes, default=-1) + 1 if index is None else index
        cmd = [
            sys.executable, "-m", "elastic_harness", "agent", str(self.job_path),
            "--run-dir", str(self.run_dir), "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.rdzv_id, "--rdzv-backend", self.backend, "--node", str(index),
            "--no-progress", "--no-summary",  # the host prints the progress, writes the summary
            *self.extra_args,
        ]
        if self.backend == "c10d":
            # One agent hosts the c10d store; it is explicit so no two agents race for it.
            cmd.append("--is-host" if index == 0 else "--no-host")
        env = agent_environ()
        if self.netns is None:
            # One machine: every socket of the job (stores, gloo) on loopback (issue 22).
            cmd += ["--local-addr", "127.0.0.1"]
            env["GLOO_SOCKET_IFNAME"] = "lo"
            env["NCCL_SOCKET_IFNAME"] = "lo"  # NCCL's bootstrap sockets (GPU jobs)
        else:
            # Its own address: gloo and the agent bind there, not to the shared hostname.
            host = self.netns.hosts.get(index) or self.netns.add_host(index)
            cmd = self.netns.wrap(index, [*cmd, "--local-addr", host.addr])
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        log_dir = self.run_dir / runfiles.LOGS
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / runfiles.agent_log(index)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, preexec_fn=_die_with_host,
            )
        node = Node(index, proc, log_path)
        self.nodes[index] = node
        return node

    def poll(self) -> dict[int, int | None]:
        return {i: n.returncode() for i, n in self.nodes.items()}

    def running(self) -> list[int]:
        return [i for i, code in self.poll().items() if code is None]

    def signal_node(self, index: int, sig: int) -> None:
        """Send ``sig`` to the node's process group: its agent (workers have their own
        sessions; a SIGKILL reaches them through their parent-death signal)."""
        node = self.nodes[index]
        if node.returncode() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pgid, sig)

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
