"""The port of `kvgate serve --processes N`, held by its supervisor for the group's lifetime.

The supervisor binds the port with SO_REUSEPORT and never listens on that socket: port 0 becomes
one port for every child, and the port stays the group's while a child restarts. SO_REUSEPORT
would just as well let a second group (another `kvgate serve --processes` on the same port, same
user) bind it too, each group then getting a share of the other's connections. Two checks keep a
group alone on its port:
- a socket already listening there (another program, another group's processes) is found by
  binding without SO_REUSEPORT first (`gateway.server.bind`'s message);
- another group whose processes are all restarting at that instant listens nowhere, so each
  supervisor also holds, for its lifetime, a name in Linux's abstract socket namespace made of
  the port (`_lock_name`): a second supervisor cannot bind the same name. The name lives in
  the network namespace, as the port does; the kernel releases it when the supervisor exits,
  however it exits, so there is no stale lock to clean up. Elsewhere than Linux only the first
  check runs.

The lock is per port, whatever the address: addresses overlap (0.0.0.0 and 127.0.0.1, :: and
0.0.0.0), so two groups on one port are refused even on addresses that would not overlap.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

from gateway.config.base import ConfigError


@dataclass(slots=True)
class HeldPort:
    """The group's never-listening socket on its port, and its lock on the port (Linux)."""

    sock: socket.socket
    lock: socket.socket | None

    @property
    def port(self) -> int:
        port: int = self.sock.getsockname()[1]
        return port

    def close(self) -> None:
        self.sock.close()
        if self.lock is not None:
            self.lock.close()


def _lock_name(port: int) -> bytes:
    return b"\0kvgate-serve-processes " + str(port).encode()


def _lock(host: str, port: int) -> socket.socket | None:
    """The port's lock (any address), held while the returned socket is open; a `ConfigError` when another
    group holds it. None off Linux (no abstract namespace)."""
    if not sys.platform.startswith("linux"):
        return None
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(_lock_name(port))
    except OSError as exc:
        lock.close()
        raise ConfigError(
            f"listen: cannot listen on {host}:{port}: {exc.strerror} (another "
            f"`kvgate serve --processes` group holds port {port}, on this or an overlapping "
            "address, its processes restarting)"
        ) from None
    return lock


def hold_port(host: str, port: int) -> HeldPort:
    """The group's port on (host, port) (module docstring); a `ConfigError` with the single
    process's message when it is taken."""
    from gateway.server import bind  # the single process's bind, and its message

    host = host.strip("[]")
    if port:
        bind(host, port, "listen").close()
    sock = bind(host, port, "listen", reuse_port=True)
    try:
        address, bound = sock.getsockname()[:2]
        lock = _lock(address if ":" not in address else f"[{address}]", bound)
    except BaseException:
        sock.close()
        raise
    return HeldPort(sock, lock)
