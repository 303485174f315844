"""Listening sockets bound to one address, never to every interface.

torch's ``TCPStore`` server binds the wildcard address (every interface) whatever host it
is given; the host only tells clients where to connect. A store bound that way is open to
anyone who reaches the machine, and torch's stores have no authentication. So
the harness binds the socket itself, to the address the job was told to use (the
rendezvous endpoint's host, the node's ``--local-addr``; ``127.0.0.1`` for a local ``run``)
and hands it to ``TCPStore(master_listen_fd=...)``.

``listener(host, port)`` binds ``bind_address(host)`` and listens; the caller passes
``sock.detach()`` to the store, which then owns the descriptor. Pure standard library.

One case cannot be decided here: a host *name* (not ``localhost``) that resolves only to
loopback on this machine (Debian's ``127.0.1.1 HOSTNAME`` in /etc/hosts, a shared hostname
in network namespaces) while other nodes resolve it to this node's real address. Binding
loopback would lock the other nodes out, so that case listens on every interface, as torch
does, with one logged warning naming the fix (``--local-addr`` or an IP endpoint).
"""

from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger(__name__)


def bind_address(host: str, resolved: list[str]) -> tuple[str, bool]:
    """Pure: the address to bind for ``host`` (resolved here to ``resolved``), and whether
    that is every interface (the ambiguous name of the module doc)."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host)), False  # an address: exactly that one
    except ValueError:
        pass
    routable = [a for a in resolved if not is_loopback(a)]
    if routable:
        return routable[0], False
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return resolved[0], False
    return ("::" if resolved and ":" in resolved[0] else "0.0.0.0"), True


def listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on ``host``'s address at ``port`` (0: any free port).

    Raises ``OSError`` (the port is taken, ``host`` is not an address of this machine) or
    ``socket.gaierror`` (``host`` does not resolve)."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    address, everywhere = bind_address(host, [str(info[4][0]) for info in infos])
    if everywhere:
        log.warning("%s resolves only to loopback here but names this node to the others: listening on "
                    "every interface at port %d; pass --local-addr ADDRESS (or an IP endpoint) to bind one",
                    host, port)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        sock.bind((address, port))
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
