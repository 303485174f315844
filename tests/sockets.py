"""Which TCP sockets are listening, and for which process: read from /proc, as ``ss -ltnp``."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable

_LISTEN = "0A"


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0])))
    words = struct.unpack("<4I", raw)  # four host-order 32-bit words
    return str(ipaddress.IPv6Address(b"".join(struct.pack(">I", w) for w in words)))


def listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this namespace."""
    found = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{name}") as f:
            for line in list(f)[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == _LISTEN:
                    addr, port = local.split(":")
                    found[inode] = (_address(addr), int(port, 16))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def listening_sockets(pids: Iterable[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of the TCP sockets the processes ``pids`` listen on."""
    table = listening()
    return [(*table[i], pid) for pid in pids for i in socket_inodes(pid) if i in table]


def descendants(root: int) -> set[int]:
    """``root`` and every process below it (by /proc/PID/stat's parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children.get(pid, []))
    return out


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (the route to the outside)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(addr).is_loopback else addr
