"""The pool queue in-process, in front of one worker capped at one request that answers only when
the test opens its gate: fair order across tenants, priority within one, bounds, timeouts, clients
that leave. Nothing here is timed: every step waits for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.admission import Admitted
from gateway.app import GatewayApp, build_app
from gateway.auth import hash_api_key
from gateway.config import PoolConfig, parse_config
from gateway.disconnect import DisconnectWatch
from gateway.failure import Failure
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue
from gateway.registry import Pool, Worker
from gateway.state import GatewayState, build_state
from policies import make_policy
from policies.base import KvEvent, Observation, RouteDecision, RouteRequest, WorkerId, WorkerView
from prompt_normalizer.normalizer import NormalizerConfig

SECRET = b"k"


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class RecordingPolicy:
    """round_robin, remembering every request it was asked to route."""

    name = "recording"

    def __init__(self) -> None:
        self._inner = make_policy("round_robin")
        self.requests: list[RouteRequest] = []

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        self.requests.append(req)
        return self._inner.select(req, workers, now_s)

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        self._inner.on_dispatch(req, decision, now_s)

    def on_complete(self, obs: Observation, now_s: float) -> None:
        self._inner.on_complete(obs, now_s)

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        return None


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    app: GatewayApp
    policy: RecordingPolicy
    arrivals: list[dict[str, Any]] = field(default_factory=list)  # bodies, in the order a worker got them
    gate: asyncio.Queue[None] = field(default_factory=asyncio.Queue)  # one item: one answer

    @property
    def queue(self) -> PoolQueue:
        return self.state.queues["p"]

    def send(self, tenant: str, tag: str, **extra: Any) -> asyncio.Task[httpx.Response]:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": tag, **extra}
        headers = {"authorization": f"Bearer sk-{tenant}"}
        return asyncio.ensure_future(self.client.post("/v1/chat/completions", json=body, headers=headers))

    async def answer_one(self) -> None:
        """Let the worker answer one request and wait until the next waiter reached it."""
        arrived = len(self.arrivals)
        self.gate.put_nowait(None)
        await wait_until(lambda: len(self.arrivals) > arrived or not self.queue.waiting)

    def order(self) -> list[str]:
        return [body["user"] for body in self.arrivals]


RigFactory = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def make_rig() -> AsyncIterator[RigFactory]:
    stack = contextlib.AsyncExitStack()

    async def build(**queue: Any) -> Rig:
        rig_ref: list[Rig] = []

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.Response:
            rig = rig_ref[0]
            rig.arrivals.append(await request.json())
            await rig.gate.get()
            usage = {"prompt_tokens": 1, "completion_tokens": 1}
            return web.json_response({"choices": [], "usage": usage})

        worker = web.Application()
        worker.router.add_get("/health", health)
        worker.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(worker)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        def tenant(name: str, weight: float = 1.0) -> dict[str, Any]:
            return {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")], "weight": weight}

        config = parse_config(
            {
                "pools": [
                    {
                        "name": "p",
                        "models": ["m"],
                        "workers": [f"http://127.0.0.1:{port}"],
                        "max_in_flight_per_worker": 1,
                        "queue": queue,
                    }
                ],
                "tenants": [tenant("heavy"), tenant("light"), tenant("vip", weight=3.0)],
                "scrape": {"enabled": False},
            }
        )
        policy = RecordingPolicy()
        state = build_state(config, SECRET, policy, NormalizerConfig())
        state.disconnects = DisconnectWatch(delay_s=0.02)
        app = build_app(state)
        await stack.enter_async_context(app.fallback.router.lifespan_context(app.fallback))
        transport = httpx.ASGITransport(app=app)
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10)
        )
        rig = Rig(client, state, app, policy)
        rig_ref.append(rig)
        return rig

    yield build
    await stack.aclose()


async def _fill(rig: Rig, sends: list[tuple[str, str, dict[str, Any]]]) -> list[asyncio.Task[httpx.Response]]:
    """Occupy the worker's one slot, then queue `sends` in this order."""
    tasks = [rig.send("heavy", "hold")]
    await wait_until(lambda: len(rig.arrivals) == 1)
    for n, (tenant, tag, extra) in enumerate(sends, 1):
        tasks.append(rig.send(tenant, tag, **extra))
        await wait_until(lambda n=n: rig.queue.waiting == n)  # type: ignore[misc]
    return tasks


