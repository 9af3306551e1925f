"""In-process checks of failure paths that need a misbehaving policy (no real worker involved)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

from gateway.app import drain
from gateway.auth import hash_api_key
from gateway.config import parse_config
from gateway.state import GatewayState
from policies import make_policy
from policies.base import RouteDecision, RouteRequest, WorkerId, WorkerView
from tests.gateway.access_lines import capture_access
from tests.support.inprocess import gateway_in_process
from tests.support.policies import IgnoresFeedback
from tests.support.wait import wait_until

SECRET = b"k"


class BrokenPolicy(IgnoresFeedback):
    """Raises from select: the gateway must answer 500 and give the tenant's slot back."""

    name = "broken"

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        raise RuntimeError("policy bug")


async def test_a_policy_exception_is_a_500_and_releases_the_quota_slot() -> None:
    config = parse_config(
        {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "workers": ["http://127.0.0.1:9"],
                    "health": {"timeout_s": 0.2},
                }
            ],
            "tenants": [
                {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")], "quotas": {"max_concurrent": 1}}
            ],
            "scrape": {"enabled": False},
        }
    )
    async with gateway_in_process(config, BrokenPolicy(), secret=SECRET, workers_up=False) as gw:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        for _ in range(2):  # the second would be 429 if the first leaked its slot
            resp = await gw.client.post(
                "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"}
            )
            assert resp.status_code == 500
            assert resp.json()["error"]["code"] == "internal_error"
    assert gw.state.gate.limiters["t"].in_flight == 0


async def _handle_hanging(
    held: list[bytes], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    # A worker that answers health checks but never finishes a completion (it keeps it in `held`).
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET"):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()
        return
    held.append(head)
    await reader.read()  # hold the request until the gateway hangs up


@dataclass
class _Stack:
    state: GatewayState
    client: httpx.AsyncClient
    worker_url: str
    held: list[bytes]  # the heads of the completions the worker holds

    async def chat(self, headers: Mapping[str, str] | None = None) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=BODY, headers=headers or HEADERS)


