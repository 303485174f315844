"""A simulated host's first process: ``python -m elastic_harness.simcluster.simhost NAME ADDR SCRATCH -- CMD...``.

``run --separate-hosts`` starts each node as ``ip netns exec NS unshare --pid --uts --fork
--mount-proc --kill-child python -m elastic_harness.simcluster.simhost ...`` (``command``): its own network, pid,
UTS and mount namespaces, so nothing in the job can use a same-host shortcut (a pid means
nothing to another node, and the host names differ). This process is pid 1 there, the
host's init. It

1. names the host ``NAME`` and makes the name resolve to ``ADDR`` (the node's own address)
   by bind-mounting a private ``/etc/hosts`` (the mount namespace is this host's alone;
   the file is unlinked once mounted, so nothing is left behind), since torch asks for
   its host's name (``socket.getfqdn``) and an unknown name goes to DNS;
2. runs ``CMD`` (the node's agent) as its one child, in a process group of its own, and
   passes it the stop signals it receives itself (``FORWARD``): the host signals this
   process, and the agent hears it once;
3. reaps every process that ends up its child (orphans are re-parented to pid 1), and exits
   with the agent's status (128 + signal if killed) when the agent ends. The kernel then
   kills whatever is left in the namespace: a host whose agent died takes its workers with
   it, as ``PR_SET_PDEATHSIG`` does on a shared host.

The agent is not pid 1 itself: the kernel keeps signals without a handler (SIGKILL among
them) from reaching a namespace's init from inside, so a worker could not kill its agent
(``kill-node`` fired by a worker).

Needs root (namespaces, ``mount``), Linux. Standard library only: it starts before torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MS_BIND = 4096


def command(name: str, addr: str, scratch: Path, cmd: list[str]) -> list[str]:
    """Pure: ``cmd`` started as the only process of a new simulated host (in the network
    namespace it is run in): its own pid, UTS and mount namespaces, this module as its init.
    ``--kill-child``: the host goes when ``unshare`` is killed."""
    return ["unshare", "--pid", "--uts", "--fork", "--mount-proc", "--kill-child",
            sys.executable, "-m", "elastic_harness.simcluster.simhost", name, addr, str(scratch), "--", *cmd]


def hosts_text(name: str, addr: str) -> str:
    """Pure: the private ``/etc/hosts`` of host ``name`` at ``addr``."""
    return f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{addr} {name}\n"


def exit_code(status: int) -> int:
    """Pure: a ``waitpid`` status as a shell reports it (128 + signal when killed)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def name_host(name: str, addr: str, scratch: Path) -> None:
    """Set this namespace's host name and make it resolve to ``addr`` (module doc)."""
    socket.sethostname(name)
    scratch.mkdir(parents=True, exist_ok=True)
    private = scratch / f"hosts-{name}-{os.getpid()}-{os.urandom(4).hex()}"
    private.write_text(hosts_text(name, addr))
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.mount(str(private).encode(), b"/etc/hosts", None, MS_BIND, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"bind-mounting {private} on /etc/hosts: {os.strerror(err)}")
    finally:
        private.unlink()


def run(cmd: list[str]) -> int:
    """Start ``cmd`` as this init's child, forward ``FORWARD`` to it, reap, return its code."""
    child = os.fork()
    if child == 0:
        try:
            os.setpgid(0, 0)
            for sig in FORWARD:
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for sig in FORWARD:
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        if pid == child:
            return exit_code(status)


def main(argv: list[str]) -> int:
    """``NAME ADDR SCRATCH -- CMD...``; ``SCRATCH``: a directory of the run (the private hosts
    file passes through it)."""
    if len(argv) < 5 or argv[3] != "--":
        print("usage: python -m elastic_harness.simcluster.simhost NAME ADDR SCRATCH -- CMD...", file=sys.stderr)
        return 2
    name, addr, scratch, cmd = argv[0], argv[1], Path(argv[2]), argv[4:]
    name_host(name, addr, scratch)
    return run(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