async def _serve_all(rig: Rig, tasks: list[asyncio.Task[httpx.Response]]) -> None:
    while not all(task.done() for task in tasks):
        await rig.answer_one()
        await asyncio.sleep(0)
    assert all(task.result().status_code == 200 for task in tasks)
    rig.queue.check_invariants()


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("fair", ["hold", "h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]),
        ("fifo", ["hold", "h0", "h1", "h2", "h3", "h4", "h5", "l0", "l1"]),
    ],
)
async def test_a_flooding_tenant_does_not_make_a_light_one_wait_behind_it(
    make_rig: RigFactory, order: str, expected: list[str]
) -> None:
    rig = await make_rig(order=order)
    sends = [("heavy", f"h{i}", {}) for i in range(6)] + [("light", f"l{i}", {}) for i in range(2)]
    tasks = await _fill(rig, sends)
    assert rig.queue.depths() == {"heavy": 6, "light": 2}
    await _serve_all(rig, tasks)
    assert rig.order() == expected


async def test_weights_share_the_freed_slots(make_rig: RigFactory) -> None:
    rig = await make_rig()
    sends = [("heavy", f"h{i}", {}) for i in range(4)] + [("vip", f"v{i}", {}) for i in range(6)]
    tasks = await _fill(rig, sends)
    await _serve_all(rig, tasks)
    # vip weighs three times heavy: three turns for every one of heavy's while both wait (with
    # equal weights they would alternate, and heavy, queued first, would be served first).
    first = [tag[0] for tag in rig.order()[1:9]]
    assert first.count("v") == 6 and first.count("h") == 2


async def test_priority_orders_a_tenants_requests_and_reaches_the_worker(make_rig: RigFactory) -> None:
    rig = await make_rig()
    sends = [("light", f"p{p}", {"priority": p}) for p in (5, 0, -1)]
    tasks = await _fill(rig, sends)
    await _serve_all(rig, tasks)
    assert rig.order() == ["hold", "p-1", "p0", "p5"]
    assert [body.get("priority") for body in rig.arrivals[1:]] == [-1, 0, 5]  # passed through


