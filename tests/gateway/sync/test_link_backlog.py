"""A subscriber that falls behind its peers drops batches, counted, instead of queueing them for minutes."""

from __future__ import annotations

import asyncio
import time

from gateway.sync.link import RECEIVED_BYTES, RECEIVED_MSGS
from tests.gateway.sync.brokers import TestBroker, link_to, raw_publish
from tests.support.wait import wait_until


def test_the_backlog_is_seconds_of_a_fleets_batches_not_minutes() -> None:
    # nats-py's defaults: 524,288 batches or 128 MiB, minutes of 16 peers' batches at 5 ms.
    assert RECEIVED_MSGS <= 16 * 200 * 5 and RECEIVED_BYTES <= 64 * 1024 * 1024


async def test_a_subscriber_that_falls_behind_drops_batches_and_counts_them(broker: TestBroker) -> None:
    limit, sent = 64, 1000
    applied: list[bytes] = []

    async def on_message(data: bytes) -> None:
        time.sleep(0.002)  # noqa: ASYNC251 - applying a batch is CPU on the loop: the loop is busy
        applied.append(data)

    link = link_to(broker, "t.batches", on_message, received_msgs=limit)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: link.connected)
        # A burst of peers' batches, faster than they are applied.
        await raw_publish(broker.url, "t.batches", [i.to_bytes(4, "big") for i in range(sent)])
        await wait_until(lambda: len(applied) + link.slow_consumer == sent, timeout_s=20)
        assert link.connected and link.slow_consumer >= sent // 2  # dropped at the client, not queued
        assert len(applied) < sent // 2
        ordered = [int.from_bytes(x, "big") for x in applied]
        assert ordered == sorted(ordered)  # what is applied keeps its order
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
