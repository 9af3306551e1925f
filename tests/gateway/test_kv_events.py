"""KV-event subscriber: real ZMQ sockets on 127.0.0.1, vLLM's framing and both payload encodings."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from gateway import kv_events
from gateway.kv_event_types import KvEventEndpoint, KvEventLimits, SequenceGap
from gateway.kv_events import REPLAY_END_SEQ, KvEventSubscriber
from policies.base import KvEvent, KvEventKind, WorkerId
from tests.gateway.kv_event_payloads import W, batch, stored_array, stored_map
from tests.support.processes import free_port, running_emulator
from tests.support.wait import wait_until

# ---------------------------------------------------------------- real sockets


@dataclass
class Recorder:
    items: list[tuple[WorkerId, KvEvent] | SequenceGap] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_event(self, worker: WorkerId, event: KvEvent) -> None:
        self.items.append((worker, event))
        self.changed.set()

    def on_gap(self, gap: SequenceGap) -> None:
        self.items.append(gap)
        self.changed.set()

    async def wait_for(self, n: int, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.items) < n:
                self.changed.clear()
                await self.changed.wait()

    def hashes(self) -> list[Any]:
        return [i[1].block_hashes[0] if isinstance(i, tuple) and i[1].block_hashes else i for i in self.items]


@dataclass
class Publisher:
    """An XPUB socket that behaves like vLLM's PUB and tells us when the subscriber has joined."""

    sock: zmq.asyncio.Socket
    endpoint: str
    topic: bytes = b"kv@127.0.0.1@m"

    async def joined(self) -> None:
        async with asyncio.timeout(5):
            msg = await self.sock.recv()
        assert msg[:1] == b"\x01"

    async def send(self, seq: int, payload: bytes) -> None:
        await self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


