"""A full connection table takes the place of a connection holding one without a request in the app
(`http_guard.Evictable`), over real sockets on loopback: a server of `GuardedHttpToolsProtocol` in
the test's own loop, clients from distinct loopback addresses (127.0.0.2 is the flooder's).

Before eviction, one address holding every place with connections that send nothing (or a head
byte by byte) locked every other client out until `header_timeout_s` closed them, and then
reconnected."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.http_guard import ClientGuard, ClientLimits, GuardedServerState
from gateway.http_limits import GuardedHttpToolsProtocol
from gateway.metrics import GatewayMetrics
from tests.support.wait import wait_until

LIMITS = ClientLimits(
    max_header_bytes=1024,
    max_headers=8,
    header_timeout_s=300.0,  # no deadline passes during a test: only eviction closes
    body_timeout_s=300.0,
    keepalive_timeout_s=300.0,
    max_connections=8,
    max_connections_per_address=100,  # on, so that `by_address` is kept too
)
FLOODER = "127.0.0.2"
WAIT_S = 10.0


def get(path: str = "/x") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: h\r\n\r\n".encode()


@dataclass
class HoldingApp:
    """Answers 200 at once, except `/hold` (answers once `release` is set), `/stream` (sends its
    head and a first piece, the rest once `release` is set) and a POST (reads its whole body
    first). `busy`: requests it holds now."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    busy: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.busy += 1
        try:
            while (await receive()).get("more_body", False):
                pass
            if scope["path"] == "/hold":
                await self.release.wait()
            head = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]}
            await send(head)
            if scope["path"] == "/stream":
                await send({"type": "http.response.body", "body": b"do", "more_body": True})
                await self.release.wait()
                await send({"type": "http.response.body", "body": b"ne"})
            else:
                await send({"type": "http.response.body", "body": b"done"})
        finally:
            self.busy -= 1


@dataclass
class Server:
    port: int
    app: HoldingApp
    guard: ClientGuard
    state: GuardedServerState
    metrics: GatewayMetrics

    def refusals(self, reason: str) -> float:
        return self.metrics.client_refusals.labels(reason).value

    def open_from(self, address: str) -> int:
        """Connections the server holds from `address`, as its own table counts them."""
        peers = [conn.client for conn in self.state.connections if isinstance(conn, GuardedHttpToolsProtocol)]
        return sum(1 for peer in peers if peer is not None and peer[0] == address)


@asynccontextmanager
async def serving(limits: ClientLimits = LIMITS) -> AsyncIterator[Server]:
    app = HoldingApp()
    metrics = GatewayMetrics()
    guard = ClientGuard(limits, metrics.client_refusals)
    state = GuardedServerState(guard)
    config = uvicorn.Config(
        app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
    )
    config.load()
    server = await asyncio.get_running_loop().create_server(
        lambda: GuardedHttpToolsProtocol(config, state, {}), "127.0.0.1", 0
    )
    try:
        yield Server(server.sockets[0].getsockname()[1], app, guard, state, metrics)
    finally:
        app.release.set()
        server.close()
        await server.wait_closed()


@dataclass
class Client:
    address: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> bytes:
        """One whole answer (its body is `content-length: 4`)."""
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT_S)
        return head + await asyncio.wait_for(self.reader.readexactly(4), WAIT_S)

    async def closed_by_server(self) -> bool:
        """The server closed the connection without sending anything (more)."""
        try:
            return await asyncio.wait_for(self.reader.read(1024), WAIT_S) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.writer.close()


@asynccontextmanager
async def clients() -> AsyncIterator[list[Client]]:
    """A list to open clients into (`connect`); every one is closed at the end."""
    opened: list[Client] = []
    try:
        yield opened
    finally:
        for client in opened:
            client.close()


