"""Subscriber for vLLM's KV-cache events (ZMQ PUB, msgpack), one SUB socket per worker.

Wire format (vLLM `vllm/distributed/kv_events.py`, SGLang uses the same framing):
a multipart message `[topic, seq (8-byte big-endian), payload]`, where payload is a msgpack
`EventBatch` (decoded by `gateway.kv_event_codec`, which this module re-exports). What a
subscription is given and reports (endpoints, limits, counters, gaps) is in `gateway.kv_event_types`.

The publisher numbers batches 0, 1, 2, ... and drops messages above its high-water mark, so the
subscriber watches `seq`. On a gap it asks the worker's ROUTER replay socket (when configured) for
the missing batches; whatever cannot be recovered is reported through `on_gap`. Without an
`on_gap` handler the subscriber delivers a synthetic `AllBlocksCleared`: forgetting a worker's blocks
costs some cache hits, while keeping a view with holes in it would route to blocks that are gone.
A sequence that goes backwards means the publisher restarted (its cache is empty): the same signal.

ZMQ reconnects a lost connection by itself, but not one it ended for a protocol error, such as a
message over `max_message_bytes`: that session is over for good. The subscriber watches its
socket's connection events, and when a connection ends without ZMQ saying it will connect again,
it opens a new socket (counted in `disconnects`, said in `last_error`); what was lost with the
old one is a sequence gap like any other. Warnings a publisher can repeat at will (malformed
messages, sequence jumps, undecodable batches) are written at most once a minute per worker and
kind, with the number left unwritten (`log_throttle`); every one is counted.

On joining a worker that is already running (first batch seen with seq > 0), the subscriber asks the
replay socket for the history it still buffers, so a restarted gateway relearns recent blocks.

Decoding holds the event loop, and every pool's requests share that loop: a batch is decoded and
delivered in slices of about `SLICE_S` of work, with a turn of the loop between them, so a
worker that publishes huge batches delays other requests by a slice, not by its batch. When
nothing would use the events (`wanted` says no: the policy has no precise mode), a batch is
counted and dropped undecoded; the sequence is then forgotten, so following it again starts like
joining a running worker.

A worker with data-parallel engines publishes one stream per rank (vLLM: endpoint port + rank);
each is added as its own `KvEventEndpoint` of the same worker and keeps its own sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kv_event_codec import (
    GPU_MEDIA,
    PREFIX_SPEC_KINDS,
    BatchReader,
    DecodedBatch,
    KvEventDecodeError,
    decode_batch,
    decode_event,
)
from gateway.kv_event_types import (
    MAX_COUNT,
    GapCallback,
    KvEventEndpoint,
    KvEventLimits,
    SequenceGap,
    SubscriptionStats,
)
from gateway.log_throttle import LogThrottle
from policies.base import KvEvent, KvEventKind, WorkerId

__all__ = [
    "GPU_MEDIA",
    "PREFIX_SPEC_KINDS",
    "REPLAY_END_SEQ",
    "DecodedBatch",
    "KvEventDecodeError",
    "KvEventSubscriber",
    "decode_batch",
    "decode_event",
]

log = logging.getLogger("kvgate.kv_events")

# vLLM ends a replay with seq = -1 as a signed 8-byte big-endian integer and an empty payload.
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)

KvEventCallback = Callable[[WorkerId, KvEvent], None]

# The work done on the loop between two yields to it while a batch is decoded or delivered, and
# how many events go between two looks at the clock.
SLICE_S = 0.002
_SLICE_EVENTS = 32

# How long after a connection ends the subscriber waits for ZMQ to say it will connect again
# (it says so at once for a lost connection) before it opens a new socket itself.
RECONNECT_NOTICE_S = 1.0
_WATCHED_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
)
_DROPPED = (
    "the connection to the publisher ended for good (a message over max_message_bytes, or another "
    "protocol error); connecting again"
)


# ---------------------------------------------------------------- subscriber


@dataclass(slots=True)
class _Subscription:
    endpoint: KvEventEndpoint
    task: asyncio.Task[None]
    stats: SubscriptionStats = field(default_factory=SubscriptionStats)


class KvEventSubscriber:
    """Owns one SUB socket and task per worker; feed it from discovery, drive it from the lifespan.

    `on_event` is called on the event loop, in sequence order, for every decoded event; it must be
    quick (it is the policy's `on_kv_event` behind a lock-free wrapper). Errors it raises are logged
    and counted, never fatal. `stop()` cancels every task and closes every socket.
    """

    def __init__(
        self,
        on_event: KvEventCallback,
        on_gap: GapCallback | None = None,
        limits: KvEventLimits | None = None,
        salt_namespaces: Mapping[str, str] | None = None,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        self._on_event = on_event
        self._wanted = wanted
        self._salt_namespaces = salt_namespaces
        self._on_gap = on_gap
        self._limits = limits or KvEventLimits()
        self._ctx: zmq.asyncio.Context | None = None
        # worker -> endpoint URL -> subscription. A worker running data-parallel engines publishes
        # one stream per rank (vLLM: port + rank), each with its own sequence numbers.
        self._subs: dict[WorkerId, dict[str, _Subscription]] = {}
        # Every task ever started and not yet finished, so stop() can wait for sockets to close.
        self._tasks: set[asyncio.Task[None]] = set()
        self._warnings = LogThrottle(log)

    # lifespan -------------------------------------------------------------
    async def start(self, endpoints: Sequence[KvEventEndpoint] = ()) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for ep in endpoints:
            self.add(ep)

    async def stop(self) -> None:
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # membership -----------------------------------------------------------
    def add(self, endpoint: KvEventEndpoint) -> None:
        """Subscribe to one of a worker's streams (replacing an earlier one at the same endpoint)."""
        if self._ctx is None:
            raise RuntimeError("KvEventSubscriber.add() before start()")
        streams = self._subs.setdefault(endpoint.worker, {})
        old = streams.pop(endpoint.endpoint, None)
        if old is not None:
            old.task.cancel()
        stats = SubscriptionStats()
        task = asyncio.create_task(self._run(endpoint, stats), name=f"kv-events:{endpoint.worker}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        streams[endpoint.endpoint] = _Subscription(endpoint, task, stats)

    def remove(self, worker: WorkerId) -> None:
        """Drop every stream of a worker."""
        for sub in self._subs.pop(worker, {}).values():
            sub.task.cancel()

    def workers(self) -> frozenset[WorkerId]:
        return frozenset(self._subs)

    def stats(self, worker: WorkerId) -> SubscriptionStats | None:
        """The counters of the worker's first stream (the only one without data parallelism)."""
        streams = self._subs.get(worker)
        return next(iter(streams.values())).stats if streams else None

    def stream_stats(self, worker: WorkerId) -> dict[str, SubscriptionStats]:
        """Counters of each of the worker's streams, by endpoint."""
        return {ep: sub.stats for ep, sub in self._subs.get(worker, {}).items()}

    # per-worker loop --------------------------------------------------------
    async def _run(self, ep: KvEventEndpoint, stats: SubscriptionStats) -> None:
        expected: int | None = None  # kept across new connections: what one lost is a gap
        while True:
            opened = self._connect(ep, stats)
            if opened is None:
                return
            sock, monitor = opened
            try:
                expected = await self._follow(ep, stats, sock, monitor, expected)
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
            stats.disconnects = min(stats.disconnects + 1, MAX_COUNT)
            stats.last_error = _DROPPED
            self._warn(ep.worker, "dropped", "kv events from %s: %s", ep.worker, _DROPPED)
            await asyncio.sleep(self._limits.reconnect_ivl_s)

    def _connect(
        self, ep: KvEventEndpoint, stats: SubscriptionStats
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None:
        """A SUB socket connecting to the stream, and the monitor of its connections (attached
        before it connects, so that no connection's end goes unseen); None if it cannot."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._limits.receive_hwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL, int(self._limits.reconnect_ivl_s * 1000))
            sock.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
            monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
            sock.connect(ep.endpoint)
        except zmq.ZMQError as exc:
            stats.last_error = f"cannot connect to {ep.endpoint}: {exc}"
            log.error("kv events from %s: %s", ep.worker, stats.last_error)
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            return None
        return sock, monitor

    async def _follow(
        self,
        ep: KvEventEndpoint,
        stats: SubscriptionStats,
        sock: zmq.asyncio.Socket,
        monitor: zmq.asyncio.Socket,
        expected: int | None,
    ) -> int | None:
        """Receive and deliver the stream's batches until its connection ends for good (ended,
        and ZMQ not connecting again within `RECONNECT_NOTICE_S`); the next sequence number
        expected then."""
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ended_s: float | None = None
        while True:
            # A waiting message is taken at once; the poll (the monitor too) only when none waits.
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                expected = await self._receive(ep, stats, frames, expected)
                continue
            timeout_ms = None
            if ended_s is not None:
                timeout_ms = max(0, int((ended_s + RECONNECT_NOTICE_S - time.monotonic()) * 1000))
            ready = dict(await poller.poll(timeout_ms))
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                ended_s = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
            elif sock not in ready and ended_s is not None:
                return expected

    async def _receive(
        self, ep: KvEventEndpoint, stats: SubscriptionStats, frames: list[bytes], expected: int | None
    ) -> int | None:
        """Deliver one message of the stream (after what a gap before it needs); the next
        sequence number expected."""
        seq = _parse_frames(frames)
        if seq is None:
            stats.decode_errors += 1
            self._warn(
                ep.worker,
                "malformed",
                "kv events from %s: malformed message (%d frames)",
                ep.worker,
                len(frames),
            )
            return expected
        if self._wanted is not None and not self._wanted():
            stats.ignored_batches += 1
            stats.last_seq = seq
            return None
        if expected is None and seq > 0 and ep.replay_endpoint and self._limits.replay_on_join:
            # Joining a running worker: fetch what its replay buffer still holds.
            await self._replay(ep, stats, 0, seq, joining=True)
        elif expected is not None and seq != expected:
            await self._recover(ep, stats, expected, seq)
        await self._deliver(ep.worker, stats, seq, frames[-1])
        return seq + 1

    def _warn(self, worker: WorkerId, kind: str, message: str, *args: object) -> None:
        self._warnings.warning((worker, kind), time.monotonic(), message, *args)

    async def _recover(self, ep: KvEventEndpoint, stats: SubscriptionStats, expected: int, seq: int) -> None:
        if seq < expected:
            stats.restarts += 1
            self._warn(
                ep.worker,
                "restart",
                "kv events from %s: sequence went back %d -> %d",
                ep.worker,
                expected - 1,
                seq,
            )
            self._gap(SequenceGap(ep.worker, expected, seq, publisher_restarted=True), stats)
            return
        next_needed = expected
        if ep.replay_endpoint is not None:
            next_needed = await self._replay(ep, stats, expected, seq)
        if next_needed < seq:
            self._gap(SequenceGap(ep.worker, next_needed, seq), stats)

    async def _replay(
        self, ep: KvEventEndpoint, stats: SubscriptionStats, start: int, stop: int, joining: bool = False
    ) -> int:
        """Fetch batches `start .. stop-1` from the replay socket; return the first seq still missing.

        When `joining`, history older than the buffer was never ours to lose: no gap is reported.
        """
        assert self._ctx is not None and ep.replay_endpoint is not None
        next_needed = start
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
            sock.connect(ep.replay_endpoint)
            # An empty delimiter frame makes the DEALER look like REQ to vLLM's ROUTER loop.
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self._limits.replay_timeout_s
            for _ in range(self._limits.max_replay_batches + 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await sock.poll(timeout=int(remaining * 1000)):
                    raise TimeoutError
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    raise KvEventDecodeError("replay reply is not [seq, payload]")
                if frames[0] == REPLAY_END_SEQ:
                    break
                rseq = int.from_bytes(frames[0], "big")
                if rseq >= stop:
                    break  # the live stream already holds this one
                if rseq < next_needed:
                    continue
                if rseq > next_needed and not joining:
                    # The replay buffer no longer reaches back far enough.
                    self._gap(SequenceGap(ep.worker, next_needed, rseq), stats)
                delivering = time.monotonic()
                await self._deliver(ep.worker, stats, rseq, frames[1])
                # The deadline bounds the wait for the worker, not the turns given to requests.
                deadline += time.monotonic() - delivering
                stats.replayed_batches += 1
                next_needed = rseq + 1
        except (TimeoutError, KvEventDecodeError, zmq.ZMQError) as exc:
            stats.replay_failures += 1
            self._warn(
                ep.worker, "replay", "kv events from %s: replay failed: %s", ep.worker, type(exc).__name__
            )
        finally:
            sock.close(linger=0)
        return next_needed

    def _gap(self, gap: SequenceGap, stats: SubscriptionStats) -> None:
        stats.gaps += 1
        stats.lost_batches = min(stats.lost_batches + gap.missing_batches, MAX_COUNT)
        self._warn(
            gap.worker,
            "gap",
            "kv events from %s: lost batches %d..%d%s",
            gap.worker,
            gap.first_missing_seq,
            gap.next_seq - 1,
            " (publisher restarted)" if gap.publisher_restarted else "",
        )
        try:
            if self._on_gap is not None:
                self._on_gap(gap)
            else:
                self._on_event(gap.worker, KvEvent(kind=KvEventKind.ALL_BLOCKS_CLEARED))
        except Exception:
            stats.callback_errors += 1
            log.exception("kv events: gap handler failed for %s", gap.worker)

    async def _deliver(self, worker: WorkerId, stats: SubscriptionStats, seq: int, payload: bytes) -> None:
        """Decode the batch, then hand its events to `on_event`, both in slices of `SLICE_S`."""
        stats.last_seq = seq
        stats.last_batch_monotonic_s = time.monotonic()
        reader = BatchReader(payload, self._salt_namespaces)
        try:
            started = time.perf_counter()
            while not reader.step(_SLICE_EVENTS):
                if time.perf_counter() - started >= SLICE_S:
                    await asyncio.sleep(0)
                    started = time.perf_counter()
        except KvEventDecodeError as exc:
            stats.decode_errors += 1
            self._warn(worker, "undecodable", "kv events from %s: batch %d undecodable: %s", worker, seq, exc)
            return
        batch = reader.result()
        stats.batches += 1
        stats.last_batch_lag_s = time.time() - batch.ts_s
        stats.skipped_events += batch.skipped_events
        started = time.perf_counter()
        for i, ev in enumerate(batch.events, 1):
            stats.events += 1
            try:
                self._on_event(worker, ev)
            except Exception as exc:
                stats.callback_errors += 1
                # The type only: an exception's message may quote token ids, which never reach a log.
                stats.last_error = f"callback raised {type(exc).__name__}"
                log.error("kv events: callback failed for %s: %s", worker, type(exc).__name__)
            if not i % _SLICE_EVENTS and time.perf_counter() - started >= SLICE_S:
                await asyncio.sleep(0)
                started = time.perf_counter()


def _parse_frames(frames: Sequence[bytes]) -> int | None:
    """The sequence number of a `[topic, seq, payload]` message, or None when it is malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")
