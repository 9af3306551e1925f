"""The transport over Redis or Valkey: core pub/sub on one channel, kept up in the background.

`run` opens two connections with redis-py's asyncio `Connection`, one subscribed to the channel
(a subscribed connection takes no other command) and one that publishes, and watches both; when
either fails, goes silent or cannot be made, both are closed and it tries again with a capped
backoff, forever. `publish` never waits: it appends the batch to an outgoing buffer of at most
`pending_bytes`, which a writer task sends as pipelined PUBLISH commands, and reports False when
the link is down or the batch does not fit (a server that stopped reading fills it). The buffer is
kept across a reconnect, as nats-py keeps its own. Received batches wait to be applied, at most
`received_msgs` of them and `received_bytes`; beyond either they are dropped, counted as
`slow_consumer`. The reader reads the subscribed connection as fast as the event loop lets it, so
Redis's own bound on a subscriber's output (`client-output-buffer-limit pubsub`: by default it
disconnects one 32 MB behind, or 8 MB behind for a minute) is met only by a message larger than
that or a gateway whose event loop stopped; the link then reconnects like after any failure.

Redis sends a client its own messages back (NATS's `no_echo` has no counterpart here). The link
remembers the hash of each batch it sent (the last `ECHO_MEMORY`) and drops a received batch with
one of them unread, so a gateway does not decode its own batches; the hash is Python's keyed one,
so a third party cannot make a peer's batch look like an echo.

A partitioned or stopped server keeps its sockets open: every `PING_INTERVAL_S` each connection
is sent a PING, and one that has answered nothing for `STALE_AFTER_S` while a reply was due is
taken for dead, as nats-py's pings do. Nothing a request does waits on this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from gateway.config.sync import HostPort, SyncTlsConfig
from gateway.sync.link import RECEIVED_BYTES, RECEIVED_MSGS, raise_if_cancelled, reconnect_delay_s

log = logging.getLogger("kvgate.sync")

PING_INTERVAL_S = 2.0
STALE_AFTER_S = 5.0
# The largest batch the link sends: NATS's default payload, so that a batch is cut alike on
# either broker (Redis would take 512 MB, and hold as much for each subscriber).
MAX_PAYLOAD = 1 << 20
ECHO_MEMORY = 4096
_READ_YIELD_EVERY = 64  # received batches read before the reader lets other tasks run


def missing_permission(exc: NoPermissionError, subject: str) -> str:
    """What a NOPERM reply means for the link: the credentials were taken, but the ACL user
    (`sync.auth.user`) may not run a command the link needs (the server's text names it, as
    `'role' command`) or use its channel; the ACL rule to grant, and the server's words."""
    said = str(exc)
    found = re.search(r"'([A-Za-z|_-]{1,64})' command", said)
    if found:
        grant = "+" + found.group(1).lower()
    elif "channel" in said:
        grant = f"&{subject}"
    else:
        grant = "the permissions sync.md lists"
    return (
        f"sync broker's ACL user (sync.auth.user) lacks a permission the link needs: grant it "
        f"{grant} (the server said NOPERM {said})"
    )


class _Stale(Exception):
    """A connection answered nothing for STALE_AFTER_S while a reply was due."""


