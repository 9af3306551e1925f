"""Hostile clients that work on connections rather than on single requests: bursts of pipelined
requests written before any key is checked, and one address opening connections past its limit.

Both go over raw sockets to 127.0.0.1, each from a loopback address of its own (on Linux the
whole of 127.0.0.0/8 is local): the address limit needs a client address other than the
well-behaved client's, and what the gateway still holds of a probe's connections at the end is
counted by that address.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from loadtest.abuse.client import CHAT, chat_body, post, text
from loadtest.abuse.observe import RssPeak, held_connections, metrics, series, wait_for
from loadtest.abuse.probe import Context, Observation, Probe
from loadtest.abuse.probes_clients import RSS_BOUND
from loadtest.abuse.report import counts, mib
from loadtest.abuse.settings import Sizes
from loadtest.abuse.stack import ADDRESS_LIMIT, KEY_B

# 34 bytes, no key: 7,710 of them in one 256 KiB write.
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: k\r\n\r\n"
BURST_BYTES = 256 * 1024
# The request being answered and the 16 waiting behind it (`MAX_PIPELINED` in the gateway's
# `http_limits`); a request past them is not read.
MAX_ANSWERS = 17
KEPT_BYTES = 64 * 1024  # of each connection's answers: enough to count far past MAX_ANSWERS
CLOSE_WAIT_S = 20.0
PROMPT_S = 2.0  # a well-behaved client's slowest answer while the hostile ones are at work
AT_ONCE_S = 1.0  # a connection past the address limit is closed when accepted, not at a deadline
HOSTILE_ADDRESS = "127.0.0.2"  # opens connections past its limit
BURST_ADDRESS = "127.0.0.3"
_TIMEOUT = aiohttp.ClientTimeout(total=20)


@dataclass(frozen=True, slots=True)
class Answers:
    """The whole HTTP/1.1 answers found in the bytes a connection received, in order."""

    statuses: tuple[int, ...]
    last_closes: bool  # the last one says `connection: close`
    trailing_bytes: int  # after the last whole answer


def _head(head: bytes) -> tuple[int, dict[bytes, bytes]] | None:
    """An answer head's status and its fields (names and values lowercased); None if it is not one."""
    status_line, *lines = head.split(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    fields = {}
    for line in lines:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    return int(parts[1]), fields


def parse_answers(data: bytes) -> Answers:
    """Split what a connection received into answers (heads with a `content-length` body)."""
    statuses: list[int] = []
    last_closes = False
    rest = data
    while rest:
        head, sep, after = rest.partition(b"\r\n\r\n")
        parsed = _head(head) if sep else None
        if parsed is None:
            break
        status, fields = parsed
        length = int(fields.get(b"content-length", b"0"))
        if len(after) < length:
            break
        statuses.append(status)
        last_closes = fields.get(b"connection") == b"close"
        rest = after[length:]
    return Answers(tuple(statuses), last_closes, len(rest))


class _Burst(asyncio.Protocol):
    """One connection that writes its whole burst as soon as it is open and sends nothing more;
    `closed` is set when the connection ends. Its answers are taken off the socket as they come:
    17 small answers (a few KB in all) fit in the socket buffers, so whether the client reads them
    makes no difference to the gateway.

    Most of the burst is still unread when the gateway has answered the 17 requests it took. Had
    it closed then, its kernel would reset the connection and drop what it had not sent yet (RFC
    9112, 9.6, the "TCP reset problem"); it half-closes instead and drops the rest of the burst
    (a lingering close), so the probe holds it to all 17 answers on every connection, ended by a
    FIN, never a reset."""

    def __init__(self, burst: bytes) -> None:
        self.burst = burst
        self.received = bytearray()  # the first KEPT_BYTES
        self.cut = False  # more came
        self.opened_s = time.monotonic()
        self.closed_after_s: float | None = None  # by the server
        self.closed = asyncio.Event()
        self.transport: asyncio.Transport | None = None
        self.ended_by_client = False
        self.reset = False  # the server's close came as a reset

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.burst)

    def data_received(self, data: bytes) -> None:
        room = max(0, KEPT_BYTES - len(self.received))
        self.received += data[:room]
        self.cut |= len(data) > room

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended_by_client:
            self.closed_after_s = time.monotonic() - self.opened_s
            self.reset = exc is not None
        self.closed.set()

    def end(self) -> None:
        """Close the connection if the server has not (the probe's time is up)."""
        if self.transport is not None and not self.closed.is_set():
            self.ended_by_client = True
            self.transport.abort()


