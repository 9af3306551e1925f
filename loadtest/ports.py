"""Free loopback ports for the processes a benchmark or a load test starts.

The kernel picks each port (bind to port 0). Picking them one at a time, each socket closed
before the next bind, may give the same port twice: a stack that names nine ports in one config
then lists a worker twice. So a batch is bound all at once, and a port this process has handed
out before is not handed out again. Another process may still take a port between its pick and
its use; the caller's start-up wait reports that.
"""

from __future__ import annotations

import contextlib
import socket

_HANDED_OUT: set[int] = set()
_MAX_TRIES = 64


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that nothing listens on now and this process has not handed out."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count * _MAX_TRIES):
            if len(ports) == count:
                break
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            if port not in _HANDED_OUT:
                ports.append(port)
        if len(ports) < count:
            raise OSError(f"could not find {count} free ports on {host}")
    _HANDED_OUT.update(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as `free_ports` picks them."""
    return free_ports(1, host)[0]
