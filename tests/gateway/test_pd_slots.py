"""A vLLM pair holds its decode worker's slot from the moment it is chosen: while its prefill leg
runs, no other request reaches the decode worker (capped at one), and whatever ends the prefill
leg without a decode leg gives the slot back, to the worker and to the pool's queue.

The gateway runs in-process in front of two scripted workers, each capped at one request, that
answer a request only when the test tells them how (by the request's `user` tag). Nothing here
is timed: every step waits for a condition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.config.pool import PoolConfig
from gateway.disconnect import DisconnectWatch
from gateway.outcome import Reservation
from gateway.queueing import PoolQueue
from gateway.state import GatewayState
from gateway.worker import Worker
from policies.base import WorkerId
from tests.gateway.access_lines import capture_access
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.leaving_client import leaving_chat
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

SECRET = b"k"
_PARAMS = {"remote_engine_id": "e", "remote_block_ids": [1]}


@dataclass
class Scripted:
    """A worker that holds each request until `answer(tag, status)`, and counts how many it held
    at once."""

    prefill: bool
    url: str = ""
    arrivals: list[dict[str, Any]] = field(default_factory=list)
    pending: dict[str, asyncio.Future[int]] = field(default_factory=dict)
    now: int = 0
    most: int = 0

    def tags(self) -> list[str]:
        return [body["user"] for body in self.arrivals]

    def answer(self, tag: str, status: int = 200) -> None:
        self.pending[tag].set_result(status)

    def answer_all(self) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_result(200)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        tag = body["user"]
        self.arrivals.append(body)
        future = self.pending[tag] = asyncio.get_running_loop().create_future()
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            status = await future
        finally:
            self.now -= 1
        if status != 200:
            return web.json_response({"error": {"message": "no", "code": status}}, status=status)
        answer: dict[str, Any] = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        if self.prefill:
            answer["kv_transfer_params"] = _PARAMS
        return web.json_response(answer)


@dataclass
class Rig:
    gw: InProcessGateway
    prefill: Scripted
    decode: Scripted

    @property
    def state(self) -> GatewayState:
        return self.gw.state

    @property
    def queue(self) -> PoolQueue:
        return self.state.routing.queues["p"]

    def worker(self, scripted: Scripted) -> Worker:
        return self.state.registry.pools["p"].workers[WorkerId(scripted.url)]

    def send(self, tag: str, tenant: str = "heavy") -> asyncio.Task[httpx.Response]:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "user": tag, "max_tokens": 8}
        headers = {"authorization": f"Bearer sk-{tenant}"}
        return asyncio.ensure_future(self.gw.client.post("/v1/chat/completions", json=body, headers=headers))

    async def idle(self) -> None:
        """Every slot is back: on both workers, and in the queue's count."""
        await wait_until(lambda: self.worker(self.prefill).in_flight == 0)
        await wait_until(lambda: self.worker(self.decode).in_flight == 0)
        assert self.worker(self.decode).decode_tokens == 0
        assert self.worker(self.decode).prefill_tokens == 0
        assert self.queue.waiting == 0
        self.queue.check_invariants()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with contextlib.AsyncExitStack() as stack:
        prefill, decode = Scripted(prefill=True), Scripted(prefill=False)
        for scripted in (prefill, decode):

            async def health(_: web.Request) -> web.Response:
                return web.Response(text="ok")

            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_post("/v1/chat/completions", scripted.chat)
            runner, port = await serve_app(app)
            stack.push_async_callback(runner.cleanup)
            stack.callback(scripted.answer_all)  # a held request would hold up its server's cleanup
            scripted.url = f"http://127.0.0.1:{port}"

        def tenant(name: str) -> dict[str, Any]:
            return {"name": name, "api_key_hashes": [hash_api_key(SECRET, f"sk-{name}")]}

        config = {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "prefill_workers": [prefill.url],
                    "decode_workers": [decode.url],
                    "pd": {"protocol": "vllm", "conditional": False},  # a pair whenever one is free
                    "max_in_flight_per_worker": 1,
                }
            ],
            "tenants": [tenant("heavy"), tenant("light")],
            "scrape": {"enabled": False},
        }
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        gw.state.lifecycle.disconnects = DisconnectWatch(delay_s=0.02)
        built = Rig(gw, prefill, decode)
        await wait_until(lambda: all(built.worker(s).healthy for s in (prefill, decode)))
        yield built


async def test_the_decode_slot_is_taken_while_the_prefill_runs(rig: Rig) -> None:
    first = rig.send("a")
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    ticks = 0
    tick = rig.queue._tick

    def counted() -> None:
        nonlocal ticks
        ticks += 1
        tick()

    rig.queue._tick = counted  # type: ignore[method-assign]
    second = rig.send("b", "light")
    await wait_until(lambda: rig.queue.waiting == 1 or rig.decode.arrivals)
    assert rig.decode.arrivals == []  # it waits: the decode worker is the first request's
    await wait_until(lambda: ticks >= 3)  # the periodic hand-out ran while the prefill leg runs
    assert rig.decode.arrivals == [] and rig.queue.waiting == 1
    decode = rig.worker(rig.decode)
    # Held: a request in flight and the output it will decode; its prompt is computed elsewhere.
    assert (decode.in_flight, decode.decode_tokens, decode.prefill_tokens) == (1, 8, 0)
    assert decode.view(0.0).in_flight_requests == 1  # the policy sees it too
    rig.prefill.answer("a")
    await wait_until(lambda: rig.decode.tags() == ["a"])
    assert decode.in_flight == 1  # the decode leg took the held slot over
    assert "kv_transfer_params" in rig.decode.arrivals[0]
    rig.decode.answer("a")
    assert (await first).status_code == 200
    await wait_until(lambda: rig.prefill.tags() == ["a", "b"])
    rig.prefill.answer("b")
    await wait_until(lambda: rig.decode.tags() == ["a", "b"])
    rig.decode.answer("b")
    assert (await second).status_code == 200
    assert rig.decode.most == 1 and rig.prefill.most == 1
    await rig.idle()


