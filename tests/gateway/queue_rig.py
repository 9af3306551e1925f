"""The gateway in-process, its pool queue in front of one worker capped at one request that answers
only when the test opens its gate; for the queue's tests. Nothing here is timed: every step
waits for a condition.

With `pd=True` the pool is a vLLM prefill/decode pair instead (every request split), both capped
at one request: the prefill worker answers at once, the decode worker (whose arrivals the rig
records) when the gate opens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from gateway.app import GatewayApp
from gateway.auth import hash_api_key
from gateway.disconnect import DisconnectWatch
from gateway.queueing import PoolQueue
from gateway.state import GatewayState
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SECRET = b"k"


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    app: GatewayApp
    policy: Recording
    arrivals: list[dict[str, Any]] = field(default_factory=list)  # bodies, in the order a worker got them
    gate: asyncio.Queue[None] = field(default_factory=asyncio.Queue)  # one item: one answer

    @property
    def queue(self) -> PoolQueue:
        return self.state.routing.queues["p"]

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


@contextlib.asynccontextmanager
async def queue_rigs() -> AsyncIterator[RigFactory]:
    """Builds rigs (`build(**queue)`: the pool's queue settings) and stops them all on exit.
    Tenants: heavy, light and vip (weight 3), each with the key `sk-<name>`."""
    stack = contextlib.AsyncExitStack()

    async def build(*, pd: bool = False, **queue: Any) -> Rig:
        rig_ref: list[Rig] = []

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.Response:
            rig = rig_ref[0]
            rig.arrivals.append(await request.json())
            await rig.gate.get()
            usage = {"prompt_tokens": 1, "completion_tokens": 1}
            return web.json_response({"choices": [], "usage": usage})

        async def prefill(request: web.Request) -> web.Response:
            body = await request.json()
            assert body["kv_transfer_params"]["do_remote_decode"] is True
            usage = {"prompt_tokens": 1, "completion_tokens": 1}
            params = {"remote_engine_id": "e", "remote_block_ids": [1]}
            return web.json_response({"choices": [], "usage": usage, "kv_transfer_params": params})

        async def worker_url(answer: Any) -> str:
            worker = web.Application()
            worker.router.add_get("/health", health)
            worker.router.add_post("/v1/chat/completions", answer)
            runner, port = await serve_app(worker)
            stack.push_async_callback(runner.cleanup)
            return f"http://127.0.0.1:{port}"

        workers: dict[str, Any]
        if pd:
            workers = {
                "prefill_workers": [await worker_url(prefill)],
                "decode_workers": [await worker_url(chat)],
                "pd": {"protocol": "vllm", "conditional": False},  # always a pair
            }
        else:
            workers = {"workers": [await worker_url(chat)]}

        def tenant(name: str, weight: float = 1.0) -> dict[str, Any]:
            return {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")], "weight": weight}

        config = {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    **workers,
                    "max_in_flight_per_worker": 1,
                    "queue": queue,
                }
            ],
            "tenants": [tenant("heavy"), tenant("light"), tenant("vip", weight=3.0)],
            "scrape": {"enabled": False},
        }
        policy = Recording()
        gw = await stack.enter_async_context(gateway_in_process(config, policy, secret=SECRET))
        gw.state.lifecycle.disconnects = DisconnectWatch(delay_s=0.02)  # the app reads it per request
        rig = Rig(gw.client, gw.state, gw.app, policy)
        rig_ref.append(rig)
        return rig

    try:
        yield build
    finally:
        await stack.aclose()


async def fill(rig: Rig, sends: list[tuple[str, str, dict[str, Any]]]) -> list[asyncio.Task[httpx.Response]]:
    """Occupy the worker's one slot, then queue `sends` in this order."""
    tasks = [rig.send("heavy", "hold")]
    await wait_until(lambda: len(rig.arrivals) == 1)
    for n, (tenant, tag, extra) in enumerate(sends, 1):
        tasks.append(rig.send(tenant, tag, **extra))
        await wait_until(lambda n=n: rig.queue.waiting == n)  # type: ignore[misc]
    return tasks


async def serve_all(rig: Rig, tasks: list[asyncio.Task[httpx.Response]]) -> None:
    while not all(task.done() for task in tasks):
        await rig.answer_one()
        await asyncio.sleep(0)
    assert all(task.result().status_code == 200 for task in tasks)
    rig.queue.check_invariants()
