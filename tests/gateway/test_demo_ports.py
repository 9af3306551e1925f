"""The demo picks its workers' ports before the gateway binds its own: a worker must never get the
gateway's port (the gateway then fails to start, "Address already in use")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway import demo


def test_worker_ports_skip_the_gateways_ports_and_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    picks: Iterator[int] = iter([40001, 40002, 40001, 40003, 40004, 40005])
    monkeypatch.setattr(demo, "free_port", lambda: next(picks))

    # 40001 is the gateway's port, 40003 a metrics port: the kernel's picks skip them and repeats.
    assert demo.worker_ports(3, {40001, 40003}) == [40002, 40004, 40005]
