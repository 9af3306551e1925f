"""What a subscriber logs of the batches it drops: enough to act on, never one line per batch."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync import subscriber
from gateway.sync.codec import SyncBatch, encode_body
from gateway.sync.subscriber import DROP_LOG_EVERY_S, SyncSubscriber
from policies.base import WorkerId
from policies.cost_policy import CostPolicy
from policies.peer_sync import PeerLoad
from tests.gateway.sync.signed import SECRET, encode, sealed


class _Clocks:
    """The subscriber's `time` module with a monotonic clock the test moves."""

    def __init__(self, monotonic_s: list[float]) -> None:
        self.monotonic_s = monotonic_s

    def monotonic(self) -> float:
        return self.monotonic_s[0]

    def time(self) -> float:
        return time.time()


def _subscriber(monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> tuple[SyncSubscriber, CostPolicy]:
    """A subscriber of gateway "me" (one pool, one worker) whose clocks read `clock`, and a policy."""
    monkeypatch.setattr(subscriber, "time", _Clocks(clock))
    registry = Registry([PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])])
    return SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET), CostPolicy(seed=0)


async def test_malformed_batches_are_counted_each_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A broken peer (of this deployment: its batches are sealed) sends every batch so: a few
    # hundred a second, each of which was a warning line of its own.
    clock = [1000.0]
    sub, policy = _subscriber(monkeypatch, clock)
    caplog.set_level(logging.WARNING, logger="kvgate.sync")
    broken = sealed({"o": "gw-b"})
    for _ in range(500):
        await sub.on_message(broken, lambda: policy)
        clock[0] += 0.005
    warned = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert sub.stats.malformed == 500 and len(warned) == 1
    clock[0] += DROP_LOG_EVERY_S
    await sub.on_message(sealed(b"\x93garbage"), lambda: policy)
    warned = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert sub.stats.malformed == 501 and len(warned) == 2
    assert "and 499 more like it" in warned[1].getMessage()  # dropped since the last line
    assert sub.stats.bad_signature == 0


async def test_batches_without_a_valid_signature_are_counted_each_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gateway of an earlier release (bare batches), of another secret, or a forger: every batch
    # is dropped unread, each counted, one line a minute that says nothing of what they carried.
    clock = [1000.0]
    sub, policy = _subscriber(monkeypatch, clock)
    caplog.set_level(logging.DEBUG, logger="kvgate.sync")
    batch = SyncBatch(
        "forger-origin", 1, time.time(), True, (), (PeerLoad("p", WorkerId("w-secret-name"), 1, 2, 3),)
    )
    sent = [
        encode_body(batch),
        encode(batch, b"another secret"),
        encode(dataclasses.replace(batch, seq=2))[:-1],  # a genuine batch, cut short
    ]
    for _ in range(100):
        for data in sent:
            await sub.on_message(data, lambda: policy)
        clock[0] += 0.005
    assert sub.stats.bad_signature == 300 and sub.stats.malformed == 0 and sub.stats.batches == 0
    warned = [r for r in caplog.records if "signature" in r.getMessage()]
    assert len(warned) == 1 and len(caplog.records) == 1
    clock[0] += DROP_LOG_EVERY_S
    await sub.on_message(sent[1], lambda: policy)
    warned = [r for r in caplog.records if "signature" in r.getMessage()]
    assert sub.stats.bad_signature == 301 and len(warned) == 2
    assert "and 299 more like it" in warned[1].getMessage()
    for record in caplog.records:  # nothing of the batches: neither their names nor their bytes
        text = record.getMessage() + repr(record.__dict__)
        assert "forger-origin" not in text and "w-secret-name" not in text and "sync-test" not in text