async def _refusals(ctx: Context, reason: str) -> float:
    return series(await metrics(ctx.session, ctx.stack), "kvgate_client_refusals_total", reason=reason)


@dataclass(frozen=True, slots=True)
class _Left:
    """What the gateway still held of one address's connections once they were all closed."""

    held: int
    after_s: float

    def text(self) -> str:
        if self.held:
            return f"the gateway still held {self.held} of them {self.after_s:.1f} s after"
        return f"the gateway held none of them {self.after_s:.1f} s after"


async def _all_closed(ctx: Context, client: str) -> _Left:
    """Wait until the gateway holds no connection from `client` (at most `CLOSE_WAIT_S`)."""

    async def down() -> bool:
        return held_connections(ctx.stack.port, client) == 0

    _, after_s = await wait_for(down, CLOSE_WAIT_S, 0.1)
    return _Left(held_connections(ctx.stack.port, client), after_s)


@dataclass
class _WellBehaved:
    """Tenant B's client, asking for `/healthz` and a short chat in turn until told to stop
    (at least once each): the statuses it got and its slowest answer."""

    ctx: Context
    stop: asyncio.Event
    statuses: list[int]
    slowest_s: float = 0.0

    async def run(self) -> None:
        i = 0
        while i < 2 or not self.stop.is_set():
            started = time.monotonic()
            if i % 2 == 0:
                status = await self._healthz()
            else:
                body = chat_body(text(f"{self.ctx.run_id}/conn/{i}", 200), 4)
                status = (await post(self.ctx.session, self.ctx.url(CHAT), KEY_B, body, timeout_s=20)).status
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
            self.statuses.append(status)
            i += 1

    async def _healthz(self) -> int:
        try:
            async with self.ctx.session.get(self.ctx.url("/healthz"), timeout=_TIMEOUT) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    @property
    def served(self) -> bool:
        return all(s == 200 for s in self.statuses) and self.slowest_s <= PROMPT_S

    def text(self) -> str:
        return f"B: {counts(self.statuses)}, slowest {self.slowest_s * 1000:.0f} ms"


async def _beside(ctx: Context, attack: Callable[[], Awaitable[None]]) -> _WellBehaved:
    """Run `attack` with tenant B's client asking beside it."""
    client = _WellBehaved(ctx, asyncio.Event(), [])
    asking = asyncio.create_task(client.run())
    try:
        await attack()
    finally:
        client.stop.set()
        await asking
    return client


async def _pipelined(ctx: Context) -> Observation:
    n = ctx.sizes.pipeline_connections
    burst = HEALTHZ * (BURST_BYTES // len(HEALTHZ))
    before = await _refusals(ctx, "pipelined_requests")
    loop = asyncio.get_running_loop()
    conns: list[_Burst] = []

    async def attack() -> None:
        async def one() -> None:
            conn = _Burst(burst)
            conns.append(conn)
            await loop.create_connection(
                lambda: conn, "127.0.0.1", ctx.stack.port, local_addr=(BURST_ADDRESS, 0)
            )

        await asyncio.gather(*(one() for _ in range(n)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in conns)), CLOSE_WAIT_S)

    try:
        async with RssPeak(ctx.stack.gateway_pid, interval_s=0.02) as rss:
            client = await _beside(ctx, attack)
    finally:
        for conn in conns:
            conn.end()
    closed = [c.closed_after_s for c in conns if c.closed_after_s is not None]
    slowest = max(closed, default=float("inf"))
    answers = [parse_answers(bytes(c.received)) for c in conns]
    statuses = [s for a in answers for s in a.statuses]
    whole = sum(
        a.statuses == (200,) * MAX_ANSWERS and a.last_closes and not a.trailing_bytes for a in answers
    )
    resets = sum(c.reset for c in conns)
    refused = await _refusals(ctx, "pipelined_requests") - before
    left = await _all_closed(ctx, BURST_ADDRESS)
    ok = (
        rss.growth < RSS_BOUND
        and client.served
        and len(closed) == n
        and whole == n
        and resets == 0
        and refused == n
        and left.held == 0
    )
    return Observation(
        f"RSS +{mib(rss.growth)} (from {mib(rss.start)}); {len(closed)}/{n} closed by the server "
        f"({resets} by a reset), slowest {slowest:.2f} s; answers per connection "
        f"{counts([len(a.statuses) for a in answers])}"
        f"{f' in their first {KEPT_BYTES // 1024} KiB' if any(c.cut for c in conns) else ''} "
        f"(status {counts(statuses)}), all {MAX_ANSWERS} with the last connection: close on {whole}; "
        f"pipelined_requests +{refused:.0f}; {client.text()}; {left.text()}",
        ok,
    )


