"""The admin API in-process: authentication, status without content, policy reload with reasons."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayApp
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.config.base import ConfigError
from gateway.serve import load_policy
from gateway.state import GatewayState
from tests.support.inprocess import gateway_in_process
from tests.support.wait import wait_until

SECRET = b"admin-test-secret"
ADMIN = {"authorization": "Bearer sk-admin"}


@dataclass
class Admin:
    client: httpx.AsyncClient
    state: GatewayState
    policy_file: Path
    app: GatewayApp


def _config(tmp_path: Path, admin: bool = True, policy_file: bool = True) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "workers": ["http://127.0.0.1:9"],  # nothing listens: unhealthy, scrape fails
                "health": {"timeout_s": 0.2},
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-tenant")]}],
        "scrape": {"interval_s": 0.05, "timeout_s": 0.2},
    }
    if admin:
        raw["admin"] = {"api_key_hash": hash_api_key(SECRET, "sk-admin")}
    if policy_file:
        (tmp_path / "policy.yaml").write_text("policy: cost\n")
        raw["policy_file"] = str(tmp_path / "policy.yaml")
    return raw


async def _start(raw: dict[str, Any], tmp_path: Path) -> AsyncIterator[Admin]:
    config = parse_config(raw)
    loaded, watcher, swap = load_policy(config)
    normalizer = loaded.config.normalizer
    rig = gateway_in_process(
        config,
        loaded.policy,
        secret=SECRET,
        normalizer=normalizer,
        watcher=watcher,
        swap=swap,
        workers_up=False,  # its one worker is down on purpose
    )
    async with rig as gw:
        yield Admin(gw.client, gw.state, tmp_path / "policy.yaml", gw.app)


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[Admin]:
    async for rig in _start(_config(tmp_path), tmp_path):
        yield rig


async def test_admin_routes_need_the_admin_key(admin: Admin) -> None:
    for headers in ({}, {"authorization": "Bearer sk-tenant"}, {"authorization": "Bearer nope"}):
        resp = await admin.client.get("/admin/status", headers={**headers, "x-request-id": "ops-1"})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.headers["x-request-id"] == "ops-1"
        resp = await admin.client.post("/admin/policy/reload", headers=headers)
        assert resp.status_code == 401 and resp.headers["x-request-id"]
    assert (await admin.client.get("/admin/status", headers=ADMIN)).status_code == 200


async def test_two_authorization_fields_are_refused_whichever_comes_first(admin: Admin) -> None:
    for pair in (["Bearer sk-admin", "Bearer nope"], ["Bearer nope", "Bearer sk-admin"]):
        headers = [("authorization", value) for value in pair]
        assert (await admin.client.get("/admin/status", headers=headers)).status_code == 401
        assert (await admin.client.post("/admin/policy/reload", headers=headers)).status_code == 401


async def test_status_reports_workers_breakers_scrapes_and_policy(admin: Admin) -> None:
    async def scraped() -> dict[str, Any] | None:
        body: dict[str, Any] = (await admin.client.get("/admin/status", headers=ADMIN)).json()
        scrape = body["pools"][0]["workers"][0]["scrape"]
        return body if scrape is not None and scrape["failures"] > 0 else None

    body = await wait_until(scraped, what="the scraper reported")
    assert body["ready"] is True and body["draining"] is False
    (pool,) = body["pools"]
    (worker,) = pool["workers"]
    assert worker["url"] == "http://127.0.0.1:9"
    assert worker["healthy"] is False and worker["routable"] is False
    load = ("in_flight", "prefill_tokens", "prefill_pairs", "decode_tokens", "decode_context_tokens")
    assert {k: worker[k] for k in load} == dict.fromkeys(load, 0)
    assert worker["breaker"] == {"state": "closed", "consecutive_failures": 0}
    assert worker["scrape"]["age_s"] is None and worker["scrape"]["fresh"] is False
    assert worker["kv_events"] is None  # this pool subscribes to no KV events
    policy = body["policy"]
    assert policy["name"] == "cost" and policy["policy_file"]["policy"] == "cost"
    assert isinstance(policy["stats"]["counters"], dict)


async def test_reload_swaps_a_good_file_and_explains_a_bad_one(admin: Admin) -> None:
    admin.policy_file.write_text("policy: cost\ncost: {no_such_field: 1}\n")
    resp = await admin.client.post("/admin/policy/reload", headers=ADMIN)
    assert resp.status_code == 422
    body = resp.json()
    assert body["swapped"] is False and body["error"]["code"] == "policy_rejected"
    assert "no_such_field" in body["error"]["message"]
    assert body["policy_file"]["failures"] == 1 and admin.state.routing.policy_name == "cost"

    admin.policy_file.write_text("")  # truncated: refused, not read as the built-in defaults
    resp = await admin.client.post("/admin/policy/reload", headers=ADMIN)
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "policy_rejected"
    assert "empty" in resp.json()["error"]["message"] and admin.state.routing.policy_name == "cost"

    admin.policy_file.write_text("policy: least_load\n")
    resp = await admin.client.post("/admin/policy/reload", headers=ADMIN)
    assert resp.status_code == 200
    assert resp.json()["swapped"] is True and resp.json()["policy_file"]["policy"] == "least_load"
    assert admin.state.routing.policy_name == "least_load"

    resp = await admin.client.post("/admin/policy/reload", headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["unchanged"] is True


async def test_a_reload_reaches_what_the_request_path_holds(admin: Admin) -> None:
    """The app holds the narrow objects, not the state: a swap must land in those very objects."""
    before = admin.app.gate.keying.normalizers["p"]
    assert before.config.chars_per_token == 4
    admin.policy_file.write_text("policy: least_load\nnormalizer: {chars_per_token: 3}\n")
    resp = await admin.client.post("/admin/policy/reload", headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["swapped"] is True
    assert admin.app.routing.policy is admin.state.routing.policy
    assert admin.app.routing.policy_name == "least_load"
    after = admin.app.gate.keying.normalizers["p"]
    assert after is not before and after.config.chars_per_token == 3


async def test_reload_without_a_policy_file_is_a_conflict(tmp_path: Path) -> None:
    async for rig in _start(_config(tmp_path, policy_file=False), tmp_path):
        resp = await rig.client.post("/admin/policy/reload", headers=ADMIN)
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "no_policy_file"
        assert (await rig.client.get("/admin/status", headers=ADMIN)).json()["policy"]["policy_file"] is None


async def test_without_an_admin_key_the_routes_do_not_exist(tmp_path: Path) -> None:
    async for rig in _start(_config(tmp_path, admin=False), tmp_path):
        # Every method, the ones the routes take when configured or not: nothing shows they exist.
        for method in ("GET", "POST", "PUT"):
            for path in ("/admin/status", "/admin/policy/reload"):
                resp = await rig.client.request(method, path, headers=ADMIN)
                assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
                assert resp.headers["x-request-id"]


def test_admin_key_must_be_a_hash_and_not_a_tenant_key(tmp_path: Path) -> None:
    raw = _config(tmp_path)
    raw["admin"] = {"api_key_hash": "sk-admin"}
    with pytest.raises(ConfigError, match=r"admin\.api_key_hash"):
        parse_config(raw)
    raw["admin"] = {"api_key_hash": hash_api_key(SECRET, "sk-tenant")}
    with pytest.raises(ConfigError, match="must not also be a tenant"):
        parse_config(raw)
