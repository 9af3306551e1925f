"""`loadtest.ports` and the demo's `free_port`: a batch of ports is distinct, no port is handed out
twice by one process, and runs side by side take ports of their own shard."""

from __future__ import annotations

import socket

import pytest

from gateway import demo
from gateway.config.base import ConfigError
from loadtest.ports import SHARD_ENV, free_port, free_ports


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


@pytest.mark.parametrize("shard", [0, 1, 2])
def test_a_shard_hands_out_only_its_own_ports(monkeypatch: pytest.MonkeyPatch, shard: int) -> None:
    monkeypatch.setenv(SHARD_ENV, f"{shard}/3")
    assert {port // 2 % 3 for port in free_ports(24)} == {shard}
    assert {demo.free_port() // 2 % 3 for _ in range(24)} == {shard}


def test_a_malformed_shard_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARD_ENV, "2/2")
    with pytest.raises(ValueError, match="0 <= i < n"):
        free_port()
    with pytest.raises(ConfigError, match="0 <= i < n"):
        demo.free_port()