async def connect(server: Server, opened: list[Client], address: str) -> Client:
    """A connection from `address`. The server accepts connections in the order they were opened."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, local_addr=(address, 0))
    opened.append(client := Client(address, reader, writer))
    return client


async def served(server: Server, opened: list[Client], address: str) -> bytes:
    client = await connect(server, opened, address)
    await client.send(get())
    return await client.answer()


async def test_a_flood_of_silent_and_slow_connections_from_one_address_displaces_its_own() -> None:
    async with serving() as server, clients() as opened:
        flood = [await connect(server, opened, FLOODER) for _ in range(3)]  # send nothing
        for _ in range(3):  # a head byte by byte: its first bytes, the rest never
            flood.append(await connect(server, opened, FLOODER))
            await flood[-1].send(b"GET /x HT")
        for _ in range(2):  # idle between requests (keep-alive)
            flood.append(await connect(server, opened, FLOODER))
            await flood[-1].send(get())
            assert (await flood[-1].answer()).startswith(b"HTTP/1.1 200")
        await wait_until(lambda: server.open_from(FLOODER) == LIMITS.max_connections)

        # Another client is served; the flooder's connection that held its place longest is closed.
        answer = await served(server, opened, "127.0.0.1")
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"done")
        assert await flood[0].closed_by_server()
        assert server.refusals("evicted") == 1 and server.refusals("connection_limit") == 0
        assert server.guard.evictable.held_by(FLOODER) == 7

        # The next one takes the flooder's next oldest, not the idle connection of 127.0.0.1 (one
        # against the flooder's seven), even though that one is older.
        assert (await served(server, opened, "127.0.0.3")).startswith(b"HTTP/1.1 200")
        assert await flood[1].closed_by_server()
        await wait_until(lambda: server.open_from(FLOODER) == 6)
        assert server.guard.by_address == {FLOODER: 6, "127.0.0.1": 1, "127.0.0.3": 1}
        assert server.guard.evictable.held_by(FLOODER) == 6
        server.guard.evictable.check_invariants()

        # A flooder reconnecting takes its own places only.
        for _ in range(4):
            await connect(server, opened, FLOODER)
        await wait_until(lambda: server.refusals("evicted") == 6)
        await wait_until(lambda: server.open_from(FLOODER) == 6)
        assert all([await c.closed_by_server() for c in flood[2:6]])
        assert server.open_from("127.0.0.1") == 1 and server.open_from("127.0.0.3") == 1
        server.guard.evictable.check_invariants()

        for client in opened:
            client.close()
        await wait_until(lambda: not server.state.connections, what="every connection closed")
        assert server.guard.by_address == {} and not server.guard.evictable
        server.guard.evictable.check_invariants()


@pytest.mark.parametrize("per_address", [0, 100])
async def test_a_connection_with_a_request_in_the_app_is_never_evicted(per_address: int) -> None:
    limits = dataclasses.replace(LIMITS, max_connections_per_address=per_address)
    async with serving(limits) as server, clients() as opened:
        busy = []
        for path in ["/hold"] * 3 + ["/stream"] * 3:  # the app waits, or is streaming its answer
            busy.append(await connect(server, opened, FLOODER))
            await busy[-1].send(get(path))
        for _ in range(2):  # the app waits on the body
            busy.append(await connect(server, opened, FLOODER))
            await busy[-1].send(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nbo")
        await wait_until(lambda: server.app.busy == 8, what="eight requests in the app")

        # Nothing can be taken: the new connection is closed at once, unanswered, as before.
        refused = await connect(server, opened, "127.0.0.1")
        assert await refused.closed_by_server()
        assert server.refusals("connection_limit") == 1 and server.refusals("evicted") == 0
        assert not server.guard.evictable

        server.app.release.set()
        for client in busy[6:]:
            await client.send(b"dy")
        answers = [await client.answer() for client in busy]
        assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"done") for a in answers)
        for client in busy[1:]:  # busy[0] stays idle longest
            await client.send(get())
            assert (await client.answer()).startswith(b"HTTP/1.1 200")
        await wait_until(lambda: server.guard.evictable.held_by(FLOODER) == 8, what="all answered, idle")

        # Answered, they are idle: now the one idle longest gives its place.
        assert (await served(server, opened, "127.0.0.1")).startswith(b"HTTP/1.1 200")
        assert await busy[0].closed_by_server() and server.refusals("evicted") == 1

        for client in opened:
            client.close()
        await wait_until(lambda: not server.state.connections, what="every connection closed")
        assert server.guard.by_address == {} and not server.guard.evictable
