"""The demo picks its workers' ports before the gateway binds its own, and `--processes` its
broker's before the children bind their metrics ports: neither may get a port promised to another
listener (which then fails to start, "Address already in use")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway import demo


def test_ports_skip_the_ones_promised_and_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    picks: Iterator[int] = iter([40001, 40002, 40001, 40003, 40004, 40005])
    monkeypatch.setattr(demo, "free_port", lambda: next(picks))

    # 40001 is the gateway's port, 40003 a metrics port: the kernel's picks skip them and repeats.
    assert demo.free_ports_except(3, {40001, 40003}) == [40002, 40004, 40005]
