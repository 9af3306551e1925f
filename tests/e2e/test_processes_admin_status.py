"""`kvgate serve --processes 2`: `GET /admin/status` is answered by whichever process the kernel
hands the connection, so it says which one it is (its index in the group and its pid)."""

from __future__ import annotations

from pathlib import Path

import httpx

from gateway.auth import hash_api_key
from tests.e2e.harness import SECRET, serving_processes
from tests.support.gateway_config import idle_gateway_config
from tests.support.wait import wait_until_sync

ADMIN_KEY = "sk-e2e-admin-0123456789abcdef0123456789"


def test_each_process_says_which_it_is(tmp_path: Path) -> None:
    config = idle_gateway_config(
        tmp_path / "gw.yaml",
        "sk-e2e-status-0123456789abcdef",
        admin={"api_key_hash": hash_api_key(SECRET, ADMIN_KEY)},
    )
    seen: dict[int, int] = {}

    def both_answered(base: str) -> bool:
        # A fresh client is a fresh connection: the kernel picks the process.
        with httpx.Client(timeout=10) as client:
            resp = client.get(base + "/admin/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 200, resp.text
        process = resp.json()["process"]
        seen[process["index"]] = process["pid"]
        return len(seen) == 2

    with serving_processes("--config", str(config), env={"KVGATE_KEY_SECRET": SECRET.decode()}) as (base, _):
        wait_until_sync(lambda: both_answered(base), 60, "both processes answered")
    assert set(seen) == {0, 1} and len(set(seen.values())) == 2
