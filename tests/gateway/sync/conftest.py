"""A real broker for the sync tests that need one, stopped by PID after each test: `broker` is
each kind in turn (nats-server, redis-server), `nats_broker` a nats-server alone for what only NATS
has."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sync.broker import LocalBroker
from tests.gateway.sync.brokers import BROKERS, TestBroker, local_broker


def _running(kind: str, tmp_path: Path) -> Iterator[TestBroker]:
    b = local_broker(kind, tmp_path)
    try:
        yield b
    finally:
        if b.child is not None:
            os.kill(b.child.proc.pid, signal.SIGCONT)  # a test may have stopped it (SIGSTOP)
        b.stop()


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestBroker]:
    yield from _running(request.param, tmp_path)


@pytest.fixture
def nats_broker(tmp_path: Path) -> Iterator[LocalBroker]:
    for b in _running("nats", tmp_path):
        assert isinstance(b, LocalBroker)
        yield b