class RedisLink:
    """A self-healing publish/subscribe link on one Redis channel (`subject`), to the server `url`
    names. A subclass finds the server elsewhere (`_address`), checks the node it reached
    (`_check_node`, `_check_reply` of each `_probe`), watches for a move (`_watchers`) and waits
    between attempts its own way (`_pause`): `sentinel_link.SentinelLink`."""

    # Sent on the publishing connection every PING_INTERVAL_S; its reply goes to `_check_reply`.
    _probe: tuple[str, ...] = ("PING",)

    def __init__(
        self,
        url: str,
        subject: str,
        name: str,
        on_message: Callable[[bytes], Awaitable[None]],
        *,
        connect_timeout_s: float = 2.0,
        pending_bytes: int = 4 * 1024 * 1024,
        username: str | None = None,
        password: str | None = None,
        tls: SyncTlsConfig | None = None,
        received_msgs: int = RECEIVED_MSGS,
        received_bytes: int = RECEIVED_BYTES,
    ) -> None:
        self.urls = [url]
        self.subject = subject
        self.name = name
        self.on_message = on_message
        self.connect_timeout_s = connect_timeout_s
        self.pending_bytes = pending_bytes
        self.received_msgs = received_msgs
        self.received_bytes = received_bytes
        # AUTH [username] password (gateway.sync.auth read them); TLS for rediss:// or with `tls`.
        self._username = username
        self._password = password
        tls_scheme = urlsplit(url).scheme in ("rediss", "rediss+sentinel", "rediss+cluster")
        self._tls = tls if tls is not None or not tls_scheme else SyncTlsConfig()
        self.connects = 0
        self.errors = 0
        self.slow_consumer = 0
        self.echoes = 0  # own batches back from the server, dropped unread
        self._connected = False
        self._warned = False  # one warning per outage, not one per reconnect attempt
        self._closing = False
        self._conns: list[Connection] = []
        self._outgoing: deque[bytes] = deque()
        self._outgoing_bytes = 0
        self._write_wake = asyncio.Event()
        self._ping_due = False
        self._replies_due = 0
        self._waiting_since_s = 0.0  # the last reply, or the first one due after none was
        self._sub_heard_s = 0.0
        self._echoes: set[int] = set()
        self._echo_order: deque[int] = deque()
        self._received: deque[bytes] = deque()
        self._received_size = 0
        self._receive_wake = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def max_payload(self) -> int:
        """The largest batch `publish` takes: 1 MiB, or less when the outgoing buffer is smaller."""
        return min(MAX_PAYLOAD, self.pending_bytes)

    async def publish(self, data: bytes) -> bool:
        """Queue one batch for the writer; False (and nothing waits) when the link is down or the
        outgoing buffer cannot take it."""
        if not self._connected or self._outgoing_bytes + len(data) > self.pending_bytes:
            return False
        self._outgoing.append(data)
        self._outgoing_bytes += len(data)
        self._write_wake.set()
        return True

    async def run(self) -> None:
        """Keep a connection up until cancelled."""
        deliver = asyncio.create_task(self._deliver(), name="sync-redis-deliver")
        attempt = 0
        try:
            while not self._closing:
                try:
                    await self._session()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # refused, unreachable, closed, stale
                    self._error(exc)
                finally:
                    if self._connected:
                        attempt = 0
                    await self._drop()
                raise_if_cancelled()
                await self._pause(reconnect_delay_s(attempt))
                attempt += 1
        finally:
            deliver.cancel()
            await asyncio.gather(deliver, return_exceptions=True)

    async def _pause(self, delay_s: float) -> None:
        """The wait before the next connection attempt."""
        await asyncio.sleep(delay_s)

    async def _address(self) -> HostPort:
        """The server to connect to next."""
        parts = urlsplit(self.urls[0])
        return HostPort(parts.hostname or "localhost", parts.port or 6379)

    async def _check_node(self, pub: Connection) -> None:
        """Raise when the node `pub` reached is not one to publish on (here: any node is)."""

    def _check_reply(self, reply: object) -> None:
        """Raise when a reply on the publishing connection says the node is no longer the one."""

    def _watchers(self) -> list[Coroutine[Any, Any, None]]:
        """What else runs for the session; one that ends or raises ends it."""
        return []

    def _connection(self, address: HostPort) -> Connection:
        host, port = address
        tls = self._tls
        make = (
            Connection
            if tls is None
            else functools.partial(
                SSLConnection,
                ssl_ca_certs=tls.ca_file,  # None: the system's CAs
                ssl_certfile=tls.cert_file,
                ssl_keyfile=tls.key_file,
                ssl_cert_reqs="required",
                ssl_check_hostname=True,
            )
        )
        return make(
            host=host,
            port=port,
            username=self._username,
            password=self._password,
            socket_connect_timeout=self.connect_timeout_s,
            # No socket timeout: redis-py would wrap each write in wait_for, which on 3.11 can
            # swallow a cancellation; the pings find a stalled server, and connects are bounded.
            socket_timeout=None,
            client_name=self.name,
            protocol=2,  # RESP2: any Redis or Valkey since 6 (ACL users), no HELLO
            driver_info=None,  # no CLIENT SETINFO (servers before 7.2 do not know it)
        )

    async def _session(self) -> None:
        """Connect, subscribe, then serve until a connection fails or goes stale."""
        address = await self._address()
        sub, pub = self._connection(address), self._connection(address)
        self._conns += [sub, pub]
        # Connect, authenticate and subscribe, within the connect timeout (twice: two connections).
        async with asyncio.timeout(2 * self.connect_timeout_s):
            await sub.connect()  # type: ignore[no-untyped-call]
            await sub.send_command("SUBSCRIBE", self.subject, check_health=False)
            reply = await sub.read_response(timeout=math.inf)
            if not (isinstance(reply, list) and reply and reply[0] == b"subscribe"):
                raise RedisError("unexpected reply to SUBSCRIBE")
            await pub.connect()  # type: ignore[no-untyped-call]
            await self._check_node(pub)
        now = time.monotonic()
        self._sub_heard_s = self._waiting_since_s = now
        self._replies_due = 0
        self._echoes.clear()  # what was sent before this subscription never comes back
        self._echo_order.clear()
        self._connected = True
        if self._outgoing:
            self._write_wake.set()  # what waited in the buffer across the reconnect goes first
        self.connects += 1
        self._warned = False
        log.info(
            "sync broker connected",
            extra={"subject": self.subject, "broker": f"{address.host}:{address.port}"},
        )
        tasks = [
            asyncio.create_task(self._read_subscribed(sub), name="sync-redis-read"),
            asyncio.create_task(self._read_replies(pub), name="sync-redis-replies"),
            asyncio.create_task(self._write(pub), name="sync-redis-write"),
            asyncio.create_task(self._watch(sub), name="sync-redis-watch"),
            *(asyncio.create_task(w, name="sync-redis-follow") for w in self._watchers()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            # Bounded: the connections are closed next whatever a task still does.
            await asyncio.wait(tasks, timeout=1.0)
        if not self._closing:
            log.warning("sync broker disconnected; routing on local knowledge")
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure  # what ended the session
        raise RedisError("a sync connection task ended")

    async def _read_subscribed(self, sub: Connection) -> None:
        read = 0
        while True:
            frame = await sub.read_response(timeout=math.inf, disable_decoding=True)
            self._sub_heard_s = time.monotonic()
            if isinstance(frame, list) and len(frame) == 3 and frame[0] == b"message":
                data = frame[2]
                if isinstance(data, bytes):
                    self._receive(data)
            read += 1
            if read % _READ_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a flood is read, and bounded, between other work

    def _receive(self, data: bytes) -> None:
        digest = hash(data)
        if digest in self._echoes:
            self._echoes.discard(digest)  # one of this gateway's own batches, back
            self.echoes += 1
            return
        if len(self._received) >= self.received_msgs or self._received_size + len(data) > self.received_bytes:
            self.slow_consumer += 1  # applying fell behind: drop, as nats-py drops for a slow consumer
            self.errors += 1
            return
        self._received.append(data)
        self._received_size += len(data)
        self._receive_wake.set()

    async def _deliver(self) -> None:
        while True:
            await self._receive_wake.wait()
            while self._received:
                data = self._received.popleft()
                self._received_size -= len(data)
                try:
                    await self.on_message(data)
                except Exception:  # the subscriber never raises; if it did, the link goes on
                    log.exception("applying a sync batch failed")
                await asyncio.sleep(0)  # a backlog of batches still lets requests run between them
            self._receive_wake.clear()

    async def _read_replies(self, pub: Connection) -> None:
        while True:
            try:
                self._check_reply(await pub.read_response(timeout=math.inf))
            except (AuthenticationError, NoPermissionError):
                raise
            except RedisError as exc:
                if not pub.is_connected:
                    raise
                self._error(exc)  # an error reply (out of memory, ...): that batch is lost
            self._replies_due = max(0, self._replies_due - 1)
            self._waiting_since_s = time.monotonic()

    async def _write(self, pub: Connection) -> None:
        while True:
            await self._write_wake.wait()
            self._write_wake.clear()
            commands: list[tuple[str | bytes, ...]] = []
            if self._ping_due:
                self._ping_due = False
                commands.append(self._probe)
            batches = list(self._outgoing)
            commands += [("PUBLISH", self.subject, data) for data in batches]
            if not commands:
                continue
            for data in batches:
                self._remember_echo(hash(data))
            if self._replies_due == 0:
                self._waiting_since_s = time.monotonic()
            self._replies_due += len(commands)
            if not pub.is_connected:  # closed under it: redis-py would quietly open another
                raise RedisError("the publishing connection closed")
            await pub.send_packed_command(pub.pack_commands(commands), check_health=False)
            for _ in batches:  # left the buffer only once the socket took them
                self._outgoing_bytes -= len(self._outgoing.popleft())

    def _remember_echo(self, digest: int) -> None:
        self._echoes.add(digest)
        self._echo_order.append(digest)
        if len(self._echo_order) > ECHO_MEMORY:
            self._echoes.discard(self._echo_order.popleft())

    async def _watch(self, sub: Connection) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            now = time.monotonic()
            if now - self._sub_heard_s > STALE_AFTER_S:
                raise _Stale("the subscribed connection answered no PING")
            if self._replies_due and now - self._waiting_since_s > STALE_AFTER_S:
                raise _Stale("the publishing connection answered nothing")
            self._ping_due = True
            self._write_wake.set()
            if not sub.is_connected:  # closed under it: redis-py would quietly open another
                raise RedisError("the subscribed connection closed")
            await sub.send_command("PING", check_health=False)

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if self._warned:
            return
        self._warned = True
        if isinstance(exc, NoPermissionError):
            log.warning(missing_permission(exc, self.subject) + "; routing on local knowledge")
            return
        if isinstance(exc, AuthenticationError):
            log.warning(
                "sync broker refused this gateway's credentials (sync.auth); routing on local knowledge"
            )
            return
        log.warning("sync broker unreachable; routing on local knowledge", extra={"error": repr(exc)})

    async def _drop(self) -> None:
        self._connected = False
        conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.disconnect(nowait=True), 1.0)

    async def close(self) -> None:
        self._closing = True
        await self._drop()
