"""A `GuardedHttpToolsProtocol` driven byte by byte through a recording transport (no sockets),
with an app that reads the whole body and answers 200: the rig of the client-limit tests."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http_guard import ClientGuard, ClientLimits, GuardedServerState
from gateway.http_limits import GuardedHttpToolsProtocol
from gateway.metrics import GatewayMetrics

LIMITS = ClientLimits(
    max_header_bytes=1024,
    max_headers=8,
    header_timeout_s=10.0,
    body_timeout_s=20.0,
    keepalive_timeout_s=30.0,
    max_connections=3,
)


class RecordingTransport(asyncio.Transport):
    """Keeps what the protocol writes; closing reports the loss to the protocol, as asyncio does,
    once nothing is `buffered` (bytes the client has not read yet: a close waits for them, an
    abort drops them). `eof`: the sending side was shut (`write_eof`), as a lingering close does
    first. `peer`: the client's address."""

    def __init__(self, protocol: asyncio.Protocol, peer: str = "127.0.0.1") -> None:
        super().__init__()
        self.protocol = protocol
        self.peer = peer
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.eof = False
        self.reading = True
        self.buffered = 0
        self._lost = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        assert not self.eof, "written after write_eof"  # asyncio and uvloop raise
        self.written += data

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.buffered:
                self._lose()

    def abort(self) -> None:
        self.aborted = self.closed = True
        self.buffered = 0
        self._lose()

    def read_by_client(self) -> None:
        """The client read all that was buffered; a closed transport is then lost."""
        self.buffered = 0
        if self.closed:
            self._lose()

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def _lose(self) -> None:
        if not self._lost:
            self._lost = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    @property
    def ended(self) -> bool:
        """Closed, or half-closed: nothing more will be written."""
        return self.closed or self.eof

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": (self.peer, 40000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def status(self) -> int | None:
        line = bytes(self.written).split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 else None

    def json_body(self) -> Any:
        return orjson.loads(bytes(self.written).split(b"\r\n\r\n", 1)[1])


@dataclass
class App:
    """Reads the whole body, then answers 200; notes whether it saw the client leave."""

    disconnected: list[bool] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.append(True)
                return
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@dataclass
class Rig:
    app: App
    guard: ClientGuard
    state: GuardedServerState
    config: uvicorn.Config
    metrics: GatewayMetrics

    def connect(self, peer: str = "127.0.0.1") -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
        """A connection from `peer` to the rig's app."""
        return self._open(self.config, peer)

    def serve(
        self, app: ASGIApp, peer: str = "127.0.0.1"
    ) -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
        """A connection from `peer` to another app, in the rig's table."""
        config = uvicorn.Config(
            app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
        )
        config.load()
        return self._open(config, peer)

    def _open(self, config: uvicorn.Config, peer: str) -> tuple[GuardedHttpToolsProtocol, RecordingTransport]:
        protocol = GuardedHttpToolsProtocol(config, self.state, {})
        transport = RecordingTransport(protocol, peer)
        protocol.connection_made(transport)
        return protocol, transport

    def with_limits(self, limits: ClientLimits) -> Rig:
        """The rig with a table of its own under `limits`."""
        guard = ClientGuard(limits, self.metrics.client_refusals)
        return dataclasses.replace(self, guard=guard, state=GuardedServerState(guard))

    def refusals(self, reason: str) -> float:
        return self.metrics.client_refusals.labels(reason).value


@pytest.fixture
def rig() -> Iterator[Rig]:
    app = App()
    metrics = GatewayMetrics()
    guard = ClientGuard(LIMITS, metrics.client_refusals)
    config = uvicorn.Config(
        app, http=GuardedHttpToolsProtocol, ws="none", lifespan="off", log_level="warning"
    )
    config.load()
    yield Rig(app, guard, GuardedServerState(guard), config, metrics)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


GET = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n"


def post_head(length: int) -> bytes:
    return f"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: {length}\r\n\r\n".encode()
