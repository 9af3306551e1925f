"""Free loopback ports for the processes a benchmark or a load test starts.

The kernel picks each port (bind to port 0). Picking them one at a time, each socket closed
before the next bind, may give the same port twice: a stack that names nine ports in one config
then lists a worker twice. So a batch is bound all at once, and a port this process has handed
out before is not handed out again. Another process may still take a port between its pick and
its use; the caller's start-up wait reports that.

Runs side by side on one host (the test suite's parallel workers) each set `KVGATE_PORT_SHARD` to
`i/n`: a process then hands out only ports whose half (port // 2) is congruent to i modulo n, so
two runs never pick the same port between picking and binding it. Halves, because Linux hands
`bind` to port 0 ports of one parity (it keeps the other for `connect`). The variable is inherited
by the processes a run starts, and the gateway's demo picks its workers' ports the same way
(`gateway.demo.free_port`: the import contracts keep gateway and loadtest apart, so each has
its picker; `tests/loadtest/test_ports.py` holds both to the rule).
"""

from __future__ import annotations

import contextlib
import os
import socket

_HANDED_OUT: set[int] = set()
_MAX_TRIES = 64
SHARD_ENV = "KVGATE_PORT_SHARD"


def port_shard() -> tuple[int, int]:
    """(i, n) from `KVGATE_PORT_SHARD=i/n`; (0, 1), every port, when it is not set."""
    value = os.environ.get(SHARD_ENV, "")
    if not value:
        return 0, 1
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise ValueError(f"{SHARD_ENV} must be i/n with 0 <= i < n, not {value!r}")
    return int(index), int(count)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that nothing listens on now and this process has not handed out
    (only those of this process's shard)."""
    index, shards = port_shard()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count * shards * _MAX_TRIES):
            if len(ports) == count:
                break
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            if port // 2 % shards == index and port not in _HANDED_OUT:
                ports.append(port)
        if len(ports) < count:
            raise OSError(f"could not find {count} free ports on {host}")
    _HANDED_OUT.update(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as `free_ports` picks them."""
    return free_ports(1, host)[0]
