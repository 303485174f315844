"""Simulated hosts with their own addresses: one Linux network namespace per node.

Each node gets a namespace with a veth pair whose other end sits on a private bridge in
the root namespace (the bridge holds the ``.1`` address, where an etcd for the job can
listen). Cutting a node off is ``ip link set <its bridge-side veth> down``: packets are
dropped, not refused, exactly like a real partition. Needs root and iproute2.

Call order: ``setup()``, ``add_host(i)`` per node, ``cut(i)``/``heal(i)`` as faults require,
``teardown()`` (safe to call twice; removes only what this object created).
"""

from __future__ import annotations

import random
import subprocess
import uuid
from dataclasses import dataclass

from elastic_harness.errors import HarnessError


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    ifname: str  # inside the namespace
    peer: str  # on the bridge, in the root namespace
    addr: str


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)} failed: {done.stderr.strip()}",
                           "--netns needs root and iproute2 (Linux network namespaces)")


class NetnsTopology:
    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or uuid.uuid4().hex[:4]
        self.bridge = f"eh{self.tag}br"
        self.subnet = f"10.213.{random.randint(1, 254)}"
        self.hosts: dict[int, Host] = {}
        self._up = False

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def setup(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, index: int) -> Host:
        host = Host(index, f"eh{self.tag}-n{index}", f"eh{self.tag}i{index}",
                    f"eh{self.tag}p{index}", f"{self.subnet}.{index + 10}")
        _ip("netns", "add", host.namespace)
        self.hosts[index] = host
        _ip("link", "add", host.peer, "type", "veth", "peer", "name", host.ifname)
        _ip("link", "set", host.peer, "master", self.bridge, "up")
        _ip("link", "set", host.ifname, "netns", host.namespace)
        _ip("-n", host.namespace, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.namespace, "link", "set", host.ifname, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        return host

    def wrap(self, index: int, cmd: list[str]) -> list[str]:
        """Run ``cmd`` inside node ``index``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[index].namespace, *cmd]

    def cut(self, index: int) -> None:
        _ip("link", "set", self.hosts[index].peer, "down")

    def heal(self, index: int) -> None:
        _ip("link", "set", self.hosts[index].peer, "up")

    def teardown(self) -> None:
        for host in list(self.hosts.values()):
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.peer], capture_output=True)
            del self.hosts[host.index]
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._up = False
