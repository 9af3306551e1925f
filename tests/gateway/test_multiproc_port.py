"""A `kvgate serve --processes` group holds its port for its whole life: a second group on the
same port (any address) is refused even at an instant when no process of the first listens
(all of them restarting). It used to be found only by binding without SO_REUSEPORT, which succeeds while
nothing listens, and then joined the first group's port."""

from __future__ import annotations

import socket
import sys

import pytest

from gateway.config.base import ConfigError
from gateway.multiproc_port import hold_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract sockets")


def test_a_second_group_is_refused_while_the_first_has_no_listener() -> None:
    first = hold_port("127.0.0.1", 0)  # its processes all restarting: nothing listens on the port
    port = first.port
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            hold_port("127.0.0.1", port).close()
    finally:
        first.close()
    hold_port("127.0.0.1", port).close()  # the first group gone, the port is free again


def test_groups_on_different_ports_do_not_hold_each_other() -> None:
    first = hold_port("127.0.0.1", 0)
    try:
        hold_port("127.0.0.1", 0).close()
    finally:
        first.close()


@pytest.mark.parametrize(("first_host", "second_host"), [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")])
def test_a_second_group_on_an_overlapping_address_is_refused(first_host: str, second_host: str) -> None:
    # The lock used to be named by address and port: 0.0.0.0:P and 127.0.0.1:P got different
    # locks, and the second group joined the port while the first's processes restarted.
    first = hold_port(first_host, 0)
    port = first.port
    try:
        refused = f"cannot listen on {second_host}:{port}: Address already in use"
        with pytest.raises(ConfigError, match=refused):
            hold_port(second_host, port).close()
    finally:
        first.close()


def test_a_second_group_on_the_ipv6_wildcard_is_refused() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    first = hold_port("0.0.0.0", 0)
    port = first.port
    try:
        with pytest.raises(ConfigError, match="Address already in use"):
            hold_port("::", port).close()
    finally:
        first.close()
