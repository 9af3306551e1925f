"""Asking Redis Sentinel where the primary is (`SENTINEL get-master-addr-by-name NAME`).

The sentinels of a `redis+sentinel://` URL are asked in turn, each within `timeout_s` (connect,
TLS, AUTH and the question together), and the first to name an address wins; it is asked first
next time, and its connection is kept for the next question, as the Sentinel client guidelines
suggest. A sentinel that cannot be reached, does not monitor the name, refuses the credentials or
answers anything but an address is skipped, and the error names what each said.

The replies are read by a small RESP2 reader, not redis-py's: a sentinel (or whatever answers at
its address) gets at most `MAX_REPLY_BYTES` of line, `MAX_REPLY_BYTES` a string, `MAX_REPLY_ITEMS`
items and two levels of nesting, so one question costs bounded memory as well as bounded time.

`watch_switches` keeps one more connection, to the sentinel asked first, subscribed to
`+switch-master` (the event a sentinel publishes when it names a new primary, as the Sentinel client
guidelines suggest listening to): each announcement for the master is handed on at once. The
subscription is sent a PING every `WATCH_PING_S` and taken for lost after `WATCH_STALE_S` of
silence; a lost or refused one is made again, at the next sentinel, after the link's capped backoff
(reset only after a subscription that lived `WATCH_STALE_S`), which is lengthened at random so that
the gateways that lost one sentinel do not all subscribe again at the same moment. Its frames are
read by the same bounded reader. An announcement for the master that does not parse is counted
(`malformed_announcements`), logged at most once every `MALFORMED_LOG_GAP_S`, and skipped: the
subscription goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.config.sync import HostPort
from gateway.sync.link import reconnect_delay_s

MAX_REPLY_BYTES = 4096
MAX_REPLY_ITEMS = 16
SWITCH_CHANNEL = "+switch-master"
WATCH_PING_S = 2.0
WATCH_STALE_S = 5.0
MALFORMED_LOG_GAP_S = 60.0
_MAX_DEPTH = 2
_REFUSALS = (b"NOAUTH", b"WRONGPASS", b"ERR invalid password", b"ERR AUTH")

log = logging.getLogger("kvgate.sync")


class SentinelError(RedisError):
    """No sentinel named the primary; the message says what each one did instead."""


class SentinelRefused(SentinelError):
    """A sentinel refused this gateway's credentials (`sync.sentinel_auth`)."""


class SentinelNoPermission(SentinelError):
    """A sentinel took the credentials but its ACL user may not run a command (NOPERM)."""


@dataclass(frozen=True, slots=True)
class Switch:
    """A `+switch-master` announcement: `sentinel` now names `master` as the primary."""

    sentinel: HostPort
    master: HostPort


class _ErrorReply(bytes):
    """A RESP error line (`-ERR ...`), kept apart from a simple string."""


async def _read_reply(reader: asyncio.StreamReader, depth: int = 0) -> object:
    """One RESP2 reply, bounded (the reader's `limit` bounds a line; asyncio raises past it)."""
    line = await reader.readuntil(b"\r\n")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return bytes(body)
    if kind == b"-":
        return _ErrorReply(body)
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        if size > MAX_REPLY_BYTES:
            raise SentinelError(f"a reply string of {size} bytes (at most {MAX_REPLY_BYTES})")
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        count = int(body)
        if count < 0:
            return None
        if count > MAX_REPLY_ITEMS or depth >= _MAX_DEPTH:
            raise SentinelError("a reply of more items or levels than a sentinel's answer has")
        return [await _read_reply(reader, depth + 1) for _ in range(count)]
    raise SentinelError("not a RESP reply")


def _pack(args: Sequence[str]) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    return b"".join(parts)


def _master_address(reply: object, master: str) -> HostPort:
    """The (host, port) of a get-master-addr-by-name reply, checked."""
    if reply is None:
        raise SentinelError(f"does not monitor a master named {master!r}")
    if isinstance(reply, _ErrorReply):
        raise _refusal(reply, "+sentinel|get-master-addr-by-name")
    if not (isinstance(reply, list) and len(reply) == 2 and all(isinstance(x, bytes) for x in reply)):
        raise SentinelError("answered something other than an address")
    host, port = reply[0].decode("ascii", errors="replace"), reply[1]
    if not host or len(host) > 255 or not port.isdigit() or not 0 < int(port) < 65536:
        raise SentinelError("answered something other than an address")
    return HostPort(host, int(port))


