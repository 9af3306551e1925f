"""`kvgate serve --processes N`: a ready process renews its readiness file while it runs, so a
cleaner of old temporary files that deletes it (systemd-tmpfiles, tmpreaper) does not leave
process 0's `/readyz` waiting for that process for ever (the file used to be written once)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.auth import hash_api_key
from gateway.lifecycle import PEERS_READY_ENV, READY_FILE_ENV
from policies import make_policy
from tests.support.inprocess import gateway_in_process
from tests.support.wait import wait_until


def _config() -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        "scrape": {"enabled": False},
    }


async def test_a_deleted_readiness_file_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = tmp_path / "ready-1"
    monkeypatch.setenv(READY_FILE_ENV, str(own))
    monkeypatch.setenv(PEERS_READY_ENV, json.dumps([]))
    async with gateway_in_process(_config(), make_policy("round_robin"), secret=b"k", workers_up=False):
        await wait_until(own.exists, 10, "the process says it is ready")
        before = own.stat().st_mtime_ns
        await wait_until(lambda: own.stat().st_mtime_ns > before, 10, "the file is renewed")
        own.unlink()  # a /tmp cleaner
        await wait_until(own.exists, 10, "the file is written again")