async def test_priority_must_be_an_integer(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for bad in ("high", 1.5, True, None):
        resp = await rig.send("light", "bad", priority=bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    assert rig.arrivals == []


async def test_the_policy_sees_the_queued_demand(make_rig: RigFactory) -> None:
    rig = await make_rig()
    tasks = await _fill(rig, [("heavy", f"h{i}", {}) for i in range(3)])
    await _serve_all(rig, tasks)
    seen = {req.request_id: req.queued_requests for req in rig.policy.requests}
    # Routed from the queue with 2, 1, then 0 others still waiting; the first found the slot free.
    assert sorted(seen.values(), reverse=True)[:3] == [2, 1, 0]
    assert rig.policy.requests[0].queued_requests == 0


async def test_a_queue_timeout_is_a_503_with_retry_after(make_rig: RigFactory) -> None:
    rig = await make_rig(timeout_s=0.2)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    resp = await rig.send("light", "late")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "queue_timeout"
    assert "x-should-retry" not in resp.headers  # no worker saw it: retrying sends nothing twice
    assert rig.queue.waiting == 0
    await rig.answer_one()
    assert (await hold).status_code == 200 and rig.order() == ["hold"]
    refusals = rig.state.metrics.queue_refusals.children
    assert refusals[("p", "light", "timeout")].value == 1


async def test_the_bounds_refuse_at_once(make_rig: RigFactory) -> None:
    rig = await make_rig(max_per_tenant=1, max_requests=2)
    tasks = await _fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    resp = await rig.send("heavy", "h1")  # heavy already has its one waiting request
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "queue_full"
    resp = await rig.send("vip", "v0")  # the pool's queue is full
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
    await _serve_all(rig, tasks)
    assert rig.order() == ["hold", "h0", "l0"]
    statuses = {key[2] for key in rig.state.metrics.requests.children if key[1] in ("heavy", "vip")}
    assert statuses == {"200", "429", "503"}


async def test_a_waiter_whose_client_leaves_leaves_the_queue(make_rig: RigFactory) -> None:
    rig = await make_rig()
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    leave = asyncio.Event()
    sent: list[dict[str, Any]] = []
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "gone"})
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", b"Bearer sk-light"), (b"content-length", str(len(raw)).encode())],
        "query_string": b"",
    }
    gone = asyncio.ensure_future(rig.app(scope, receive, send))
    await wait_until(lambda: rig.queue.waiting == 1)
    leave.set()
    await wait_until(gone.done)
    assert rig.queue.waiting == 0 and sent == []  # nobody to answer
    assert rig.state.metrics.requests.children[("m", "light", "499", "chat")].value == 1
    after = rig.send("light", "after")
    await wait_until(lambda: rig.queue.waiting == 1)
    await rig.answer_one()
    await rig.answer_one()
    assert (await hold).status_code == 200 and (await after).status_code == 200
    assert rig.order() == ["hold", "after"]  # the request that left never reached the worker
    assert rig.state.limiters["light"].in_flight == 0
    rig.queue.check_invariants()


async def test_queue_waits_and_depth_are_in_the_metrics(make_rig: RigFactory) -> None:
    rig = await make_rig()
    tasks = await _fill(rig, [("heavy", "h0", {}), ("light", "l0", {})])
    text = rig.state.metrics.render().decode()
    assert 'kvgate_queue_depth{pool="p",tenant="heavy"} 1.0' in text
    assert 'kvgate_queue_depth{pool="p",tenant="light"} 1.0' in text
    await _serve_all(rig, tasks)
    text = rig.state.metrics.render().decode()
    assert "kvgate_queue_depth{" not in text
    assert 'kvgate_queue_wait_seconds_count{pool="p",tenant="light"} 1.0' in text
    assert 'kvgate_queue_wait_seconds_count{pool="p",tenant="heavy"} 1.0' in text  # "hold" never queued


async def test_without_a_queue_a_full_pool_answers_503_at_once(make_rig: RigFactory) -> None:
    rig = await make_rig(enabled=False)
    hold = rig.send("heavy", "hold")
    await wait_until(lambda: len(rig.arrivals) == 1)
    resp = await rig.send("light", "l0")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"
    assert rig.state.queues == {}
    rig.gate.put_nowait(None)
    assert (await hold).status_code == 200


# ---------------------------------------------------------------- the queue alone, with a stub pool


class FirstFree:
    """Picks the first healthy worker below its cap."""

    name = "first_free"

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        for w in workers:
            if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight):
                return RouteDecision(w.worker_id, 0.0, "first")
        return None

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None:
        return None

    def on_complete(self, obs: Observation, now_s: float) -> None:
        return None

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None:
        return None


@dataclass
class _Request:
    """The parts of an admitted request the queue reads and writes."""

    tenant: Any
    route: RouteRequest
    priority: int = 0
    queued_s: float | None = None


def _queued(tenant: str) -> Admitted:
    route = RouteRequest(
        request_id=tenant,
        pool="p",
        tenant=tenant,
        namespace="",
        block_keys=(),
        n_prompt_tokens=1,
        block_size_tokens=16,
    )
    return cast(Admitted, _Request(SimpleNamespace(name=tenant), route))


