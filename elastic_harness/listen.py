"""Listening sockets bound to one address, never to every interface.

torch's ``TCPStore`` server binds the wildcard address (every interface) whatever host it
is given; the host only tells clients where to connect. A store bound that way is open to
anyone who reaches the machine, and torch's stores have no authentication (issue 22). So
the harness binds the socket itself, to the address the job was told to use (the
rendezvous endpoint's host, the node's ``--local-addr``; ``127.0.0.1`` for a local ``run``)
and hands it to ``TCPStore(master_listen_fd=...)``.

``listener(host, port)`` resolves ``host`` the way a client will (first address of
``getaddrinfo``), binds there and listens; the caller passes ``sock.detach()`` to the store,
which then owns the descriptor. Pure standard library.
"""

from __future__ import annotations

import ipaddress
import socket


def listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on ``host``'s address at ``port`` (0: any free port).

    Raises ``OSError`` (the port is taken, ``host`` is not an address of this machine) or
    ``socket.gaierror`` (``host`` does not resolve)."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def is_loopback(address: str) -> bool:
    """Pure: ``address`` (an IP, as ``/proc/net/tcp`` or ``ss`` print it) is a loopback one."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