@contextlib.asynccontextmanager
async def _in_front_of_a_hanging_worker(
    pool: Mapping[str, object] | None = None, **config: object
) -> AsyncIterator[_Stack]:
    """A gateway (in-process, round_robin) in front of one worker that never answers a completion;
    `pool` adds to the pool's config, `config` to the top level."""
    held: list[bytes] = []
    worker = await asyncio.start_server(functools.partial(_handle_hanging, held), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{worker.sockets[0].getsockname()[1]}"
    timeouts = {"connect_s": 0.3, "read_s": 30}
    raw = {
        "pools": [{"name": "p", "models": ["m"], "workers": [url], "timeouts": timeouts, **(pool or {})}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "scrape": {"enabled": False},
        **config,  # may replace the tenants
    }
    try:
        async with gateway_in_process(raw, make_policy("round_robin"), secret=SECRET) as gw:
            yield _Stack(gw.state, gw.client, url, held)
    finally:
        worker.close()
        await worker.wait_closed()


BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
HEADERS = {"authorization": "Bearer sk"}


async def test_a_worker_at_its_connection_cap_is_a_503_with_retry_after() -> None:
    # With one connection allowed per worker, a second request waits connect_s for it, then 503.
    async with _in_front_of_a_hanging_worker(upstream={"max_connections_per_worker": 1}) as stack:
        held = asyncio.create_task(stack.chat())
        await wait_until(lambda: stack.held)  # the first request holds the only connection
        resp = await stack.chat()
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["message"].startswith("worker at its connection limit")
        assert stack.state.registry.pools["p"].workers[WorkerId(stack.worker_url)].breaker.allows(0.0)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_a_pool_whose_workers_are_all_at_their_cap_says_so_without_a_queue() -> None:
    # The worker is up and holds its one request: the 503 says it is full, not that none is healthy.
    pool = {"max_in_flight_per_worker": 1, "queue": {"enabled": False}}
    async with _in_front_of_a_hanging_worker(pool) as stack:
        held = asyncio.create_task(stack.chat())
        await wait_until(lambda: stack.held)
        resp = await stack.chat()
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        error = resp.json()["error"]
        assert error["code"] == "no_worker_available"
        assert error["message"] == "every available worker for model 'm' is at its request limit"
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_requests_beyond_the_in_flight_limit_get_503_at_once() -> None:
    async with _in_front_of_a_hanging_worker(limits={"max_in_flight_requests": 2}) as stack:
        held = [asyncio.create_task(stack.chat()) for _ in range(2)]
        await wait_until(lambda: stack.state.lifecycle.in_flight_requests == 2)
        resp = await stack.chat()
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "gateway_overloaded"
        assert (await stack.client.get("/healthz")).status_code == 200  # probes are not counted
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await wait_until(lambda: stack.state.lifecycle.in_flight_requests == 0)  # every slot came back


async def test_a_tenant_holding_the_whole_in_flight_limit_leaves_another_its_share() -> None:
    # Tenant "b" holds every place of the limit; "a", with nothing in flight, is still served, up
    # to its share (4 of 8), and "b" gets no new place until the process is back under the limit.
    tenants = [
        {"name": "a", "api_key_hashes": [hash_api_key(SECRET, "sk-a")]},
        {"name": "b", "api_key_hashes": [hash_api_key(SECRET, "sk-b")]},
    ]
    async with _in_front_of_a_hanging_worker(limits={"max_in_flight_requests": 8}, tenants=tenants) as stack:
        as_b = {"authorization": "Bearer sk-b"}
        as_a = {"authorization": "Bearer sk-a"}
        b_held = [asyncio.create_task(stack.chat(as_b)) for _ in range(8)]
        await wait_until(lambda: len(stack.held) == 8)
        resp = await stack.chat(as_b)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "gateway_overloaded"
        a_held = [asyncio.create_task(stack.chat(as_a)) for _ in range(4)]
        await wait_until(lambda: len(stack.held) == 12)  # every one of a's reached the worker
        for resp in [await stack.chat(as_a), await stack.chat(as_b)]:
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "gateway_overloaded"
            assert resp.headers["retry-after"] == "1"
        cap = stack.state.lifecycle.requests
        assert cap is not None and cap.held == 12
        cap.check_invariants()
        for task in [*b_held, *a_held]:
            task.cancel()
        await asyncio.gather(*b_held, *a_held, return_exceptions=True)
        await wait_until(lambda: stack.state.lifecycle.in_flight_requests == 0)
        assert cap.active_units == 0


async def test_the_drain_deadline_answers_requests_still_waiting_on_a_worker_or_queued_with_503() -> None:
    # One whole answer still awaited from the worker, one request queued behind it (one slot per
    # worker): at the deadline the gateway answers both itself and gives everything back once.
    async with _in_front_of_a_hanging_worker(pool={"max_in_flight_per_worker": 1}) as stack:
        state = stack.state
        lines = capture_access(state)
        waiting = [asyncio.create_task(stack.chat()) for _ in range(2)]
        await wait_until(lambda: stack.held and state.routing.queues["p"].waiting == 1)
        await drain(state, 0.0)
        for resp in await asyncio.gather(*waiting):
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
            assert resp.json()["error"]["code"] == "gateway_shutting_down"
        worker = state.registry.pools["p"].workers[WorkerId(stack.worker_url)]
        assert worker.in_flight == 0 and worker.breaker.closed and worker.breaker.failures == 0
        assert state.gate.limiters["t"].in_flight == 0 and state.lifecycle.in_flight_requests == 0
        assert not state.lifecycle.dispatching and not state.lifecycle.ended
        metrics = state.routing.metrics.render().decode().splitlines()
        outcomes = [line for line in metrics if line.startswith("kvgate_worker_requests_total{")]
        assert len(outcomes) == 1 and 'outcome="aborted"' in outcomes[0] and outcomes[0].endswith(" 1.0")
        for task in waiting:
            assert task.cancelling() == 0  # the drain's cancellation was taken back
        # One that arrives after the deadline (just before the listener closed) is answered at
        # once, without a worker, and its task is never cancelled.
        late = asyncio.create_task(stack.chat())
        resp = await late
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "gateway_shutting_down"
        assert late.cancelling() == 0 and not state.lifecycle.dispatching
        assert worker.in_flight == 0 and state.gate.limiters["t"].in_flight == 0
        lines.flush()  # as docs/reliability.md says: status 503, the code, and the words told
        logged = [(r["status"], r["error"], r["error_detail"]) for r in lines.records]
        assert logged == [(503, "gateway_shutting_down", "gateway shutting down")] * 3


async def test_a_trailing_slash_is_an_unknown_route_not_a_redirect() -> None:
    # A redirect would carry a Location built from the client's own Host header.
    async with _in_front_of_a_hanging_worker() as stack:
        for path in ("/v1/chat/completions/", "/v1/completions/", "/v1/models/", "/healthz/"):
            resp = await stack.client.post(path, json=BODY, headers={**HEADERS, "host": "evil.example"})
            assert resp.status_code == 404, path
            assert "location" not in resp.headers
            assert resp.json()["error"]["code"] == "not_found"