async def _get_healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int | None:
    """One keep-alive `GET /healthz` on an open connection: its status, None if it was closed."""
    try:
        writer.write(HEALTHZ)
        await writer.drain()
        parsed = _head(await reader.readuntil(b"\r\n\r\n"))
        if parsed is None:
            return None
        status, fields = parsed
        await reader.readexactly(int(fields.get(b"content-length", b"0")))
    except (ConnectionError, asyncio.IncompleteReadError):
        return None
    return status


async def _open(ctx: Context) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", ctx.stack.port, local_addr=(HOSTILE_ADDRESS, 0))


async def _closed_at_once(ctx: Context) -> float | None:
    """Open a connection, send nothing: how long until the server closed it (None: not within the
    header timeout, when a silent connection is closed anyway)."""
    reader, writer = await _open(ctx)
    started = time.monotonic()
    try:
        async with asyncio.timeout(ctx.sizes.header_timeout_s):
            with contextlib.suppress(ConnectionError):
                while await reader.read(1024):
                    pass
    except TimeoutError:
        return None
    finally:
        writer.close()
    return time.monotonic() - started


async def _address_limit(ctx: Context) -> Observation:
    extra = ctx.sizes.address_extra_connections
    before = await _refusals(ctx, "address_limit")
    held: list[asyncio.StreamWriter] = []
    held_statuses: list[int | None] = []
    refused_after: list[float | None] = []

    async def attack() -> None:
        async def hold() -> None:
            reader, writer = await _open(ctx)
            held.append(writer)
            held_statuses.append(await _get_healthz(reader, writer))  # then it idles, held

        await asyncio.gather(*(hold() for _ in range(ADDRESS_LIMIT)))
        refused_after.extend(await asyncio.gather(*(_closed_at_once(ctx) for _ in range(extra))))

    try:
        client = await _beside(ctx, attack)
    finally:
        for writer in held:
            writer.close()
    refused = await _refusals(ctx, "address_limit") - before

    async def served_again() -> bool:  # once its connections are gone, the address is served
        reader, writer = await _open(ctx)
        try:
            return await _get_healthz(reader, writer) == 200
        finally:
            writer.close()

    again, again_s = await wait_for(served_again, 10, 0.1)
    left = await _all_closed(ctx, HOSTILE_ADDRESS)
    closed = [s for s in refused_after if s is not None]
    slowest = max(closed, default=float("inf"))
    ok = (
        held_statuses.count(200) == ADDRESS_LIMIT
        and len(closed) == extra
        and slowest <= AT_ONCE_S
        and refused == extra
        and client.served
        and again
        and left.held == 0
    )
    return Observation(
        f"{HOSTILE_ADDRESS}: {ADDRESS_LIMIT} held (status {counts(held_statuses)}); {len(closed)}/"
        f"{extra} more closed unanswered, slowest {slowest * 1000:.0f} ms; address_limit "
        f"+{refused:.0f}; {client.text()}; the address served again "
        f"{'after ' + format(again_s, '.1f') + ' s' if again else 'never'} once they closed; "
        f"{left.text()}",
        ok,
    )


def _expected_pipelined(s: Sizes) -> str:
    return (
        f"{s.pipeline_connections} conns × {BURST_BYTES // len(HEALTHZ)} pipelined GET /healthz "
        f"in one write: RSS grows < {mib(RSS_BOUND)}, exactly {MAX_ANSWERS} answers each (200, the "
        f"last with connection: close), each closed with no reset, pipelined_requests counted; "
        f"B served (< {PROMPT_S:.0f} s)"
    )


def _expected_address(s: Sizes) -> str:
    return (
        f"one address holds {ADDRESS_LIMIT} conns (its limit), opens {s.address_extra_connections} "
        f"more: each closed unanswered (< {AT_ONCE_S:.0f} s), counted address_limit; B served "
        f"(< {PROMPT_S:.0f} s); the address served again after"
    )


PROBES = (
    Probe("pipelined", _expected_pipelined, _pipelined, lambda s: CLOSE_WAIT_S + 40),
    Probe("address_limit", _expected_address, _address_limit, lambda s: s.header_timeout_s + 60),
)