@pytest.fixture
async def pub(ctx: zmq.asyncio.Context) -> Publisher:
    sock = ctx.socket(zmq.XPUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return Publisher(sock, f"tcp://127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def replay_server(
    ctx: zmq.asyncio.Context, buffered: dict[int, bytes], answer: bool = True
) -> AsyncIterator[str]:
    """A ROUTER socket answering like vLLM's publisher: every buffered batch with seq >= start, then END."""
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            ident, _, start_b = await sock.recv_multipart()
            if not answer:
                continue
            start = int.from_bytes(start_b, "big")
            for seq in sorted(buffered):
                if seq >= start:
                    await sock.send_multipart([ident, b"", seq.to_bytes(8, "big"), buffered[seq]])
            await sock.send_multipart([ident, b"", REPLAY_END_SEQ, b""])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(linger=0)


def one(h: int, encoding: str = "array") -> bytes:
    ev: Any = stored_array([h], None) if encoding == "array" else stored_map([h], None)
    return batch([ev], encoding)


@contextlib.asynccontextmanager
async def subscribed(
    pub: Publisher,
    rec: Recorder,
    *,
    replay: str | None = None,
    gap_handler: Callable[[SequenceGap], None] | None = None,
    limits: KvEventLimits | None = None,
    wanted: Callable[[], bool] | None = None,
) -> AsyncIterator[KvEventSubscriber]:
    sub = KvEventSubscriber(rec.on_event, on_gap=gap_handler, limits=limits, wanted=wanted)
    await sub.start([KvEventEndpoint(W, pub.endpoint, replay_endpoint=replay, topic="kv@")])
    try:
        await pub.joined()
        yield sub
    finally:
        await sub.stop()


async def test_live_batches_in_both_encodings_reach_the_callback(pub: Publisher) -> None:
    rec = Recorder()
    async with subscribed(pub, rec) as sub:
        await pub.send(0, one(10))
        await pub.send(1, one(11, "map"))
        await pub.send(2, batch([["AllBlocksCleared"]], "map"))
        await rec.wait_for(3)
        stats = sub.stats(W)
        assert stats is not None and stats.batches == 3 and stats.last_seq == 2 and stats.gaps == 0
    assert rec.items[0] == (W, KvEvent(KvEventKind.BLOCK_STORED, (10,), None, (0, 1), 2))
    assert rec.items[1][1].block_hashes == (11,)  # type: ignore[index]
    assert rec.items[2] == (W, KvEvent(KvEventKind.ALL_BLOCKS_CLEARED))


async def test_unwanted_batches_are_dropped_undecoded(
    pub: Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The policy has no precise mode: nothing would use the events, so none is decoded.
    rec, used = Recorder(), [False]
    readers: list[bytes] = []
    real_reader = kv_events.BatchReader

    def counting_reader(payload: bytes, salts: Any = None) -> kv_events.BatchReader:
        readers.append(payload)
        return real_reader(payload, salts)

    monkeypatch.setattr(kv_events, "BatchReader", counting_reader)
    async with subscribed(pub, rec, wanted=lambda: used[0]) as sub:
        await pub.send(0, one(10))
        await pub.send(1, b"\xc1 not even msgpack")
        stats = sub.stats(W)
        assert stats is not None
        await wait_until(lambda: stats.ignored_batches == 2, 5)
        assert readers == [] and stats.batches == stats.decode_errors == 0 and rec.items == []
        # A reload that turns precise mode on: the stream is followed again, without a gap.
        used[0] = True
        await pub.send(2, one(12))
        await rec.wait_for(1)
        assert stats.batches == 1 and stats.gaps == 0
    assert rec.hashes() == [12]


async def test_a_large_batch_is_decoded_and_delivered_a_slice_at_a_time(
    pub: Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Other pools' requests share the loop: it must get turns while one big batch is worked on.
    # A slice of no time at all ends after each group of events, however fast this machine is.
    monkeypatch.setattr(kv_events, "SLICE_S", 0.0)
    turns = 0
    seen_at: list[int] = []

    def on_event(worker: WorkerId, event: KvEvent) -> None:
        seen_at.append(turns)

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    events = [stored_array([h], None, bs=16) for h in range(20_000)]
    payload = batch(events)
    sub = KvEventSubscriber(on_event)
    await sub.start([KvEventEndpoint(W, pub.endpoint, topic="kv@")])
    tick = asyncio.create_task(ticker())
    try:
        await pub.joined()
        await pub.send(0, payload)
        await wait_until(lambda: len(seen_at) == len(events), 10)
    finally:
        tick.cancel()
        await sub.stop()
    # Delivery alone spanned several turns of the loop (and decoding came before it).
    assert seen_at[-1] > seen_at[0]


async def test_gap_without_replay_is_signalled(pub: Publisher) -> None:
    rec = Recorder()
    async with subscribed(pub, rec, gap_handler=rec.on_gap) as sub:
        await pub.send(0, one(10))
        await pub.send(3, one(13))
        await rec.wait_for(3)
        assert sub.stats(W).lost_batches == 2  # type: ignore[union-attr]
    assert rec.hashes() == [10, SequenceGap(W, 1, 3), 13]


async def test_gap_default_clears_the_worker_before_newer_events(pub: Publisher) -> None:
    rec = Recorder()
    async with subscribed(pub, rec):
        await pub.send(5, one(15))
        await pub.send(7, one(17))
        await rec.wait_for(3)
    assert rec.items[1] == (W, KvEvent(KvEventKind.ALL_BLOCKS_CLEARED))
    assert rec.hashes()[2] == 17


async def test_gap_is_filled_from_the_replay_socket(ctx: zmq.asyncio.Context, pub: Publisher) -> None:
    rec = Recorder()
    buffered = {s: one(10 + s, "map" if s % 2 else "array") for s in range(0, 6)}
    async with replay_server(ctx, buffered) as replay, subscribed(pub, rec, replay=replay) as sub:
        await pub.send(0, buffered[0])
        await pub.send(4, buffered[4])
        await pub.send(5, buffered[5])
        await rec.wait_for(6)
        stats = sub.stats(W)
        assert stats is not None and stats.replayed_batches == 3 and stats.gaps == 0
    assert rec.hashes() == [10, 11, 12, 13, 14, 15]


async def test_replay_buffer_too_short_reports_only_the_lost_part(
    ctx: zmq.asyncio.Context, pub: Publisher
) -> None:
    rec = Recorder()
    buffered = {s: one(10 + s) for s in (3, 4)}
    async with (
        replay_server(ctx, buffered) as replay,
        subscribed(pub, rec, replay=replay, gap_handler=rec.on_gap),
    ):
        await pub.send(0, one(10))
        await pub.send(4, buffered[4])
        await rec.wait_for(4)
    assert rec.hashes() == [10, SequenceGap(W, 1, 3), 13, 14]


async def test_silent_replay_socket_times_out_into_a_gap(ctx: zmq.asyncio.Context, pub: Publisher) -> None:
    rec = Recorder()
    limits = KvEventLimits(replay_timeout_s=0.2)
    async with (
        replay_server(ctx, {}, answer=False) as replay,
        subscribed(pub, rec, replay=replay, gap_handler=rec.on_gap, limits=limits) as sub,
    ):
        await pub.send(0, one(10))
        await pub.send(2, one(12))
        await rec.wait_for(3)
        assert sub.stats(W).replay_failures == 1  # type: ignore[union-attr]
    assert rec.hashes() == [10, SequenceGap(W, 1, 2), 12]


async def test_publisher_restart_and_malformed_messages(pub: Publisher) -> None:
    rec = Recorder()
    async with subscribed(pub, rec, gap_handler=rec.on_gap) as sub:
        await pub.send(0, one(10))
        await pub.send(1, one(11))
        await pub.sock.send_multipart([pub.topic, b"short"])  # wrong framing: counted, skipped
        await pub.send(2, b"\xc1")  # undecodable payload: counted, sequence still advances
        await pub.send(0, one(20))  # sequence restarts: the worker came back empty
        await rec.wait_for(4)
        stats = sub.stats(W)
        assert stats is not None and stats.decode_errors == 2 and stats.restarts == 1
    assert rec.hashes() == [10, 11, SequenceGap(W, 3, 0, publisher_restarted=True), 20]


async def test_callback_errors_do_not_stop_the_subscription(pub: Publisher) -> None:
    seen: list[KvEvent] = []
    done = asyncio.Event()

    def flaky(worker: WorkerId, event: KvEvent) -> None:
        seen.append(event)
        if len(seen) == 1:
            raise RuntimeError("policy bug")
        done.set()

    sub = KvEventSubscriber(flaky)
    await sub.start([KvEventEndpoint(W, pub.endpoint)])
    try:
        await pub.joined()
        await pub.send(0, one(1))
        await pub.send(1, one(2))
        async with asyncio.timeout(5):
            await done.wait()
        stats = sub.stats(W)
        assert stats is not None and stats.callback_errors == 1
        assert stats.last_error == "callback raised RuntimeError"  # the type, never the message
    finally:
        await sub.stop()


async def test_membership_and_clean_stop(pub: Publisher) -> None:
    rec = Recorder()
    sub = KvEventSubscriber(rec.on_event)
    with pytest.raises(RuntimeError):
        sub.add(KvEventEndpoint(W, pub.endpoint))
    await sub.start()
    sub.add(KvEventEndpoint(W, pub.endpoint))
    sub.add(KvEventEndpoint(WorkerId("bad"), "not-an-endpoint"))
    assert sub.workers() == {W, WorkerId("bad")}
    await pub.joined()

    def bad_error() -> str | None:
        bad = sub.stats(WorkerId("bad"))
        return bad.last_error if bad is not None else None

    assert "not-an-endpoint" in await wait_until(bad_error)
    sub.remove(W)
    assert sub.workers() == {WorkerId("bad")}
    await sub.stop()
    assert sub.workers() == frozenset()


# ---------------------------------------------------------------- against the emulated vLLM worker


@pytest.mark.e2e
@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_events_from_the_emulated_worker(encoding: str) -> None:
    pub_port = free_port()
    endpoint = f"tcp://127.0.0.1:{pub_port}"
    rec = Recorder()
    extra = ("--kv-events-endpoint", endpoint, "--kv-events-encoding", encoding, "--block-size", "16")
    with running_emulator("--time-scale", "50", *extra) as base:
        async with aiohttp.ClientSession() as http:
            sub = KvEventSubscriber(rec.on_event, on_gap=rec.on_gap)
            await sub.start([KvEventEndpoint(W, endpoint)])
            try:
                # PUB/SUB drops what is sent before the subscription lands: retry with fresh prompts.
                for attempt in range(20):
                    body = {
                        "model": "emulated-llama",
                        "messages": [{"role": "user", "content": f"attempt {attempt} " + "x" * 600}],
                        "max_tokens": 1,
                    }
                    async with http.post(base + "/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200
                    with contextlib.suppress(TimeoutError):
                        await rec.wait_for(1, timeout_s=0.5)
                        break
                await rec.wait_for(1)
            finally:
                await sub.stop()
    stored = [i[1] for i in rec.items if isinstance(i, tuple) and i[1].kind is KvEventKind.BLOCK_STORED]
    assert stored, rec.items
    ev = stored[0]
    assert ev.block_size == 16 and len(ev.block_hashes) >= 600 // 16 - 1
    assert len(ev.token_ids) == 16 * len(ev.block_hashes)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev.block_hashes)
    assert not [i for i in rec.items if isinstance(i, SequenceGap)]


async def test_data_parallel_ranks_are_separate_streams_of_one_worker(
    ctx: zmq.asyncio.Context, pub: Publisher
) -> None:
    sock = ctx.socket(zmq.XPUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    rank1 = Publisher(sock, f"tcp://127.0.0.1:{port}")
    rec = Recorder()
    sub = KvEventSubscriber(rec.on_event, on_gap=rec.on_gap)
    await sub.start([KvEventEndpoint(W, pub.endpoint), KvEventEndpoint(W, rank1.endpoint)])
    try:
        await pub.joined()
        await rank1.joined()
        # Each rank numbers its own batches from 0: no gap, no restart.
        await pub.send(0, one(10))
        await rec.wait_for(1)
        await rank1.send(0, one(20))
        await rec.wait_for(2)
        await pub.send(1, one(11))
        await rec.wait_for(3)
        assert sub.workers() == {W}
        assert set(sub.stream_stats(W)) == {pub.endpoint, rank1.endpoint}
        sub.remove(W)
        assert sub.stats(W) is None and sub.stream_stats(W) == {}
    finally:
        await sub.stop()
    assert rec.hashes() == [10, 20, 11]


async def test_joining_a_running_worker_replays_its_buffered_history(
    ctx: zmq.asyncio.Context, pub: Publisher
) -> None:
    rec = Recorder()
    buffered = {s: one(10 + s) for s in range(2, 8)}  # the buffer no longer holds 0 and 1
    async with (
        replay_server(ctx, buffered) as replay,
        subscribed(pub, rec, replay=replay, gap_handler=rec.on_gap) as sub,
    ):
        await pub.send(7, buffered[7])
        await rec.wait_for(6)
        stats = sub.stats(W)
        assert stats is not None and stats.replayed_batches == 5 and stats.gaps == 0
    assert rec.hashes() == [12, 13, 14, 15, 16, 17]  # no gap reported for history before the buffer


async def test_join_without_catch_up(ctx: zmq.asyncio.Context, pub: Publisher) -> None:
    rec = Recorder()
    limits = KvEventLimits(replay_on_join=False)
    async with (
        replay_server(ctx, {s: one(10 + s) for s in range(0, 4)}) as replay,
        subscribed(pub, rec, replay=replay, limits=limits),
    ):
        await pub.send(3, one(13))
        await pub.send(4, one(14))
        await rec.wait_for(2)
    assert rec.hashes() == [13, 14]
