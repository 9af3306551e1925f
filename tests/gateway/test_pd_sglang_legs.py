"""SGLang's two legs of a split, each worker answering for itself.

The gateway runs in-process in front of scripted SGLang prefill and decode workers that meet in
the request's bootstrap room: a prefill worker answers once the decode leg has joined its room
(its KV has then moved), a decode worker once the KV has moved. One worker may be
scripted to fail: a decode worker that answers 500 to everything, or a prefill worker that never
answers (until the test ends) or answers 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies.base import WorkerId
from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_in
from tests.support.metrics import metric_total
from tests.support.wait import wait_until

SECRET = b"pd-sglang-legs"
KEY = {"authorization": "Bearer sk-t"}
DEAD_BOOTSTRAP_PORT = 9001  # the bootstrap port of a prefill worker scripted "dead"
USAGE = {"prompt_tokens": 8, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 7}}


@dataclass
class Fleet:
    """`broken`: the worker (by name) that fails, as `prefill_fault` says for a prefill worker
    ("hang", "500", or "dead": its bootstrap server is down, so its decode legs answer 500 at
    once and its own 500 comes after); a decode worker answers `decode_status` (500), to every
    other leg only with `now_and_then`."""

    broken: str = ""
    prefill_fault: str = ""
    decode_status: int = 500
    now_and_then: bool = False
    decode_legs: int = 0  # legs the broken decode worker took
    prefill_cached: int = 5  # the prefill answer's cached_tokens
    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # a hanging prefill answers
    prefill_answers: int = 0  # prefill legs answered 200

    def finish(self) -> None:
        """Every waiting worker answers (before the servers stop)."""
        self.release.set()
        for room in self.rooms.values():
            room.set()

    def room(self, body: dict[str, Any]) -> asyncio.Event:
        """Set once the decode leg has joined the room."""
        return self.rooms.setdefault(body["bootstrap_room"], asyncio.Event())

    def moved(self, body: dict[str, Any]) -> asyncio.Event:
        """Set once the prefill worker has sent the KV (before it answers)."""
        return self.rooms.setdefault(-body["bootstrap_room"] - 1, asyncio.Event())

    def app(self, name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read())
            room = self.room(body)
            if name == self.broken and name.startswith("d"):
                self.decode_legs += 1
                if not self.now_and_then or self.decode_legs % 2:
                    return _error("engine died", self.decode_status)
            elif name == self.broken and self.prefill_fault == "500":
                return _error("engine died")
            if name == self.broken and self.prefill_fault == "dead":
                await asyncio.sleep(0.05)  # after its decode leg's failure
                return _error("engine died")
            if name == self.broken and self.prefill_fault == "stuck":
                await self.release.wait()  # up, but answers nothing, nor sends any KV
                return _error("engine died")
            if name.startswith("d") and body["bootstrap_port"] == DEAD_BOOTSTRAP_PORT:
                return _error("KV transfer failed")  # the prefill worker's bootstrap server is down
            if name.startswith("p"):
                await asyncio.wait_for(room.wait(), 10)
                self.moved(body).set()
                if name == self.broken:
                    await self.release.wait()
                self.prefill_answers += 1
                details = {"cached_tokens": self.prefill_cached}
                usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": details}
                return web.json_response({"choices": [], "usage": usage})
            room.set()
            await asyncio.wait_for(self.moved(body).wait(), 10)
            await asyncio.sleep(0.05)  # a prefill answer that comes reaches the gateway first
            if not body.get("stream"):
                return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": USAGE})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            delta = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
            chunks = [delta, {"choices": [], "usage": USAGE}]
            for chunk in chunks:
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/chat/completions", chat)
        return app


def _error(message: str, status: int = 500) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    urls: dict[str, str]
    lines: AccessLines

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.state, name, **labels)

    def breaker_closed(self, name: str) -> bool:
        return self.state.registry.pools["p"].workers[WorkerId(self.urls[name])].breaker.closed

    async def chat(self, stream: bool = False) -> httpx.Response:
        messages = [{"role": "user", "content": "hi"}]
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 2}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return await self.client.post("/v1/chat/completions", json=body, headers=KEY)


@contextlib.asynccontextmanager
async def sglang_rig(
    fleet: Fleet, prefills: int = 1, read_s: float = 10.0, decodes: int = 2
) -> AsyncIterator[Rig]:
    names = [f"p{i + 1}" for i in range(prefills)] + [f"d{i + 1}" for i in range(decodes)]
    async with contextlib.AsyncExitStack() as stack:
        urls = {name: await serve_in(stack, fleet.app(name)) for name in names}
        stack.callback(fleet.finish)
        config = {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "prefill_workers": [urls[n] for n in names if n.startswith("p")],
                    "decode_workers": [urls[n] for n in names if n.startswith("d")],
                    "pd": {
                        "protocol": "sglang",
                        "bootstrap_port": 8998,
                        "bootstrap_ports": {urls["p1"]: DEAD_BOOTSTRAP_PORT}
                        if fleet.prefill_fault in ("dead", "stuck")
                        else {},
                        "conditional": False,
                    },
                    "retry_attempts": 2,
                    "timeouts": {"connect_s": 1, "read_s": read_s, "total_s": 30},
                }
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        yield Rig(gw.client, gw.state, urls, capture_access(gw.state))


async def test_a_decode_worker_answering_500_is_left_out_then_its_breaker_opens() -> None:
    """It answers 500 before its prefill leg has ended (the prefill worker waits for it to join
    the room), so either could be at fault: no verdict on either then, and the next round goes
    without both, which serves it. Once it has so failed with both prefill workers, each of which
    serves pairs with the other decode worker, it is shown at fault: its breaker counts those
    rounds and opens, and no more requests pay a round for it."""
    async with sglang_rig(Fleet(broken="d1"), prefills=2) as rig:
        for _ in range(64):  # until it opens: each request meets d1 or not as the policy chooses
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
            if not rig.breaker_closed("d1"):
                break
        assert not rig.breaker_closed("d1")
        assert rig.breaker_closed("d2") and rig.breaker_closed("p1") and rig.breaker_closed("p2")
        failed = rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error")
        for _ in range(8):
            assert (await rig.chat()).status_code == 200
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") <= failed + 1


async def test_with_one_prefill_worker_a_broken_decode_worker_is_avoided_but_not_blamed() -> None:
    """One prefill worker: its failures with the broken decode worker cannot tell which of the two
    is at fault (one partner proves nothing), so no breaker opens; each request that meets the
    broken worker is served by the next round, without it."""
    async with sglang_rig(Fleet(broken="d1")) as rig:
        for _ in range(12):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        assert rig.breaker_closed("d1") and rig.breaker_closed("d2") and rig.breaker_closed("p1")
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") >= 1


@pytest.mark.parametrize("status", [500, 503, 529])
async def test_a_decode_worker_failing_now_and_then_gets_no_prefill_worker_blamed(status: int) -> None:
    """Two prefill workers and one decode worker that answers `status` to every other leg: the
    prefill workers are never blamed for it (each fails with one partner only). A 500 leaves the
    round inconclusive and the next one, on the same decode worker, serves the request; an
    overloaded decode worker's 503 or 529 is its own failure, not a transfer's, and with no other
    decode worker the client gets the 503 (`Retry-After`, to come back later)."""
    fleet = Fleet(broken="d1", decode_status=status, now_and_then=True)
    async with sglang_rig(fleet, prefills=2, decodes=1) as rig:
        for _ in range(12):
            resp = await rig.chat()
            assert resp.status_code == 200 or (status != 500 and resp.status_code == 503), resp.text
        assert rig.breaker_closed("p1") and rig.breaker_closed("p2")
        transfers = rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error")
        assert (transfers == 0) == (status != 500)


async def test_a_stuck_prefill_worker_does_not_get_the_decode_workers_blamed() -> None:
    """A prefill worker that is up but answers nothing and sends no KV: the decode legs paired
    with it answer 500 while its leg is still out. The decode workers get no verdict (blaming them
    opened every decode breaker and the pool answered 503), and each such request is served by
    the next round, on the other prefill worker."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="stuck"), prefills=2, read_s=10) as rig:
        for _ in range(6):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        assert rig.breaker_closed("d1") and rig.breaker_closed("d2")
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") >= 1
        # The decode workers serving pairs with the other prefill worker settle it: the stuck one
        # is at fault, and its breaker opens.
        assert not rig.breaker_closed("p1") and rig.breaker_closed("p2")


