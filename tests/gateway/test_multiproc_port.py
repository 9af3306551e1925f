"""A `kvgate serve --processes` group holds its port for its whole life: a second group on the
same address is refused even at an instant when no process of the first listens (all of them
restarting). It used to be found only by binding without SO_REUSEPORT, which succeeds while
nothing listens, and then joined the first group's port."""

from __future__ import annotations

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
