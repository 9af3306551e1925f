"""`kvgate serve --processes N --sync-url URL` shares through the broker it is given: every
process connects to URL, with the token `--sync-token-env` names. The supervisor used to read only
the config's `sync.url`, so the flag was dropped and it started a nats-server of its own: the
processes shared among themselves and never with the replicas on URL."""

from __future__ import annotations

import secrets
import sys
import urllib.request
from pathlib import Path

from gateway.sync.broker import LocalBroker
from tests.e2e.harness import SECRET, free_port, metrics_urls, start, tenant, wait_http, write_gateway_config
from tests.support.wait import wait_until_sync

TOKEN_ENV = "TEST_SYNC_TOKEN"


def _connected(metrics_url: str) -> bool:
    with urllib.request.urlopen(metrics_url, timeout=2) as resp:
        text: str = resp.read().decode()
    return "\nkvgate_sync_connected 1.0\n" in text


def test_processes_share_through_the_sync_url_flag_with_its_token(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    broker = LocalBroker(free_port(), tmp_path, token=token)
    pools = [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:1"]}]
    config = write_gateway_config(tmp_path / "gw.yaml", pools, [tenant("t", "sk-t")])
    port = free_port()
    argv = [
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--processes", "2",
        "--port", str(port), "--metrics-port", "0", "--sync-url", broker.url, "--sync-token-env", TOKEN_ENV,
    ]  # fmt: skip
    broker.start()
    try:
        proc = start(argv, env={"KVGATE_KEY_SECRET": SECRET.decode(), TOKEN_ENV: token})
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz", proc, timeout_s=60)
            wait_until_sync(lambda: len(set(metrics_urls(proc))) == 2, 30, "every process listens")
            assert f"sharing through {broker.url}\n" in proc.output(), proc.output()[-2000:]
            assert "a local nats-server" not in proc.output()
            for url in set(metrics_urls(proc)):
                wait_until_sync(lambda: _connected(url), 30, f"{url} connected to the given broker")  # noqa: B023
        finally:
            assert proc.stop() == 0
    finally:
        broker.stop()
