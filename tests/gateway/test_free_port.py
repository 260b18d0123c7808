"""``free_port``: the ports that tests, load tests and ``pd-cluster`` plan before their children bind them."""

from __future__ import annotations

import socket

from gateway.cluster import _EPHEMERAL_LOW, free_port


def test_planned_ports_are_distinct_bindable_and_clear_of_the_kernel_and_mooncake() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    # below the ephemeral range: an outgoing connection's local end cannot take one before its child binds it
    assert all(port < _EPHEMERAL_LOW for port in ports)
    # outside 15000-17000, where Mooncake's transfer engine binds its listeners at random (a gateway
    # planned at 15317 once lost its port to a Mooncake worker started before it)
    assert not [port for port in ports if 15000 <= port <= 17000]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