async def test_a_decode_answer_500_after_its_prefill_worker_went_down_blames_the_transfer() -> None:
    """The prefill worker's bootstrap server is down: its decode legs answer 500 at once, and its
    own leg fails just after. The transfer failed: the next round goes without that prefill
    worker, and the decode workers are not blamed."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="dead"), prefills=2) as rig:
        for _ in range(6):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        assert rig.breaker_closed("d1") and rig.breaker_closed("d2")
        assert rig.metric("kvgate_pd_transfer_failures_total", reason="decode_error") >= 1
        assert rig.metric("kvgate_pd_leg_failures_total", role="prefill") >= 1
        # Both legs of a failed round failed: one retry, as the retries counter says.
        rig.lines.flush()
        retries = sum(line["retries"] for line in rig.lines.records)
        assert retries == rig.metric("kvgate_upstream_retries_total") >= 1
        assert max(line["retries"] for line in rig.lines.records) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_the_decode_answer_does_not_wait_for_the_prefill_answer(stream: bool) -> None:
    """The prefill worker moved the KV (its decode leg answers) but does not answer: the client
    gets the decode answer at once, reporting the decode worker's `cached_tokens` (the prefill
    answer's is not known yet). The prefill leg is closed on its own when it times out, with no
    verdict on its worker, and the request has one access line."""
    fleet = Fleet(broken="p1", prefill_fault="hang")
    async with sglang_rig(fleet, read_s=1.5) as rig:
        resp = await rig.chat(stream)
        assert resp.status_code == 200
        assert '"cached_tokens":7' in resp.text.replace(" ", "")
        prefill = rig.state.registry.pools["p"].workers[WorkerId(rig.urls["p1"])]
        assert prefill.in_flight == 1  # the answer came while the prefill leg is still read
        await wait_until(lambda: prefill.in_flight == 0, what="the prefill leg closed")
        assert rig.breaker_closed("p1")
        assert rig.metric("kvgate_pd_leg_failures_total") == 0
        # When the KV was ready is not known: the transfer is not timed (from the decode leg's
        # dispatch it would count the prompt's own prefill as transfer).
        assert rig.metric("kvgate_pd_transfer_seconds_count") == 0
        rig.lines.flush()
        assert len(rig.lines.records) == 1 and rig.lines.records[0]["status"] == 200


async def test_a_prefill_answer_in_time_reports_its_cached_tokens() -> None:
    async with sglang_rig(Fleet(prefill_cached=5)) as rig:
        for stream in (True, False):
            resp = await rig.chat(stream)
            assert resp.status_code == 200
            assert '"cached_tokens":5' in resp.text.replace(" ", "")


async def test_a_failed_prefill_leg_is_the_502s_worker() -> None:
    """The only prefill worker answers 500 (its decode leg is stopped): no pair is left, and the
    access line names the prefill worker and its failure, not the decode leg that was stopped."""
    async with sglang_rig(Fleet(broken="p1", prefill_fault="500")) as rig:
        resp = await rig.chat()
        assert resp.status_code == 502
        rig.lines.flush()
        (line,) = rig.lines.records
        assert line["worker"] == rig.urls["p1"] and line["error_detail"] == "worker answered 500"
        assert line["retries"] == 0


async def test_a_prefill_leg_still_read_apart_is_closed_when_the_gateway_stops() -> None:
    """The decode answers went out; their prefill legs still wait on a worker that does not
    answer. Stopping the gateway closes them (no verdict) before its books and transport close,
    instead of leaving them to end on a stopped gateway."""
    fleet = Fleet(broken="p1", prefill_fault="hang")
    async with sglang_rig(fleet, read_s=30) as rig:
        for _ in range(3):
            assert (await rig.chat()).status_code == 200
        routing = rig.state.routing
        prefill = rig.state.registry.pools["p"].workers[WorkerId(rig.urls["p1"])]
        assert len(routing.background) == 3 and prefill.in_flight == 3
    assert not routing.background and prefill.in_flight == 0
    assert prefill.breaker.closed
