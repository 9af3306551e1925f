"""Scripted raw-socket workers on 127.0.0.1 for the lean upstream client's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.upstream import request_bytes

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": 1}\r\n'


@dataclass
class Server:
    port: int
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def post(body: bytes = b"{}") -> bytes:
    return request_bytes(b"127.0.0.1", b"/v1/chat/completions", b"X-Request-Id: r1\r\n", body)


ANSWER_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def whole_answer(size: int) -> Handler:
    """A worker that answers every request with `size` bytes at once, then waits for the reader
    to hang up."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % size + b"x" * size)
        await writer.drain()
        await reader.read()

    return handler


def held_answer(go: asyncio.Event, size: int = 2001) -> Handler:
    """A worker whose JSON answer of `size` bytes arrives but for its last byte, held until `go`:
    while held, the answer's bytes so far are reserved in the reader's answer budget."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(ANSWER_HEAD % size + b"x" * (size - 1))
        await writer.drain()
        await go.wait()
        writer.write(b"y")
        await writer.drain()
        await reader.read()

    return handler
