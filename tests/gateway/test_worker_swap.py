"""A pool whose workers are swapped whole (a workers file naming only new ones) keeps serving: a
request arriving while the new worker's first health check is under way waits for it in the
pool's queue, where it used to get an immediate 503."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aiohttp import web

from gateway.auth import hash_api_key
from policies.registry import make_policy
from tests.support.inprocess import SECRET, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.wait import wait_until

KEY = {"Authorization": "Bearer sk-t"}


class Worker:
    """A worker whose health check answers only once `healthy` is set."""

    def __init__(self) -> None:
        self.healthy = asyncio.Event()
        self.chats = 0
        self.url = ""

    async def health(self, _: web.Request) -> web.Response:
        await self.healthy.wait()
        return web.Response(text="ok")

    async def chat(self, _: web.Request) -> web.Response:
        self.chats += 1
        message = {"role": "assistant", "content": "hi"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage,
            }
        )


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_a_request_during_a_whole_swap_waits_for_the_new_worker(tmp_path: Path) -> None:
    old, new = Worker(), Worker()
    old.healthy.set()
    runners = []
    for worker in (old, new):
        app = web.Application()
        app.router.add_get("/health", worker.health)
        app.router.add_post("/v1/chat/completions", worker.chat)
        runner, port = await serve_app(app)
        runners.append(runner)
        worker.url = f"http://127.0.0.1:{port}"
    workers = tmp_path / "workers.yaml"
    _write(workers, f"- {old.url}\n")
    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "workers_file": {"path": str(workers), "refresh_s": 0.1},
                "health": {"interval_s": 0.2, "timeout_s": 10.0},
                "retry_attempts": 0,
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
        "scrape": {"enabled": False},
    }
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    try:
        async with gateway_in_process(config, make_policy("round_robin")) as gw:
            pool = gw.state.registry.pools["p"]
            assert (await gw.client.post("/v1/chat/completions", json=body, headers=KEY)).status_code == 200
            _write(workers, f"- {new.url}\n")  # swapped whole: the old worker leaves at once
            await wait_until(lambda: list(pool.workers) == [new.url], what="the file read again")
            # The new worker's first health check hangs until released: the pool has no
            # routable worker yet, only one about to come.
            asked = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=body, headers=KEY))
            queue = gw.state.routing.queues["p"]
            await wait_until(lambda: queue.waiting == 1, what="the request waits in the queue")
            new.healthy.set()
            answer = await asyncio.wait_for(asked, 10)
            assert answer.status_code == 200, answer.text
            assert new.chats == 1 and old.chats == 1
    finally:
        for runner in runners:
            await runner.cleanup()
