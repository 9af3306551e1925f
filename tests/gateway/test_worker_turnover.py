"""What the policy keeps of a worker ends with the process at its URL, through a running gateway:
a worker that discovery removes is forgotten (and a request it finishes afterwards teaches nothing),
one that comes back starts empty, a static worker that health checks take down and see back
(a restart in place) loses its holdings both times, and so does one whose metrics show a new
process before any health check failed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from policies import make_policy
from policies.base import RoutingPolicy
from policies.stats import IndexStats, SupportsStats
from tests.gateway.worker_rig import SECRET, SERVICE, Worker, chat, gateway_config, scripted_dns, start_worker
from tests.support.inprocess import gateway_in_process
from tests.support.wait import wait_until

# Prompts of many blocks, whatever the block size: a dispatch leaves holdings in the index.
PROMPT = " ".join(f"word{i}" for i in range(600))
OTHER = " ".join(f"other{i}" for i in range(600))


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await start_worker()
    try:
        yield w
    finally:
        await w.runner.cleanup()


@contextlib.asynccontextmanager
async def released(worker: Worker) -> AsyncIterator[None]:
    """Whatever the block leaves held at `worker` is answered when it ends, so that a failing test
    ends too (the gateway's shutdown waits for the requests it is proxying)."""
    try:
        yield
    finally:
        worker.hold.set()
        worker.healthy.set()


def index_of(policy: RoutingPolicy) -> IndexStats:
    assert isinstance(policy, SupportsStats)
    return policy.stats().index["p"]


async def test_a_worker_discovery_removes_is_forgotten_and_comes_back_empty(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    dns = scripted_dns(monkeypatch, ["127.0.0.1"])
    policy = make_policy("cost")
    config = gateway_config(
        {"dns": {"name": SERVICE, "port": worker.port, "refresh_s": 0.05, "empty_after_s": 0}}
    )
    async with gateway_in_process(config, policy, secret=SECRET) as gw, released(worker):
        pool = gw.state.registry.pools["p"]
        assert (await chat(gw, PROMPT))[0] == 200
        assert index_of(policy).entries > 0
        worker.hold.clear()
        late = asyncio.ensure_future(chat(gw, OTHER))
        await wait_until(lambda: len(worker.arrived) == 2, what="the second request is at the worker")
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        await wait_until(lambda: not pool.workers, what="the pool is empty")
        stats = index_of(policy)
        assert (stats.workers, stats.entries) == (0, 0)
        worker.hold.set()  # the request still running there finishes after the worker left
        assert (await late)[0] == 200
        stats = index_of(policy)
        assert (stats.workers, stats.entries) == (0, 0)
        dns.answer = ["127.0.0.1"]  # the same address again: as good as a new process
        await wait_until(lambda: any(w.healthy for w in pool.workers.values()), what="the worker is back")
        assert index_of(policy).entries == 0
        assert (await chat(gw, PROMPT))[0] == 200
        assert index_of(policy).entries > 0


async def test_a_static_worker_restarted_in_place_loses_its_holdings(worker: Worker) -> None:
    policy = make_policy("cost")
    config = gateway_config({"workers": [worker.url], "health": {"interval_s": 0.05, "failures_to_down": 2}})
    async with gateway_in_process(config, policy, secret=SECRET) as gw, released(worker):
        entry = next(iter(gw.state.registry.pools["p"].workers.values()))
        assert (await chat(gw, PROMPT))[0] == 200
        assert index_of(policy).entries > 0
        worker.hold.clear()
        draining = asyncio.ensure_future(chat(gw, OTHER))
        await wait_until(lambda: len(worker.arrived) == 2, what="the second request is at the worker")
        worker.healthy.clear()
        await wait_until(lambda: not entry.healthy, what="the worker is down")
        assert index_of(policy).entries == 0  # down: what it held may be gone with its process
        worker.hold.set()  # a request it finishes while down (draining) is recorded again...
        assert (await draining)[0] == 200
        assert index_of(policy).entries > 0
        worker.healthy.set()
        await wait_until(lambda: entry.healthy, what="the worker is back")
        assert index_of(policy).entries == 0  # ...and forgotten when it is back: a new process
        assert index_of(policy).workers == 1  # still a member, its capacity kept


def vllm_page(queries: int, started_s: float | None = None) -> str:
    page = f"vllm:num_requests_running 0.0\nvllm:prefix_cache_queries_total {queries}.0\n"
    return page + (f"process_start_time_seconds {started_s}\n" if started_s is not None else "")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (vllm_page(5000), vllm_page(0)),  # its counters start again from 0
        (vllm_page(5000, 1.7e9), vllm_page(9000, 1.7e9 + 60)),  # a new process start time
    ],
    ids=["counter_went_down", "new_start_time"],
)
async def test_a_worker_whose_metrics_show_a_new_process_loses_its_holdings(
    worker: Worker, before: str, after: str
) -> None:
    policy = make_policy("cost")
    config = {
        **gateway_config({"workers": [worker.url], "health": {"interval_s": 30.0}}),
        "scrape": {"interval_s": 0.05},
    }
    worker.metrics = before
    async with gateway_in_process(config, policy, secret=SECRET) as gw, released(worker):
        entry = next(iter(gw.state.registry.pools["p"].workers.values()))
        await wait_until(lambda: entry.healthy, what="the worker is up")
        restarts = gw.state.routing.metrics.worker_restarts.labels("p")
        await wait_until(lambda: worker.scrapes > 0, what="a first scrape")
        assert (await chat(gw, PROMPT))[0] == 200
        assert index_of(policy).entries > 0
        worker.metrics = before.replace("5000", "6000")  # the same process, counting on
        seen = worker.scrapes
        await wait_until(lambda: worker.scrapes > seen + 1, what="a scrape of the new page")
        assert index_of(policy).entries > 0
        worker.metrics = after
        await wait_until(lambda: index_of(policy).entries == 0, what="the holdings are cleared")
        assert index_of(policy).workers == 1  # still a member, its capacity kept
        assert entry.healthy  # no health check failed
        assert restarts.value == 1
