"""What the scripted chat workers of the breaker, first-event and worker-error rigs share: a chat
answer (whole or streamed), a vLLM prefill leg's answer, the workers served on 127.0.0.1 one per
name, and a worker of the gateway's registry by its URL."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.state import GatewayState
from gateway.worker import Worker
from policies import make_policy
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import Handler, serve_app

USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def chat_answer(stream: bool, content: str = "hi") -> web.Response:
    """A served chat completion: one JSON object, or one chunk and `[DONE]` as an event stream."""
    if not stream:
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [choice], "usage": USAGE}
        )
    delta = {
        "id": "x",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}],
    }
    return web.Response(
        body=b"data: " + orjson.dumps(delta) + b"\n\ndata: [DONE]\n\n", content_type="text/event-stream"
    )


def is_prefill_leg(body: Mapping[str, Any]) -> bool:
    """Whether `body` is a vLLM prefill/decode pool's prefill leg (`do_remote_decode`)."""
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def prefilled() -> web.Response:
    """A vLLM prefill leg's answer: the KV is ready for the decode worker."""
    params = {"remote_engine_id": "e", "remote_block_ids": [1]}
    return web.json_response({"id": "p", "choices": [], "usage": USAGE, "kv_transfer_params": params})


def chat_app(chat: Handler, completions: Handler | None = None) -> web.Application:
    """A scripted worker: `chat` answers `POST /v1/chat/completions`, `completions` (when given)
    `POST /v1/completions` (the breakers' canaries: `gateway/canary.py`; without it they get a
    404, which decides nothing), `/health` is always ok."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    if completions is not None:
        app.router.add_post("/v1/completions", completions)
    return app


@contextlib.asynccontextmanager
async def served(
    names: Iterable[str], app_for: Callable[[str], web.Application], *, handler_cancellation: bool = False
) -> AsyncIterator[dict[str, str]]:
    """Serve `app_for(name)` for each name on a port of its own; yields each name's base URL and
    cleans every runner up on the way out. With `handler_cancellation` a handler is cancelled
    when the gateway closes its connection."""
    runners: list[web.AppRunner] = []
    urls: dict[str, str] = {}
    try:
        for name in names:
            runner, port = await serve_app(app_for(name), handler_cancellation=handler_cancellation)
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


def registry_worker(state: GatewayState, pool: str, url: str) -> Worker:
    """The worker of `pool` at `url` in the gateway's registry."""
    (worker,) = (w for w in state.registry.pools[pool].workers.values() if w.url == url)
    return worker


@dataclass
class ChatRig:
    """A gateway in process over scripted workers: its client, its state, each worker's URL by
    name."""

    client: httpx.AsyncClient
    state: GatewayState
    urls: dict[str, str]

    def worker(self, pool: str, name: str) -> Worker:
        """Worker `name` as pool `pool` of the gateway's registry holds it."""
        return registry_worker(self.state, pool, self.urls[name])


@contextlib.asynccontextmanager
async def round_robin_gateway(
    pools: list[dict[str, Any]], keys: Mapping[str, str], secret: bytes
) -> AsyncIterator[InProcessGateway]:
    """A gateway in process routing `pools` round robin, one tenant per name of `keys` holding its
    key, no scrapes (the scripted workers serve no metrics)."""
    tenants = [{"name": name, "api_key_hashes": [hash_api_key(secret, key)]} for name, key in keys.items()]
    config = {"pools": pools, "tenants": tenants, "scrape": {"enabled": False}}
    async with gateway_in_process(config, make_policy("round_robin"), secret=secret) as gw:
        yield gw
