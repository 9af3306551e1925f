"""Scripted SGLang prefill and decode workers behind an in-process gateway, for the P/D tests.

The workers meet in the request's bootstrap room: a prefill worker answers once the decode leg
has joined its room (its KV has then moved), a decode worker once the KV has moved. One worker
may be scripted to fail (`Fleet`). Each prefill worker has its own bootstrap port, so a decode
leg knows its pair's prefill worker, and the fleet records the pairs whose decode leg failed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.breaker import CircuitBreaker
from gateway.state import GatewayState
from policies.base import WorkerId
from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_in
from tests.support.metrics import metric_total

SECRET = b"pd-sglang-legs"
KEY = {"authorization": "Bearer sk-t"}
DEAD_BOOTSTRAP_PORT = 9001  # the bootstrap port of a prefill worker scripted "dead" or "stuck"
BOOTSTRAP_PORTS = 9100  # prefill worker pN's bootstrap port is this plus N
USAGE = {"prompt_tokens": 8, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 7}}


@dataclass
class Fleet:
    """`broken`: the worker (by name) that fails, as `prefill_fault` says for a prefill worker
    ("hang", "500", "dead": its bootstrap server is down, so its decode legs answer 500 at once
    and its own 500 comes after, "stuck": up but answering nothing, its decode legs as for
    "dead", or "now_and_then": every other leg it takes sends no KV and answers nothing, its
    decode leg answering 500); a decode worker answers `decode_status` (500), to every other leg
    only with `now_and_then`. Besides, a decode worker answers 500 at once (an inconclusive
    round) to each leg `failing(prefill, decode)` says, by name, of its pair."""

    broken: str = ""
    prefill_fault: str = ""
    decode_status: int = 500
    now_and_then: bool = False
    failing: Callable[[str, str], bool] = lambda prefill, decode: False
    decode_legs: int = 0  # legs the broken decode worker took
    prefill_legs: int = 0  # legs the broken prefill worker took
    prefill_cached: int = 5  # the prefill answer's cached_tokens
    rooms: dict[int, asyncio.Event] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)  # rooms whose prefill worker sent no KV
    release: asyncio.Event = field(default_factory=asyncio.Event)  # a hanging prefill answers
    prefill_answers: int = 0  # prefill legs answered 200
    failed: list[tuple[str, str]] = field(default_factory=list)  # (prefill, decode) of failed decode legs

    def finish(self) -> None:
        """Every waiting worker answers (before the servers stop)."""
        self.release.set()
        for room in self.rooms.values():
            room.set()

    def room(self, body: dict[str, Any]) -> asyncio.Event:
        """Set once the decode leg has joined the room."""
        return self.rooms.setdefault(body["bootstrap_room"], asyncio.Event())

    def moved(self, body: dict[str, Any]) -> asyncio.Event:
        """Set once the prefill worker has sent the KV, or given up sending it (before it answers)."""
        return self.rooms.setdefault(-body["bootstrap_room"] - 1, asyncio.Event())

    def app(self, name: str) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def chat(request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read())
            if name.startswith("p"):
                return await prefill(body)
            port = body["bootstrap_port"]
            source = "p1" if port == DEAD_BOOTSTRAP_PORT else f"p{port - BOOTSTRAP_PORTS}"
            if self.failing(source, name):
                answer = _error("engine died")
            else:
                answer = await decode(request, body)
            if answer.status >= 400:
                self.failed.append((source, name))
            return answer

        async def prefill(body: dict[str, Any]) -> web.StreamResponse:
            room = self.room(body)
            broken = name == self.broken
            if broken:
                self.prefill_legs += 1
            if broken and self.prefill_fault == "500":
                return _error("engine died")
            if broken and self.prefill_fault == "dead":
                await asyncio.sleep(0.05)  # after its decode leg's failure
                return _error("engine died")
            if broken and self.prefill_fault == "stuck":
                await self.release.wait()  # up, but answers nothing, nor sends any KV
                return _error("engine died")
            await asyncio.wait_for(room.wait(), 10)
            if broken and self.prefill_fault == "now_and_then" and self.prefill_legs % 2:
                self.lost.add(body["bootstrap_room"])
                self.moved(body).set()
                await self.release.wait()
                return _error("engine died")
            self.moved(body).set()
            if broken and self.prefill_fault == "hang":
                await self.release.wait()
            self.prefill_answers += 1
            details = {"cached_tokens": self.prefill_cached}
            usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": details}
            return web.json_response({"choices": [], "usage": usage})

        async def decode(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            room = self.room(body)
            if name == self.broken:
                self.decode_legs += 1
                if not self.now_and_then or self.decode_legs % 2:
                    return _error("engine died", self.decode_status)
            if body["bootstrap_port"] == DEAD_BOOTSTRAP_PORT:
                return _error("KV transfer failed")  # the prefill worker's bootstrap server is down
            room.set()
            await asyncio.wait_for(self.moved(body).wait(), 10)
            if body["bootstrap_room"] in self.lost:
                return _error("KV transfer failed")
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
        return self.breaker(name).closed

    def breaker(self, name: str) -> CircuitBreaker:
        return self.state.registry.pools["p"].workers[WorkerId(self.urls[name])].breaker

    async def chat(self, stream: bool = False) -> httpx.Response:
        messages = [{"role": "user", "content": "hi"}]
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 2}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return await self.client.post("/v1/chat/completions", json=body, headers=KEY)


@contextlib.asynccontextmanager
async def sglang_rig(
    fleet: Fleet, prefills: int = 1, read_s: float = 10.0, decodes: int = 2, connect_s: float = 1.0
) -> AsyncIterator[Rig]:
    """The gateway in front of `fleet`'s workers p1.. and d1..; `connect_s` is also how long a
    prefill leg still out is waited for after its decode worker's 5xx (`pd_legs.both_legs`)."""
    names = [f"p{i + 1}" for i in range(prefills)] + [f"d{i + 1}" for i in range(decodes)]
    async with contextlib.AsyncExitStack() as stack:
        urls = {name: await serve_in(stack, fleet.app(name)) for name in names}
        stack.callback(fleet.finish)
        ports = {urls[f"p{i + 1}"]: BOOTSTRAP_PORTS + i + 1 for i in range(prefills)}
        if fleet.prefill_fault in ("dead", "stuck"):
            ports[urls["p1"]] = DEAD_BOOTSTRAP_PORT
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
                        "bootstrap_ports": ports,
                        "conditional": False,
                    },
                    "retry_attempts": 2,
                    "timeouts": {"connect_s": connect_s, "read_s": read_s, "total_s": 30},
                }
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        yield Rig(gw.client, gw.state, urls, capture_access(gw.state))
