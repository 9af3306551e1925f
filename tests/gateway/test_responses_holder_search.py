"""The search for the holder of a tenant's own stored response that this gateway process does not
know (`GET` and `cancel` through a process other than the one that routed it, or after a restart)
finds the worker that holds it, whatever the other pools' workers answer: a worker whose model
serves no Responses API (vLLM answers its 400 "The model does not support Responses API" to every
`/v1/responses/{id}` route, an embeddings pool's for instance) holds nothing."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from aiohttp import web

from gateway.auth import hash_api_key
from tests.gateway.routes_rig import Recording
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"holder-search"
KEY = {"authorization": "Bearer sk-t"}
_NO_RESPONSES_API = {
    "error": {"message": "The model does not support Responses API", "type": "BadRequestError",
              "param": None, "code": 400},
}  # fmt: skip


@dataclass
class EmbeddingsWorker:
    """A vLLM worker serving an embedding model: no Responses API."""

    asked: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/responses/{rid}", self._refuse)
        app.router.add_post("/v1/responses/{rid}/cancel", self._refuse)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _refuse(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        return web.json_response(_NO_RESPONSES_API, status=400)


@dataclass
class Deployment:
    embeddings: EmbeddingsWorker
    chat: RoutesWorker
    urls: list[str]


@contextlib.asynccontextmanager
async def deployment() -> AsyncIterator[Deployment]:
    embeddings, chat = EmbeddingsWorker(), RoutesWorker("chat")
    emb_runner, emb_port = await serve_app(embeddings.app())
    chat_runner = await start(chat)
    try:
        yield Deployment(embeddings, chat, [f"http://127.0.0.1:{emb_port}", chat.url])
    finally:
        await chat_runner.cleanup()
        await emb_runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(d: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    """One gateway process of the deployment: the embeddings pool is listed first."""
    config = {
        "pools": [
            {"name": "emb", "models": ["e"], "workers": [d.urls[0]], "retry_attempts": 0},
            {"name": "p", "models": ["m"], "workers": [d.urls[1]], "retry_attempts": 0},
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(config, Recording(), secret=SECRET) as gw:
        yield gw.client


async def test_a_worker_without_the_responses_api_does_not_end_the_search() -> None:
    async with deployment() as d:
        async with gateway(d) as first:
            created = await first.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=KEY)
            assert created.status_code == 200
            rid = created.json()["id"]
        async with gateway(d) as restarted:
            got = await restarted.get(f"/v1/responses/{rid}", headers=KEY)
            assert got.status_code == 200, got.text
            assert got.json()["id"] == rid
        async with gateway(d) as another:
            # The holder's own answer to a cancel (this worker cancels nothing), not the other pool's.
            cancel = await another.post(f"/v1/responses/{rid}/cancel", headers=KEY)
            assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")
            assert d.chat.received[-1].path == f"/v1/responses/{rid}/cancel"
