"""Wrong admin keys throttled per client address: past the limit, 429 with `Retry-After` whatever
key follows, until the window passes; other addresses untouched; the table bounded however many
addresses send keys. The clock is the test's (`Clock`): no waiting for a window to pass."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp

from gateway.admin import admin_routes
from gateway.admin_throttle import AdminAuthThrottle, address_key
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.serve import load_policy
from gateway.state import GatewayState, build_state
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.inprocess import gateway_in_process
from tests.support.metrics import metric_total

SECRET = b"admin-throttle-test-secret-32-bytes"
RIGHT = {"authorization": "Bearer sk-admin"}
WRONG = {"authorization": "Bearer sk-wrong"}
FAILURES = "kvgate_admin_auth_failures_total"


class Clock:
    """Seconds that pass only when the test says (`advance`)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def time(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def _raw() -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],  # nothing listens
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-tenant")]}],
        "admin": {"api_key_hash": hash_api_key(SECRET, "sk-admin")},
    }


def _state() -> GatewayState:
    config = parse_config(_raw())
    return build_state(config, SECRET, load_policy(config)[0].policy, NormalizerConfig())


def _client(app: ASGIApp, host: str) -> httpx.AsyncClient:
    """A client whose requests reach `app` from the address `host`."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(host, 40000)), base_url="http://gw"
    )


def _admin_app(throttle: AdminAuthThrottle) -> Starlette:
    """The admin routes over a real state, with the test's throttle (its clock)."""
    return Starlette(routes=admin_routes(_state(), None, throttle))


async def _status(app: ASGIApp, host: str, headers: dict[str, str]) -> httpx.Response:
    async with _client(app, host) as client:
        return await client.get("/admin/status", headers=headers)


async def test_wrong_keys_past_the_limit_get_429_even_with_the_right_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(_raw())
    policy = load_policy(config)[0].policy
    caplog.set_level(logging.WARNING, logger="kvgate.admin")
    async with gateway_in_process(config, policy, secret=SECRET, workers_up=False) as gw:
        limit = AdminAuthThrottle().max_failures
        for _ in range(limit):
            resp = await gw.client.get("/admin/status", headers=WRONG)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"

        for method, path, headers in (
            ("GET", "/admin/status", WRONG),
            ("GET", "/admin/status", RIGHT),
            ("POST", "/admin/policy/reload", RIGHT),
            ("GET", "/admin/status", {}),
        ):
            resp = await gw.client.request(method, path, headers={**headers, "x-request-id": "ops-7"})
            assert resp.status_code == 429, (method, headers)
            assert 1 <= int(resp.headers["retry-after"]) <= 60
            assert resp.headers["x-request-id"] == "ops-7"
            wait = resp.headers["retry-after"]
            assert resp.json()["error"] == {
                "message": f"too many wrong admin keys from this address: try again in {wait} s",
                "type": "rate_limit_error",
                "param": None,
                "code": "admin_auth_throttled",
            }

        # Another address is unaffected, through the same app.
        async with _client(gw.app, "10.0.0.2") as other:
            assert (await other.get("/admin/status", headers=RIGHT)).status_code == 200

        assert metric_total(gw.state, FAILURES, result="wrong_key") == limit
        assert metric_total(gw.state, FAILURES, result="throttled") == 4

    lines = [r for r in caplog.records if r.name == "kvgate.admin"]
    assert len(lines) == 1 and "127.0.0.1" in lines[0].getMessage()
    logged = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    for secret in ("sk-wrong", "sk-admin", hash_api_key(SECRET, "sk-wrong").split(":")[1]):
        assert secret not in logged


async def test_the_window_passing_lets_the_right_key_in() -> None:
    clock = Clock()
    throttle = AdminAuthThrottle(max_failures=10, window_s=60.0, clock=clock.time)
    app = _admin_app(throttle)
    for _ in range(10):
        assert (await _status(app, "10.0.0.1", WRONG)).status_code == 401
        clock.advance(1.0)  # the window began at the first wrong key
    clock.advance(5.0)
    resp = await _status(app, "10.0.0.1", RIGHT)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "45"
    clock.advance(44.5)
    resp = await _status(app, "10.0.0.1", RIGHT)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    clock.advance(0.5)
    assert (await _status(app, "10.0.0.1", RIGHT)).status_code == 200

    # A new window; the right key under the limit resets nothing.
    for _ in range(9):
        assert (await _status(app, "10.0.0.1", WRONG)).status_code == 401
    assert (await _status(app, "10.0.0.1", RIGHT)).status_code == 200
    assert (await _status(app, "10.0.0.1", WRONG)).status_code == 401
    assert (await _status(app, "10.0.0.1", RIGHT)).status_code == 429


