"""What a subscriber logs of the batches it drops: enough to act on, never one line per batch."""

from __future__ import annotations

import logging
import time

import msgpack
import pytest

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync import subscriber
from gateway.sync.subscriber import DROP_LOG_EVERY_S, SyncSubscriber
from policies.cost_policy import CostPolicy

SECRET = b"sync-test-secret"  # the deployment's key-hash secret (its pools' fingerprints)


class _Clocks:
    """The subscriber's `time` module with a monotonic clock the test moves."""

    def __init__(self, monotonic_s: list[float]) -> None:
        self.monotonic_s = monotonic_s

    def monotonic(self) -> float:
        return self.monotonic_s[0]

    def time(self) -> float:
        return time.time()


async def test_malformed_batches_are_counted_each_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer of a later wire version (a rolling upgrade) or a broken one sends every batch so: a
    # few hundred a second, each of which was a warning line of its own.
    clock = [1000.0]
    monkeypatch.setattr(subscriber, "time", _Clocks(clock))
    registry = Registry([PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])])
    sub = SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET)
    policy = CostPolicy(seed=0)
    caplog.set_level(logging.WARNING, logger="kvgate.sync")
    later_release = msgpack.packb({"v": 2, "o": "gw-b"})
    for _ in range(500):
        await sub.on_message(later_release, lambda: policy)
        clock[0] += 0.005
    warned = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert sub.stats.malformed == 500 and len(warned) == 1
    clock[0] += DROP_LOG_EVERY_S
    await sub.on_message(b"\x93garbage", lambda: policy)
    warned = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert sub.stats.malformed == 501 and len(warned) == 2
    assert "and 499 more like it" in warned[1].getMessage()  # dropped since the last line
