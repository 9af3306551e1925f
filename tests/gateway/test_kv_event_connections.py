"""A KV-event stream's connection and what a publisher can repeat at will: a message over the size
limit ends the ZMQ session for good and the subscriber connects again; counters stay within what
the admin API can render; repeated warnings are written once a minute, every one counted."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from gateway.kv_event_types import MAX_COUNT, KvEventLimits, SequenceGap
from gateway.log_throttle import LogThrottle
from tests.gateway.kv_event_payloads import W
from tests.gateway.test_kv_events import Publisher, Recorder, ctx, one, pub, subscribed
from tests.support.wait import wait_until

__all__ = ["ctx", "pub"]  # the fixtures, from the subscriber's own tests


async def _resubscribed(pub: Publisher, timeout_s: float = 10.0) -> None:
    """Until the XPUB socket hears a subscription again (after the old one's end)."""
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await pub.sock.recv()
            if msg[:1] == b"\x01":
                return


async def test_a_message_over_the_limit_ends_the_connection_and_a_new_one_follows(pub: Publisher) -> None:
    rec = Recorder()
    limits = KvEventLimits(max_message_bytes=64 * 1024)
    async with subscribed(pub, rec, gap_handler=rec.on_gap, limits=limits) as sub:
        await pub.send(0, one(10))
        await rec.wait_for(1)
        await pub.send(1, b"\0" * (128 * 1024))  # a protocol error: ZMQ ends the session for good
        await _resubscribed(pub)
        await pub.send(2, one(12))
        await rec.wait_for(3)
        stats = sub.stats(W)
        assert stats is not None and stats.disconnects == 1
        assert stats.last_error is not None and "max_message_bytes" in stats.last_error
    assert rec.hashes() == [10, SequenceGap(W, 1, 2), 12]


async def test_a_lost_connection_zmq_makes_again_is_not_a_disconnect(ctx: zmq.asyncio.Context) -> None:
    first = ctx.socket(zmq.XPUB)
    port = first.bind_to_random_port("tcp://127.0.0.1")
    publisher = Publisher(first, f"tcp://127.0.0.1:{port}")
    rec = Recorder()
    async with subscribed(publisher, rec, gap_handler=rec.on_gap) as sub:
        await publisher.send(0, one(10))
        await rec.wait_for(1)
        first.close(linger=0)  # the worker restarts on the same port
        second = ctx.socket(zmq.XPUB)
        await wait_until(lambda: _bound(second, publisher.endpoint))  # once the old socket let go
        publisher = Publisher(second, publisher.endpoint)
        await _resubscribed(publisher)
        await publisher.send(0, one(20))
        await rec.wait_for(3)
        stats = sub.stats(W)
        assert stats is not None and stats.disconnects == 0 and stats.last_error is None
    second.close(linger=0)
    assert rec.hashes() == [10, SequenceGap(W, 1, 0, publisher_restarted=True), 20]


def _bound(sock: zmq.asyncio.Socket, endpoint: str) -> bool:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        return False
    return True


async def test_a_sequence_jumping_across_the_range_counts_at_most_max_count(pub: Publisher) -> None:
    rec = Recorder()
    async with subscribed(pub, rec, gap_handler=rec.on_gap) as sub:
        for seq in (0, 2**64 - 1, 0, 100):
            await pub.send(seq, one(seq % 1000))
        await rec.wait_for(7)
        stats = sub.stats(W)
        assert stats is not None and stats.lost_batches == MAX_COUNT and stats.gaps == 3


async def test_a_storm_of_malformed_messages_is_counted_and_written_once(pub: Publisher) -> None:
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvgate.kv_events")
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.WARNING)  # whatever an earlier test's logging setup left
    logger.disabled = False
    logger.addHandler(handler)
    try:
        rec = Recorder()
        async with subscribed(pub, rec) as sub:
            for _ in range(300):
                await pub.sock.send_multipart([pub.topic, b"short"])
            await wait_until(lambda: (s := sub.stats(W)) is not None and s.decode_errors == 300)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert len([r for r in lines if "malformed" in r.getMessage()]) == 1


def test_the_throttle_writes_once_per_interval_and_key_with_the_count_left() -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("test.log_throttle")
    logger.addHandler(handler)
    logger.propagate = False
    throttle = LogThrottle(logger, every_s=60.0, max_keys=2)
    assert throttle.warning("a", 0.0, "bad %s", "x")
    assert not throttle.warning("a", 30.0, "bad %s", "x")
    assert not throttle.warning("a", 59.0, "bad %s", "x")
    assert throttle.warning("b", 59.0, "other")
    assert throttle.warning("a", 61.0, "bad %s", "y")
    assert lines == ["bad x", "other", "bad y (and 2 more like it since the last such line)"]
    throttle.warning("c", 62.0, "third")  # bounded: "b", heard from least recently, is forgotten
    assert throttle.warning("b", 63.0, "other")
