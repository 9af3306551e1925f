"""Readiness with Kubernetes discovery: `/readyz` stays 503 until every discovering pool's first
pod list has arrived and its first workers have been checked (or until the API server refuses
in a way waiting will not fix), while `/healthz` answers throughout; the pools start together."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway import fleet as fleet_module
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.discovery import Discovery
from gateway.fleet import Fleet
from gateway.k8s import source as source_module
from gateway.state import build_state
from policies import make_policy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.gateway.fake_kube_api import FakeKubeApi, make_pod
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_health_only
from tests.support.wait import wait_until


@pytest.fixture
def no_first_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start waits for no first list: what comes after it is readiness's to wait for."""
    monkeypatch.setattr(fleet_module, "FIRST_WAIT_S", 0.0)


def _config(fake: FakeKubeApi, tmp_path: Path, pools: list[str]) -> dict[str, Any]:
    (tmp_path / "token").write_text("tok-1")

    def pool(name: str) -> dict[str, Any]:
        k8s = {
            "namespace": "llm",
            "selector": {"app": name},
            "port": "http",
            "api_server": fake.url,
            "token_file": str(tmp_path / "token"),
        }
        return {
            "name": name,
            "models": [f"m-{name}"],
            "kubernetes": k8s,
            "health": {"interval_s": 30, "timeout_s": 10},
        }

    return {
        "pools": [pool(name) for name in pools],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(b"k", "sk")]}],
        "scrape": {"enabled": False},
    }


async def _probe(gw: InProcessGateway, path: str) -> tuple[int, dict[str, Any]]:
    resp = await gw.client.get(path)
    return resp.status_code, resp.json()


def _gateway(fake: FakeKubeApi, tmp_path: Path) -> contextlib.AbstractAsyncContextManager[InProcessGateway]:
    """A gateway whose pool `p` is discovered through the fake API server; it starts without
    waiting for its workers (readiness is what the tests watch)."""
    config = _config(fake, tmp_path, ["p"])
    return gateway_in_process(config, make_policy("round_robin"), secret=b"k", workers_up=False)


async def _ready(gw: InProcessGateway) -> None:
    """Wait until the gateway is ready, and check its `/readyz` says so."""
    await wait_until(lambda: gw.state.lifecycle.ready)
    assert (await _probe(gw, "/readyz"))[0] == 200


async def test_readyz_waits_for_the_first_list_and_its_health_check(
    fake: FakeKubeApi, tmp_path: Path, no_first_wait: None
) -> None:
    runner, port = await serve_health_only()
    fake.put(make_pod("a", port=port, labels={"app": "p"}))
    fake.hold_lists()
    try:
        async with _gateway(fake, tmp_path) as gw:
            await wait_until(lambda: fake.lists_held == 1)
            status, body = await _probe(gw, "/readyz")
            assert status == 503 and body["status"] == "starting" and "1 pool" in body["reason"]
            assert await _probe(gw, "/healthz") == (200, {"status": "ok"})  # alive meanwhile
            assert not gw.state.lifecycle.ready
            pool = gw.state.registry.pools["p"]
            assert not pool.workers
            fake.release_lists()
            answers: list[tuple[int, bool]] = []

            async def ready() -> bool:
                status, _ = await _probe(gw, "/readyz")
                healthy = [w.view(time.monotonic()).healthy for w in pool.workers.values()]
                answers.append((status, healthy == [True]))
                return status == 200

            await wait_until(ready)
            # Ready only once the listed worker had been checked: never 200 with a pool not yet
            # routable.
            assert all(routable for status, routable in answers if status == 200)
            assert gw.state.lifecycle.ready
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("code", "reason"), [(403, "Forbidden"), (404, "NotFound"), (401, "Unauthorized")])
async def test_an_error_waiting_will_not_fix_makes_the_gateway_ready_with_an_empty_pool(
    fake: FakeKubeApi, tmp_path: Path, no_first_wait: None, code: int, reason: str
) -> None:
    """A Role that may not list pods must not hold every pool of the gateway unready: the error
    is counted, the pool is empty, and it fills once the Role is fixed."""
    runner, port = await serve_health_only()
    fake.put(make_pod("a", port=port, labels={"app": "p"}))
    fake.list_error = (code, reason)
    try:
        async with _gateway(fake, tmp_path) as gw:
            await _ready(gw)
            text = gw.state.routing.metrics.render().decode()
            assert 'kvgate_discovery_errors_total{pool="p",reason="list"}' in text
            assert 'kvgate_discovery_workers{pool="p"} 0.0' in text
            fake.list_error = None
            pool = gw.state.registry.pools["p"]
            await wait_until(lambda: set(pool.workers) == {f"http://127.0.0.1:{port}"})
    finally:
        await runner.cleanup()