def _refusal(reply: _ErrorReply, grant: str) -> SentinelError:
    """The error a sentinel's error reply to a command means: refused credentials, a missing
    permission (`grant` is the ACL rule the command needs), or anything else."""
    text = reply.decode(errors="replace")
    if reply.startswith(b"NOPERM"):
        return SentinelNoPermission(
            f"the sentinels' ACL user (sync.sentinel_auth) lacks a command permission: grant it "
            f"{grant} (the sentinel said {text})"
        )
    return (SentinelRefused if reply.startswith(_REFUSALS) else SentinelError)(text)


def _announced(frame: object, master: str) -> HostPort | None:
    """The new address a `+switch-master` message (`NAME old-ip old-port new-ip new-port`) gives
    `master`; None for any other frame (a PING's pong, another master's switch); SentinelError for
    a message about `master` that says no address."""
    if not (isinstance(frame, list) and len(frame) == 3 and frame[0] == b"message"):
        return None
    parts = frame[2].split() if isinstance(frame[2], bytes) else []
    if not parts or parts[0] != master.encode():
        return None
    if len(parts) != 5:
        raise SentinelError("an announcement of other than five fields")
    return _master_address(parts[3:], master)


class _Conversation:
    """An open connection to one sentinel."""

    def __init__(
        self, sentinel: HostPort, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.sentinel = sentinel
        self.reader = reader
        self.writer = writer

    async def call(self, *args: str) -> object:
        self.writer.write(_pack(args))
        await self.writer.drain()
        return await _read_reply(self.reader)

    def close(self) -> None:
        self.writer.close()


class Sentinels:
    """The sentinels of one primary, named `master` in their configuration; `master_address` asks
    them in turn where it is. Not for concurrent use: the link asks from one task at a time
    (`watch_switches` runs beside it on a connection of its own, and only reads the order)."""

    def __init__(
        self,
        sentinels: Sequence[HostPort],
        master: str,
        *,
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.master = master
        self.timeout_s = timeout_s
        self._order = list(sentinels)
        self._username = username
        self._password = password
        self._tls = tls
        self._open: _Conversation | None = None
        self.subscriptions = 0  # +switch-master subscriptions made
        self.subscription_losses = 0  # ... lost, refused or not made
        self.malformed_announcements = 0  # announcements for the master that said no address
        self._malformed_logged_s = -math.inf

    async def master_address(self) -> HostPort:
        """Where the sentinels say the primary is now; SentinelError (SentinelRefused when every
        failure was a refusal of the credentials, SentinelNoPermission when every one was a
        NOPERM) naming what each sentinel did otherwise."""
        failures: list[str] = []
        refused = denied = 0
        for sentinel in list(self._order):
            try:
                async with asyncio.timeout(self.timeout_s):
                    address = await self._ask(sentinel)
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as exc:  # unreachable, refused, silent, or an answer that is no address
                self.close()
                refused += isinstance(exc, SentinelRefused)
                denied += isinstance(exc, SentinelNoPermission)
                reason = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
                failures.append(f"{sentinel.host}:{sentinel.port}: {reason}")
                continue
            self._order.remove(sentinel)
            self._order.insert(0, sentinel)  # the one that answered is asked first next time
            return address
        error: type[SentinelError] = SentinelError
        if refused == len(failures):
            error = SentinelRefused
        elif denied == len(failures):
            error = SentinelNoPermission
        raise error(f"no sentinel named the master {self.master!r}: " + "; ".join(failures))

    def prefer(self, sentinel: HostPort) -> None:
        """Ask `sentinel` first next time (one that just announced a switch)."""
        if sentinel in self._order:
            self._order.remove(sentinel)
            self._order.insert(0, sentinel)

    async def watch_switches(self, on_switch: Callable[[Switch], None]) -> None:
        """Until cancelled, keep one connection subscribed to `+switch-master` on the sentinel
        asked first, and call `on_switch` with each announcement for this master."""
        attempt, made = 0, self.subscriptions
        failed: set[HostPort] = set()  # since the last subscription that lived
        while True:
            # The first sentinel the questions go to, but not one that just failed.
            sentinel = next(s for s in self._order if s not in failed)
            started = time.monotonic()
            try:
                await self._subscribed(sentinel, on_switch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # unreachable, refused, closed, silent
                self.subscription_losses += 1
                if self.subscriptions != made or self.subscription_losses == 1:  # once an outage
                    made = self.subscriptions
                    reason = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
                    log.info(
                        "sync: no +switch-master subscription on the sentinels; following them by asking",
                        extra={"broker": f"{sentinel.host}:{sentinel.port}", "reason": reason},
                    )
            if time.monotonic() - started >= WATCH_STALE_S:
                attempt = 0  # it lived: a loss, not a sentinel that refuses at once
                failed.clear()
            failed.add(sentinel)
            if len(failed) == len(self._order):
                failed.clear()  # each failed in turn: round again, after the longer wait
            await asyncio.sleep(reconnect_delay_s(attempt))
            attempt += 1

    async def _subscribed(self, sentinel: HostPort, on_switch: Callable[[Switch], None]) -> None:
        """One subscription's life: made within `timeout_s`, then read until lost."""
        async with asyncio.timeout(self.timeout_s):
            conversation = await self._connect(sentinel)
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await conversation.call("SUBSCRIBE", SWITCH_CHANNEL)
            if isinstance(reply, _ErrorReply):
                raise _refusal(reply, f"+subscribe &{SWITCH_CHANNEL}")
            if not (isinstance(reply, list) and reply[:2] == [b"subscribe", SWITCH_CHANNEL.encode()]):
                raise SentinelError("answered something other than the subscription")
            self.subscriptions += 1
            heard = time.monotonic()
            # One read at a time, left running across the pings: a frame is never cut in two.
            read = asyncio.ensure_future(_read_reply(conversation.reader))
            try:
                while True:
                    done, _ = await asyncio.wait({read}, timeout=WATCH_PING_S)
                    if not done:
                        if time.monotonic() - heard > WATCH_STALE_S:
                            raise SentinelError("the subscription answered no PING")
                        conversation.writer.write(_pack(("PING",)))
                        continue
                    frame, heard = read.result(), time.monotonic()
                    read = asyncio.ensure_future(_read_reply(conversation.reader))
                    try:
                        address = _announced(frame, self.master)
                    except SentinelError as exc:
                        self._malformed(sentinel, exc)
                        continue
                    if address is not None:
                        on_switch(Switch(sentinel, address))
            finally:
                read.cancel()
        finally:
            conversation.close()

    def _malformed(self, sentinel: HostPort, exc: SentinelError) -> None:
        """Count an announcement that says no address, and say so at most once a while: one
        sentinel's bad message must not end the subscription that hears the others' good ones."""
        self.malformed_announcements += 1
        now_s = time.monotonic()
        if now_s - self._malformed_logged_s >= MALFORMED_LOG_GAP_S:
            self._malformed_logged_s = now_s
            log.warning(
                "sync: a +switch-master announcement that names no address; skipped",
                extra={
                    "broker": f"{sentinel.host}:{sentinel.port}",
                    "reason": str(exc),
                    "count": self.malformed_announcements,
                },
            )

    async def _ask(self, sentinel: HostPort) -> HostPort:
        if self._open is None or self._open.sentinel != sentinel:
            self.close()
            self._open = await self._connect(sentinel)
        return _master_address(
            await self._open.call("SENTINEL", "get-master-addr-by-name", self.master), self.master
        )

    async def _connect(self, sentinel: HostPort) -> _Conversation:
        reader, writer = await asyncio.open_connection(
            sentinel.host,
            sentinel.port,
            ssl=self._tls,
            server_hostname=sentinel.host if self._tls is not None else None,
            limit=MAX_REPLY_BYTES,
        )
        conversation = _Conversation(sentinel, reader, writer)
        if self._password is not None:
            args = ("AUTH", self._username, self._password) if self._username else ("AUTH", self._password)
            reply = await conversation.call(*(a for a in args if a is not None))
            if reply != b"OK":
                conversation.close()
                raise SentinelRefused("refused this gateway's credentials (sync.sentinel_auth)")
        return conversation

    def close(self) -> None:
        """Drop the kept connection, if any (the next question opens another)."""
        conversation, self._open = self._open, None
        if conversation is not None:
            with contextlib.suppress(Exception):
                conversation.close()
