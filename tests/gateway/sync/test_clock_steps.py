"""A step of a sender's wall clock, or of the receiver's, is forgotten within a minute or two.

A peer's batch is as late as its age beyond the smallest recent age of that peer's batches (their
clocks' skew). When the sender's clock was ahead and is stepped back (NTP after a VM resumed, a
host booted with a wrong clock), every batch after the step is older by the step than the
smallest age: with the smallest age rising 10 ms a second, a 60 s step read every batch of that
peer as decided a second or more ago (the herd's horizon) for an hour and a half, which stops
holds and inflates the unseen peer dispatches toward the home shares.
"""

from __future__ import annotations

import pytest

from gateway.config.pool import PoolConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import Registry
from gateway.sync import subscriber
from gateway.sync.codec import SyncBatch
from gateway.sync.subscriber import SyncSubscriber
from tests.gateway.sync.signed import SECRET

_EVERY_S = 0.005  # a batch every 5 ms, the default batch interval


class _Clocks:
    """The subscriber's `time` module, moved by the test."""

    def __init__(self) -> None:
        self.wall_s = 1.7e9
        self.monotonic_s = 1000.0

    def time(self) -> float:
        return self.wall_s

    def monotonic(self) -> float:
        return self.monotonic_s

    def tick(self, dt_s: float) -> None:
        self.wall_s += dt_s
        self.monotonic_s += dt_s


class _Peer:
    """A peer whose clock is `ahead_s` ahead of the receiver's, sending a batch every 5 ms that
    spends `transit_s` on the way."""

    def __init__(self, sub: SyncSubscriber, clocks: _Clocks) -> None:
        self.sub, self.clocks, self.seq = sub, clocks, 0

    def late_s(self, ahead_s: float, transit_s: float = 0.001) -> float:
        """How long before its arrival the receiver takes the batch's items to have been decided."""
        self.seq += 1
        sent = self.clocks.wall_s + ahead_s - transit_s
        now = self.clocks.monotonic_s
        return now - self.sub.decided_s(SyncBatch("peer", self.seq, sent, True), now)

    def run(self, seconds: float, ahead_s: float) -> float:
        late = 0.0
        for _ in range(int(seconds / _EVERY_S)):
            late = self.late_s(ahead_s)
            self.clocks.tick(_EVERY_S)
        return late


def _peer(monkeypatch: pytest.MonkeyPatch) -> _Peer:
    clocks = _Clocks()
    monkeypatch.setattr(subscriber, "time", clocks)
    registry = Registry([PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9001"])])
    return _Peer(SyncSubscriber("me", registry, 5.0, GatewayMetrics(), secret=SECRET), clocks)


@pytest.mark.parametrize("step_s", [1.0, 60.0, 600.0])
def test_a_senders_clock_stepped_back_is_forgotten_within_two_minutes(
    monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    peer = _peer(monkeypatch)
    assert peer.run(30.0, ahead_s=step_s) == pytest.approx(0.0, abs=1e-6)  # a steady skew is no lag
    assert peer.late_s(ahead_s=0.0) == pytest.approx(step_s, rel=0.01)  # the step, just after it
    assert peer.run(60.0, ahead_s=0.0) < 1.0  # within the herd's horizon in a minute
    assert peer.run(60.0, ahead_s=0.0) < 0.01  # and gone in two


def test_a_receivers_clock_stepped_forward_is_forgotten_too(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = _peer(monkeypatch)
    peer.run(30.0, ahead_s=0.0)
    # The receiver's wall clock jumps 60 s ahead: every peer now looks 60 s behind it.
    assert peer.late_s(ahead_s=-60.0) == pytest.approx(60.0, rel=0.01)
    assert peer.run(120.0, ahead_s=-60.0) < 0.01


def test_a_batch_late_on_the_way_still_reads_late(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the floor is for: lag beyond the peers' usual transit, as the herd counts it.
    peer = _peer(monkeypatch)
    peer.run(30.0, ahead_s=3.0)
    for lag_s in (0.002, 0.05, 0.5):
        assert peer.late_s(ahead_s=3.0, transit_s=0.001 + lag_s) == pytest.approx(lag_s, rel=0.01, abs=1e-4)
        peer.run(1.0, ahead_s=3.0)
