"""Ports picked for servers that start together (an etcd member's client, peer and metrics
ports; three members at once) are distinct: a repeat let one member die after its health
check had passed through another's port (stop 38's CI)."""

from __future__ import annotations

import socket

import pytest

from elastic_harness.simcluster.cluster import free_ports

pytestmark = pytest.mark.timeout(30)


def test_ports_picked_together_are_distinct_and_free():
    ports = free_ports(200)
    assert len(set(ports)) == 200
    held = []
    try:
        for port in ports:  # every one is still free to bind, as the servers will
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
