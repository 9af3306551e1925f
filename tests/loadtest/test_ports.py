"""`loadtest.ports`: a batch of ports is distinct, and no port is handed out twice by one process."""

from __future__ import annotations

import socket

from loadtest.ports import free_port, free_ports


def test_a_batch_is_distinct_and_bindable() -> None:
    ports = free_ports(32)
    assert len(set(ports)) == 32
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing listens there


def test_no_port_is_handed_out_twice() -> None:
    seen = set(free_ports(16))
    for _ in range(64):
        port = free_port()
        assert port not in seen
        seen.add(port)
