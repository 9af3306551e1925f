"""The sentinels' own secret (`sync.sentinel_auth`) is read at start with `sync.auth`'s
(docs/config.md, docs/sync.md): a missing one stops `kvgate serve` with exit code 2 and one line
naming the field, before any process starts, never inside the server's startup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config.base import ConfigError
from gateway.config.sync import SyncConfig
from gateway.sync.auth import SentinelCredentials, sentinel_credentials
from tests.support.gateway_config import SECRET, tenant

URL = "redis+sentinel://127.0.0.1:9/m"


def test_sentinel_credentials_name_the_field_not_the_value(tmp_path: Path) -> None:
    secret_file = tmp_path / "sentinel"
    secret_file.write_text("s3ntinel-secret\n")
    cases: list[tuple[dict[str, str], dict[str, str], str]] = [
        ({"token_file": str(tmp_path / "missing")}, {}, r"sync\.sentinel_auth\.token_file: cannot read"),
        ({"token_env": "NOPE"}, {}, "sync.sentinel_auth.token_env: environment variable NOPE is not set"),
        ({"user": "u", "password_env": "P"}, {"P": ""}, r"sync\.sentinel_auth\.password_env"),
    ]
    for auth, environ, message in cases:
        with pytest.raises(ConfigError, match=message):
            sentinel_credentials(SyncConfig(url=URL, sentinel_auth=auth), environ)
    assert sentinel_credentials(SyncConfig(url=URL), {}) == SentinelCredentials(None, None)
    got = sentinel_credentials(SyncConfig(url=URL, sentinel_auth={"token_file": str(secret_file)}), {})
    assert got == SentinelCredentials(None, "s3ntinel-secret")
    got = sentinel_credentials(
        SyncConfig(url=URL, sentinel_auth={"user": "watcher", "password_env": "P"}), {"P": "pw"}
    )
    assert got == SentinelCredentials("watcher", "pw")


@pytest.mark.parametrize(
    ("processes", "sentinel_auth", "message"),
    [
        ("1", {"token_file": "missing"}, "sync.sentinel_auth.token_file: cannot read"),
        ("2", {"token_file": "missing"}, "sync.sentinel_auth.token_file: cannot read"),
        (
            "1",
            {"token_env": "KVGATE_TEST_UNSET"},
            "sync.sentinel_auth.token_env: environment variable KVGATE_TEST_UNSET is not set",
        ),
    ],
)
def test_serve_stops_at_start_on_a_missing_sentinel_secret(
    tmp_path: Path, processes: str, sentinel_auth: dict[str, str], message: str
) -> None:
    path = tmp_path / "gw.yaml"
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [tenant("t", "sk-t")],
        "secrets": {"key_hash_secret_env": "KVGATE_TEST_SECRET"},
        "sync": {"url": URL, "sentinel_auth": sentinel_auth},
    }
    path.write_text(yaml.safe_dump(config))
    environ = {k: v for k, v in os.environ.items() if k != "KVGATE_TEST_UNSET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--config",
            str(path),
            "--port",
            "0",
            "--processes",
            processes,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**environ, "KVGATE_TEST_SECRET": SECRET.decode()},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(message) == 1, proc.stderr  # said once, before any process starts
    assert "Traceback" not in proc.stderr