async def test_other_addresses_are_unaffected_and_an_ipv6_host_counts_by_its_64() -> None:
    throttle = AdminAuthThrottle(max_failures=3, clock=Clock().time)
    app = _admin_app(throttle)
    for host in ("2001:db8::1", "2001:db8::2", "2001:db8::ffff"):  # one /64
        assert (await _status(app, host, WRONG)).status_code == 401
    assert (await _status(app, "2001:db8::1234", RIGHT)).status_code == 429
    for host in ("2001:db8:0:1::1", "10.0.0.1", "127.0.0.1"):
        assert (await _status(app, host, RIGHT)).status_code == 200

    for _ in range(3):
        assert (await _status(app, "10.0.0.9", WRONG)).status_code == 401
    assert (await _status(app, "::ffff:10.0.0.9", RIGHT)).status_code == 429  # the same IPv4 host
    assert (await _status(app, "10.0.0.8", RIGHT)).status_code == 200


async def test_a_full_table_keeps_its_throttled_windows_and_shares_one_for_the_rest() -> None:
    clock = Clock()
    throttle = AdminAuthThrottle(max_failures=3, max_addresses=8, clock=clock.time)
    app = _admin_app(throttle)
    for _ in range(3):
        assert (await _status(app, "10.0.0.1", WRONG)).status_code == 401
    clock.advance(1.0)
    for i in range(6):  # full of live windows: 7, and one place kept for the shared window
        assert (await _status(app, f"10.1.0.{i}", WRONG)).status_code == 401
    assert len(throttle) == 7
    # New addresses neither push the throttled one out nor get budgets of their own.
    for i in range(3):
        assert (await _status(app, f"10.2.0.{i}", WRONG)).status_code == 401
    assert len(throttle) == 8
    assert (await _status(app, "10.0.0.1", RIGHT)).status_code == 429
    assert (await _status(app, "10.2.0.9", RIGHT)).status_code == 429  # the shared window is spent
    assert (await _status(app, "10.1.0.0", RIGHT)).status_code == 200  # a window of its own
    throttle.check_invariants()

    clock.advance(60.0)  # every window has passed
    assert (await _status(app, "10.0.0.1", RIGHT)).status_code == 200
    assert (await _status(app, "10.2.0.9", RIGHT)).status_code == 200


def test_spraying_addresses_buys_one_more_budget_a_window() -> None:
    clock = Clock()  # frozen: everything happens within one window
    limit, table = 10, 64
    throttle = AdminAuthThrottle(max_failures=limit, window_s=60.0, max_addresses=table, clock=clock.time)
    compared = 0
    for cycle in range(3):
        for i in range(table * 4):
            address = f"10.{cycle}.{i >> 8 & 255}.{i & 255}"
            for _ in range(limit):
                if throttle.refusal(address) is not None:
                    break
                compared += 1
                throttle.failed(address)
            assert len(throttle) <= table
    # Each address the table holds, plus the one shared window: nothing handed back.
    assert compared == (table - 1) * limit + limit
    throttle.check_invariants()


def test_many_addresses_never_grow_the_table() -> None:
    clock = Clock()
    throttle = AdminAuthThrottle(max_failures=2, window_s=60.0, max_addresses=64, clock=clock.time)
    for i in range(20_000):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
        assert len(throttle) <= 64
        clock.advance(0.001)
    throttle.check_invariants()

    # Once their windows pass, the addresses kept go before any newer one would.
    clock.advance(60.0)
    throttle.failed("192.0.2.1")
    assert len(throttle) == 1
    throttle.check_invariants()


def test_a_window_counts_from_its_first_wrong_key() -> None:
    clock = Clock()
    throttle = AdminAuthThrottle(max_failures=3, window_s=60.0, clock=clock.time)
    assert throttle.failed("a") is False
    clock.advance(59.0)
    assert throttle.failed("a") is False
    clock.advance(1.0)  # the first window has passed: a new one begins
    assert throttle.failed("a") is False and throttle.failed("a") is False
    assert throttle.refusal("a") is None
    assert throttle.failed("a") is True
    refused = throttle.refusal("a")
    assert refused is not None and refused.retry_after_s == 60
    throttle.check_invariants()


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8:0:0:ffff::1", "2001:db8::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("64:ff9b::192.0.2.7", "192.0.2.7"),
        ("64:ff9b::192.0.2.8", "192.0.2.8"),
        ("not-an-ip", "not-an-ip"),
        (None, ""),
    ],
)
def test_address_keys(host: str | None, key: str) -> None:
    assert address_key(host) == key