@pytest.mark.parametrize("status", [400, 500])
async def test_a_prefill_that_fails_gives_the_decode_slot_back(rig: Rig, status: int) -> None:
    rig.queue.tick_s = 3600.0  # the waiter's turn can only come from a freed slot
    first = rig.send("a")
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    second = rig.send("b", "light")
    await wait_until(lambda: rig.queue.waiting == 1)
    rig.prefill.answer("a", status)
    if status == 500:
        # Retried without the prefill worker: alone on the decode worker, whose slot came back.
        await wait_until(lambda: rig.decode.tags() == ["a"])
        assert "kv_transfer_params" not in rig.decode.arrivals[0]
        rig.decode.answer("a")
        assert (await first).status_code == 200
    else:
        assert (await first).status_code == 400
    await wait_until(lambda: rig.prefill.tags() == ["a", "b"])
    rig.prefill.answer("b")
    await wait_until(lambda: "b" in rig.decode.tags())
    rig.decode.answer("b")
    assert (await second).status_code == 200
    assert rig.decode.most == 1
    await rig.idle()


async def test_a_client_that_leaves_during_the_prefill_gives_the_decode_slot_back(rig: Rig) -> None:
    rig.queue.tick_s = 3600.0
    gone, leave = leaving_chat(rig.gw.app, "sk-heavy", "a", [])
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    assert rig.worker(rig.decode).in_flight == 1
    second = rig.send("b", "light")
    await wait_until(lambda: rig.queue.waiting == 1)
    leave.set()
    await wait_until(gone.done)
    assert rig.state.routing.metrics.requests.children[("m", "heavy", "499", "chat")].value == 1
    await wait_until(lambda: rig.prefill.tags() == ["a", "b"])  # its turn came from the freed slots
    rig.prefill.answer("b")
    await wait_until(lambda: rig.decode.tags() == ["b"])
    rig.decode.answer("b")
    assert (await second).status_code == 200
    await rig.idle()


async def test_the_answer_budget_ends_the_request_at_its_prefill_leg(rig: Rig) -> None:
    """A prefill answer past the process's answer budget is the gateway's own 503: not retried on
    another route (the budget is the same everywhere), the prefill worker not blamed."""
    budget = rig.state.transport.answers
    budget.capacity_bytes = 16  # below any answer
    first = rig.send("a")
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    rig.prefill.answer("a")
    await wait_until(lambda: first.done() or bool(rig.decode.arrivals))
    assert rig.decode.arrivals == []
    resp = await first
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "gateway_overloaded"
    assert resp.headers["retry-after"] == "1"
    assert rig.worker(rig.prefill).breaker.failures == 0
    assert budget.held_bytes == 0
    await rig.idle()


async def test_a_decode_worker_removed_during_the_prefill_is_not_sent_the_decode_leg(rig: Rig) -> None:
    """Discovery drops the decode worker while the pair's prefill leg runs: its held slot is given
    back, and the next round chooses again (here no route is left: the request gets a 503)."""
    decode = rig.worker(rig.decode)
    first = rig.send("a")
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    rig.state.registry.pools["p"].set_urls([rig.prefill.url])
    rig.prefill.answer("a")
    await wait_until(lambda: first.done() or bool(rig.decode.arrivals))
    assert rig.decode.arrivals == []
    resp = await first
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"
    assert (decode.in_flight, decode.decode_tokens) == (0, 0)
    await wait_until(lambda: rig.worker(rig.prefill).in_flight == 0)


def test_a_held_slot_takes_a_half_open_breakers_trial_and_gives_it_back() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 1.0}
    config = PoolConfig(name="p", models=["m"], workers=["http://127.0.0.1:1"], breaker=breaker)
    worker = Worker("http://127.0.0.1:1", config)
    closed = Reservation(worker, 8, 0.0)
    assert (worker.in_flight, worker.decode_tokens, worker.prefill_tokens) == (1, 8, 0)
    closed.take()
    closed.take()  # once only
    assert (worker.in_flight, worker.decode_tokens) == (0, 0) and worker.breaker.closed
    worker.breaker.on_failure(0.0, trial=None)
    trial = Reservation(worker, 8, 2.0)  # past the cooldown: the one trial is the held slot's
    assert not worker.breaker.allows(2.0)
    trial.give_back(_NoQueues(), "p")  # type: ignore[arg-type]
    trial.give_back(_NoQueues(), "p")  # type: ignore[arg-type]
    assert worker.in_flight == 0 and worker.breaker.allows(2.0)


class _NoQueues:
    """The part of `Routing` a slot given back reads: a pool without a queue."""

    def __init__(self) -> None:
        self.queues: dict[str, PoolQueue] = {}


async def test_a_client_that_leaves_during_the_decode_leg_was_not_retried(rig: Rig) -> None:
    """Its access line: 499, the decode worker it waited on, no retry (two legs of one round)."""
    lines = capture_access(rig.state)
    gone, leave = leaving_chat(rig.gw.app, "sk-heavy", "a", [])
    await wait_until(lambda: rig.prefill.tags() == ["a"])
    rig.prefill.answer("a")
    await wait_until(lambda: rig.decode.tags() == ["a"])
    leave.set()
    await wait_until(gone.done)
    lines.flush()
    (line,) = lines.records
    assert (line["status"], line["worker"], line["retries"]) == (499, rig.decode.url, 0)
    await rig.idle()