@pytest.fixture
def full_pool() -> tuple[Pool, Worker]:
    pool = Pool(
        PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:9"], max_in_flight_per_worker=1)
    )
    (worker,) = pool.workers.values()
    worker.healthy = True
    worker.acquire(1, 0, 0.0)  # its one slot is taken
    return pool, worker


def _free(pool: Pool, worker: Worker, queue: PoolQueue) -> None:
    worker.release(1, 0, prefill_done=True)
    queue.slot_freed()


async def test_a_turn_handed_to_a_waiter_that_left_goes_to_the_next(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    policy = FirstFree()
    first = asyncio.ensure_future(queue.wait(_queued("a"), policy))
    second = asyncio.ensure_future(queue.wait(_queued("b"), policy))
    await wait_until(lambda: queue.waiting == 2)
    _free(pool, worker, queue)  # the turn goes to "a" ...
    first.cancel()  # ... whose client leaves before its task runs
    routed = await asyncio.wait_for(second, 2)
    assert isinstance(routed, tuple) and routed[0] is not None
    assert first.cancelled() and queue.waiting == 0 and queue._turns == 0
    queue.check_invariants()


async def test_waiters_get_no_worker_when_the_last_routable_worker_goes(
    full_pool: tuple[Pool, Worker],
) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    waiters = [asyncio.ensure_future(queue.wait(_queued(t), FirstFree())) for t in ("a", "b")]
    await wait_until(lambda: queue.waiting == 2)
    worker.healthy = False
    results = await asyncio.wait_for(asyncio.gather(*waiters), 2)
    assert [r[0] for r in results if isinstance(r, tuple)] == [None, None]  # the caller answers 503
    queue.check_invariants()


async def test_a_turn_lost_to_a_race_keeps_its_place(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=0.01)
    policy = FirstFree()
    waiter = asyncio.ensure_future(queue.wait(_queued("a"), policy))
    await wait_until(lambda: queue.waiting == 1)
    _free(pool, worker, queue)
    worker.acquire(1, 0, 0.0)  # a retry elsewhere takes the slot before the waiter runs
    await wait_until(lambda: queue.waiting == 1 and queue._turns == 0)
    assert not waiter.done()
    _free(pool, worker, queue)
    routed = await asyncio.wait_for(waiter, 2)
    assert isinstance(routed, tuple) and routed[0] is not None
    queue.check_invariants()


def test_try_route_is_the_whole_path_when_nobody_waits(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics())
    assert queue.try_route(_queued("a"), FirstFree()) is None  # full: it must wait
    worker.release(1, 0, prefill_done=True)
    routed = queue.try_route(_queued("a"), FirstFree())
    assert routed is not None and routed[0] is not None
    worker.healthy = False
    routed = queue.try_route(_queued("a"), FirstFree())
    assert routed is not None and routed[0] is None  # no worker at all: 503 at once, no waiting


async def test_at_the_drain_deadline_waiters_get_a_503(full_pool: tuple[Pool, Worker]) -> None:
    pool, worker = full_pool
    queue = PoolQueue(pool, pool.config.queue, {}, GatewayMetrics(), tick_s=60)  # no tick here
    served = asyncio.ensure_future(queue.wait(_queued("a"), FirstFree()))
    stuck = asyncio.ensure_future(queue.wait(_queued("b"), FirstFree()))
    await wait_until(lambda: queue.waiting == 2)
    _free(pool, worker, queue)  # "a" is served while the gateway drains ...
    assert isinstance(await served, tuple)
    worker.acquire(1, 0, 0.0)  # ... and holds the slot (the proxy's part)
    await queue.until_empty(0.1)  # "b" is still waiting when the deadline comes
    queue.close()
    refused = await stuck
    assert isinstance(refused, Failure) and (refused.status, refused.code) == (503, "gateway_shutting_down")
    await queue.until_empty(5)  # returns at once: nothing waits
    queue.check_invariants()
