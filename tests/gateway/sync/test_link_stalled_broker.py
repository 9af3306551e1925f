"""A broker that stops reading (a partition, a stopped process) never holds the publishing task,
whichever kind it is.

nats-py buffers outgoing data up to the link's `pending_bytes`; past it, its `publish` waits for
the socket to drain, with no time limit, until pings find the connection stale. The link refuses
such a batch instead (counted by the caller as `dropped_publish_failed`), so the publish loop
keeps its own pace, and with it the expiry of silent peers' load. The Redis link's buffer is its
own, and it refuses alike once the stalled socket stops taking it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from gateway.demo import start_child
from gateway.sync.broker import LocalBroker, nats_server_path
from gateway.sync.nats_link import NatsLink
from gateway.sync.service import SyncService
from policies.base import WorkerId
from policies.peer_sync import PeerHolding
from prompt_normalizer.types import BlockKey
from tests.e2e.harness import free_port
from tests.gateway.sync.brokers import TestBroker, link_to
from tests.gateway.sync.test_service_nats import W, _state
from tests.support.wait import wait_until


async def _ignore(data: bytes) -> None:
    return None


async def test_a_broker_that_stops_reading_never_holds_a_publish(broker: TestBroker) -> None:
    link = link_to(broker, "t.batches", _ignore, pending_bytes=1 << 20)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: link.connected)
        assert broker.child is not None
        os.kill(broker.child.proc.pid, signal.SIGSTOP)  # it reads nothing more, the socket stays open
        batch = b"\x00" * (256 << 10)
        slowest_s, refused = 0.0, 0
        for _ in range(200):  # 50 MiB: past the socket buffers and the link's own
            started = time.monotonic()
            async with asyncio.timeout(10.0):
                ok = await link.publish(batch)
            slowest_s = max(slowest_s, time.monotonic() - started)
            refused += not ok
        assert refused > 0 and slowest_s < 1.0, (refused, slowest_s)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()


async def test_a_gateway_stops_its_sync_tasks_with_the_broker_stalled(
    broker: TestBroker, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(broker.url, queue_max_items=100_000, batch_max_items=4096)
    service = SyncService(state.registry, state.routing, state.config.sync, "a", secret=state.secret)
    caplog.set_level(logging.WARNING, logger="kvgate.sync")
    await service.start()
    tasks = list(service._tasks)
    try:
        await wait_until(lambda: service.link.connected)
        assert broker.child is not None
        os.kill(broker.child.proc.pid, signal.SIGSTOP)
        keys = tuple(BlockKey(k) for k in range(2048))  # 16 KiB a holding: 64 MiB in all
        for ref in range(4096):
            service.publisher.sink(PeerHolding(ref, "p", 16, "t", keys, WorkerId(W[0]), 32_768, 0), 0.0)
        # The publish loop sends into the stalled socket until the link refuses what nats-py
        # could only wait to send (before: it waited, held, and swallowed the cancellation).
        await wait_until(lambda: service.failed_batches > 0)
    finally:
        await service.stop()
    # What the shutdown must not do is wait on a task that holds: each wait for the tasks is bounded
    # (2 s) and says so when it ends them unfinished. Not a bound on the stop's own time: with
    # nats-py data still pending, closing the link alone waits its full second for a drain that
    # the stalled broker never allows (a wall-clock bound of 1.5 s left half a second to the rest).
    assert not [r for r in caplog.records if "did not stop" in r.getMessage()]
    assert tasks and all(task.done() for task in tasks)  # none left running after the shutdown


async def test_no_batch_is_cut_larger_than_the_link_sends(tmp_path: Path) -> None:
    # A broker that takes 8 MiB messages (the chart's): a batch is still cut to what the link's
    # outgoing buffer takes, or the link would refuse every one of it.
    binary = nats_server_path()
    assert binary is not None
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: 8388608\n")
    broker = LocalBroker(port, tmp_path)
    broker.child = start_child([binary, "-c", str(conf)], broker.url, tmp_path, "nats-server")
    link = NatsLink([broker.url], "t.batches", "me", _ignore, pending_bytes=1 << 20)
    task = asyncio.create_task(link.run())
    try:
        await wait_until(lambda: link.connected)
        nc = link._nc
        assert nc is not None and nc.max_payload == 8 << 20
        # A batch of the whole buffer fits once what the connection itself sent (its
        # subscription) has left the buffer.
        await wait_until(lambda: nc.pending_data_size == 0, what="the link's buffer is empty")
        assert link.max_payload == 1 << 20 and await link.publish(b"\x00" * link.max_payload)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        broker.stop()