async def test_an_api_server_failing_with_5xx_keeps_the_gateway_unready(
    fake: FakeKubeApi, tmp_path: Path, no_first_wait: None
) -> None:
    runner, port = await serve_health_only()
    fake.put(make_pod("a", port=port, labels={"app": "p"}))
    fake.list_error = (500, "InternalError")
    try:
        async with _gateway(fake, tmp_path) as gw:
            await wait_until(lambda: fake.lists >= 3)  # failed, and retried twice
            status, body = await _probe(gw, "/readyz")
            assert status == 503 and "pool" in body["reason"]
            fake.list_error = None
            await wait_until(lambda: gw.state.lifecycle.ready)
            assert set(gw.state.registry.pools["p"].workers) == {f"http://127.0.0.1:{port}"}
    finally:
        await runner.cleanup()


async def test_an_api_server_failing_for_first_list_wait_s_makes_the_gateway_ready_with_an_empty_pool(
    fake: FakeKubeApi, tmp_path: Path, no_first_wait: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readiness waits for an API server answering 5xx, but not for good (`FIRST_LIST_WAIT_S`,
    0 here: the first failure ends the wait); the pool fills once the API server answers."""
    monkeypatch.setattr(source_module, "FIRST_LIST_WAIT_S", 0.0)
    runner, port = await serve_health_only()
    fake.put(make_pod("a", port=port, labels={"app": "p"}))
    fake.list_error = (500, "InternalError")
    try:
        async with _gateway(fake, tmp_path) as gw:
            await _ready(gw)
            pool = gw.state.registry.pools["p"]
            assert not pool.workers
            fake.list_error = None
            await wait_until(lambda: set(pool.workers) == {f"http://127.0.0.1:{port}"})
    finally:
        await runner.cleanup()


class _Crashing:
    """A watching source with a bug: its task ends before it has reported anything."""

    async def prepare(self) -> None:
        pass

    async def run(self, sink: Any) -> None:
        raise RuntimeError("a bug before the first list")


async def test_a_crashed_discovery_settles_its_pool_as_it_stands(
    fake: FakeKubeApi, tmp_path: Path, no_first_wait: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discovery task that died will never report: readiness must not wait for it for good.
    The crash is counted, and the gateway is ready with the pool empty."""
    monkeypatch.setattr(fleet_module, "worker_source", lambda config: _Crashing())
    async with _gateway(fake, tmp_path) as gw:
        await _ready(gw)
        text = gw.state.routing.metrics.render().decode()
        assert 'kvgate_discovery_errors_total{pool="p",reason="crashed"} 1.0' in text
        assert not gw.state.registry.pools["p"].workers


async def test_the_pools_lists_are_asked_for_together(
    fake: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three pools behind a slow API server: all three lists are under way at once, so the start
    waits once for them, not once per pool (each start would otherwise wait its `FIRST_WAIT_S`
    before the next pool's list is sent)."""

    class Patient(Discovery):
        """Each start waits as long as its list takes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "first_wait_s": 60.0})

    monkeypatch.setattr(fleet_module, "Discovery", Patient)
    names = ["a", "b", "c"]
    for i, name in enumerate(names):
        fake.put(make_pod(f"pod-{name}", port=9000 + i, labels={"app": name}))
    fake.hold_lists()
    state = build_state(
        parse_config(_config(fake, tmp_path, names)), b"k", make_policy("round_robin"), NormalizerConfig()
    )
    async with aiohttp.ClientSession() as session:
        fleet = Fleet(state.config, state.registry, state.routing, {}, session)

        start = asyncio.create_task(fleet.start())
        try:
            await wait_until(lambda: fake.lists_held == 3)
            assert not start.done() and fleet.discovering() == names
            fake.release_lists()
            await start
            assert {n: len(state.registry.pools[n].workers) for n in names} == dict.fromkeys(names, 1)
        finally:
            fake.release_lists()
            start.cancel()
            await fleet.stop()


class _SwallowsItsCancel:
    """A watching source that, told to stop, fails in its cleanup instead of ending cancelled."""

    def __init__(self) -> None:
        self.running = asyncio.Event()

    async def prepare(self) -> None:
        pass

    async def run(self, sink: Any) -> None:
        self.running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None


async def test_a_source_stopped_is_no_crash_however_it_ends() -> None:
    source = _SwallowsItsCancel()
    errors: list[str] = []
    discovery = Discovery(source, on_error=errors.append, first_wait_s=0.0)
    await discovery.start(lambda change: None)
    await source.running.wait()
    await discovery.stop()
    assert errors == []
