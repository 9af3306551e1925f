"""`kvgate serve --processes N --sync-url URL` shares through the broker it is given: every
process connects to URL, with the token `--sync-token-env` names. The supervisor used to read only
the config's `sync.url`, so the flag was dropped and it started a nats-server of its own: the
processes shared among themselves and never with the replicas on URL."""

from __future__ import annotations

import secrets
import urllib.request
from pathlib import Path

from gateway.sync.broker import LocalBroker
from tests.e2e.harness import SECRET, free_port, metrics_urls, serving_processes, tenant, write_gateway_config
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
    args = ["--config", str(config), "--sync-url", broker.url, "--sync-token-env", TOKEN_ENV]
    broker.start()
    try:
        env = {"KVGATE_KEY_SECRET": SECRET.decode(), TOKEN_ENV: token}
        with serving_processes(*args, env=env) as (_, proc):
            assert f"sharing through {broker.url}\n" in proc.output(), proc.output()[-2000:]
            assert "a local nats-server" not in proc.output()
            for url in set(metrics_urls(proc)):
                wait_until_sync(lambda: _connected(url), 30, f"{url} connected to the given broker")  # noqa: B023
            assert proc.stop() == 0
    finally:
        broker.stop()
