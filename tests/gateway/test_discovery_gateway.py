"""DNS discovery through a running gateway: a headless Service scaled to zero (cluster DNS answers
NXDOMAIN) empties the pool, whose requests then get the gateway's "no worker" error, and the
workers found again serve; a DNS outage keeps the workers."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from policies import make_policy
from tests.gateway.worker_rig import SECRET, SERVICE, Worker, chat, gateway_config, scripted_dns, start_worker
from tests.support.inprocess import gateway_in_process
from tests.support.wait import wait_until


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker()
    try:
        yield w
    finally:
        await w.runner.cleanup()


def dns_pool(port: int) -> dict[str, Any]:
    return gateway_config({"dns": {"name": SERVICE, "port": port, "refresh_s": 0.05, "empty_after_s": 0}})


async def test_a_service_scaled_to_zero_answers_no_worker_then_serves_again(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = scripted_dns(monkeypatch, ["127.0.0.1"])
    async with gateway_in_process(dns_pool(worker.port), make_policy("round_robin"), secret=SECRET) as gw:
        pool = gw.state.registry.pools["p"]
        assert (await chat(gw, "before"))[0] == 200 and worker.served == ["before"]
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await wait_until(lambda: not pool.workers, what="the pool is empty")
        status, body = await chat(gw, "during")
        assert status == 503 and body["error"]["code"] == "no_worker_available"
        assert body["error"]["message"] == "no healthy worker available for model 'm'"
        assert worker.served == ["before"]
        text = gw.state.routing.metrics.render().decode()
        assert 'kvgate_discovery_workers{pool="p"} 0.0' in text
        assert 'kvgate_discovery_errors_total{pool="p",reason="no_addresses"} 1.0' in text
        dns.answer = ["127.0.0.1"]
        await wait_until(lambda: any(w.healthy for w in pool.workers.values()), what="the worker is back")
        assert (await chat(gw, "after"))[0] == 200 and worker.served == ["before", "after"]


async def test_a_dns_outage_keeps_the_workers(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    dns = scripted_dns(monkeypatch, ["127.0.0.1"])
    async with gateway_in_process(dns_pool(worker.port), make_policy("round_robin"), secret=SECRET) as gw:
        pool = gw.state.registry.pools["p"]
        dns.answer = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        seen = dns.lookups
        await wait_until(lambda: dns.lookups >= seen + 5, what="five failed lookups")
        assert len(pool.workers) == 1
        assert (await chat(gw, "still"))[0] == 200 and worker.served == ["still"]


async def test_empty_after_sets_how_many_answers_of_no_addresses_empty_the_pool(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = scripted_dns(monkeypatch, ["127.0.0.1"])
    dns_config = {
        "name": SERVICE,
        "port": worker.port,
        "refresh_s": 0.05,
        "empty_after": 50,
        "empty_after_s": 0,
    }
    config = gateway_config({"dns": dns_config})
    async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
        pool = gw.state.registry.pools["p"]
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        seen = dns.lookups
        await wait_until(lambda: dns.lookups >= seen + 5, what="five answers of no addresses")
        assert len(pool.workers) == 1  # 5 (or a few more) of the 50 in a row
        await wait_until(lambda: not pool.workers, timeout_s=30, what="the pool is empty")
        assert dns.lookups >= seen + 50


async def test_empty_after_s_keeps_the_pool_through_answers_of_no_addresses_in_quick_succession(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two answers in a row are not enough while they span less than `empty_after_s` (one negative
    answer a resolver cached and gave again); the pool keeps its worker, which still serves."""
    dns = scripted_dns(monkeypatch, ["127.0.0.1"])
    dns_config = {"name": SERVICE, "port": worker.port, "refresh_s": 0.05, "empty_after_s": 3600}
    async with gateway_in_process(
        gateway_config({"dns": dns_config}), make_policy("round_robin"), secret=SECRET
    ) as gw:
        pool = gw.state.registry.pools["p"]
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        seen = dns.lookups
        await wait_until(lambda: dns.lookups >= seen + 5, what="five answers of no addresses")
        assert len(pool.workers) == 1
        assert (await chat(gw, "still"))[0] == 200 and worker.served == ["still"]
