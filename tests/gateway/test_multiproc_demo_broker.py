"""`kvgate serve --demo --processes N` without a nats-server to start stops before the demo does:
it used to start the emulated workers and print where to connect, then exit on the missing
broker. With `--sync-url` there is nothing to start, and the demo runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from gateway import demo, multiproc, serve
from gateway.config.base import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--demo", "--processes", "2", *argv])
    serve.apply_mode_flags(args)
    return args


@pytest.fixture
def demo_runs(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """No nats-server anywhere, and a demo that records its start instead of starting workers."""
    runs: list[argparse.Namespace] = []

    def run_demo(args: argparse.Namespace, _serve: Callable[..., int]) -> int:
        runs.append(args)
        return 0

    monkeypatch.setattr(multiproc, "nats_server_path", lambda: None, raising=False)
    monkeypatch.setattr("gateway.sync.broker.nats_server_path", lambda: None)
    monkeypatch.setattr(demo, "run_demo", run_demo)
    return runs


def test_without_a_nats_server_the_demo_never_starts(demo_runs: list[argparse.Namespace]) -> None:
    with pytest.raises(ConfigError, match="--processes needs a sync broker: nats-server not found"):
        multiproc.supervise(_args())
    assert demo_runs == []


def test_with_a_sync_url_no_local_broker_is_needed(demo_runs: list[argparse.Namespace]) -> None:
    assert multiproc.supervise(_args("--sync-url", "nats://127.0.0.1:4222")) == 0
    assert len(demo_runs) == 1
