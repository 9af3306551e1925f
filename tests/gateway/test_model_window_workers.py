"""A pool that states no `max_model_len` learns each model's context window from its workers'
`/v1/models` cards: real emulated vLLM workers (`--max-model-len`) on 127.0.0.1, and scripted
workers whose answers are broken, or that restart in place behind a healthy `/health`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.gauges import refresh_gauges
from gateway.model_window import MAX_MODELS_ANSWER_BYTES
from gateway.registry import Pool
from policies import make_policy
from policies.base import WorkerId
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.processes import Proc, free_port, start_emulator
from tests.support.wait import wait_until

SECRET = b"model-window-test-secret"
KEY = {"authorization": "Bearer sk"}
ADMIN = {"authorization": "Bearer sk-admin"}
HUGE = 10**15


def _config(workers: list[str], **pool: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "workers": workers,
                "health": {"interval_s": 0.05, "timeout_s": 0.5, "failures_to_down": 1},
                **pool,
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk")]}],
        "admin": {"api_key_hash": hash_api_key(SECRET, "sk-admin")},
        "scrape": {"enabled": False},
    }


@contextlib.asynccontextmanager
async def _gateway(config: dict[str, Any]) -> AsyncIterator[InProcessGateway]:
    async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
        yield gw


@contextlib.contextmanager
def _emulators(*windows: int, key: str | None = None) -> Iterator[list[tuple[str, Proc]]]:
    """One emulated vLLM worker serving `m` per window, each with that `--max-model-len`."""
    started: list[tuple[str, Proc]] = []
    try:
        for window in windows:
            args = ["--model", "m", "--max-model-len", str(window), "--time-scale", "100"]
            started.append(start_emulator(*args, *(["--api-key", key] if key else [])))
        yield started
    finally:
        for _, proc in started:
            proc.stop()


async def _card(gw: InProcessGateway) -> dict[str, Any]:
    resp = await gw.client.get("/v1/models/m", headers=KEY)
    assert resp.status_code == 200
    card: dict[str, Any] = resp.json()
    return card


async def _window(gw: InProcessGateway) -> int | None:
    window: int | None = (await _card(gw)).get("max_model_len")
    return window


async def _chat(gw: InProcessGateway, max_tokens: int) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return await gw.client.post("/v1/chat/completions", json=body, headers=KEY)


def _pool(gw: InProcessGateway) -> Pool:
    return gw.state.registry.pools["p"]


async def _status(gw: InProcessGateway) -> dict[str, Any]:
    pool: dict[str, Any] = (await gw.client.get("/admin/status", headers=ADMIN)).json()["pools"][0]
    return pool


@pytest.mark.e2e
async def test_learns_the_workers_window_shows_it_and_refuses_a_budget_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker wants its API key on /v1 routes: the cards are read with it, as health checks are.
    monkeypatch.setenv("EMU_KEY", "wk")
    with _emulators(4096, key="wk") as [(url, _)]:
        async with _gateway(_config([url], worker_api_key_env="EMU_KEY")) as gw:
            assert await wait_until(lambda: _window(gw), what="the card shows the window") == 4096
            card = await _card(gw)
            assert list(card)[-2:] == ["max_model_len", "permission"]  # where vLLM puts it
            assert (await gw.client.get("/v1/models", headers=KEY)).json()["data"] == [card]

            refused = await _chat(gw, 4097)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["code"] == "integer_above_max_value" and error["param"] == "max_tokens"
            assert "maximum context length is 4096 tokens" in error["message"]
            assert (await _chat(gw, 8)).status_code == 200

            status = await _status(gw)
            assert status["max_model_len"] == {"m": {"tokens": 4096, "source": "workers"}}
            assert status["workers"][0]["max_model_len"] == {"m": 4096}


@pytest.mark.e2e
async def test_the_smallest_window_of_the_live_workers_counts() -> None:
    with _emulators(8192, 4096) as [(large, _), (small, small_proc)]:
        async with _gateway(_config([large, small])) as gw:
            pool = _pool(gw)
            await wait_until(lambda: all(pool.windows.reported(w) for w in pool.workers), what="both read")
            assert await _window(gw) == 4096
            assert (await _chat(gw, 5000)).json()["error"]["code"] == "integer_above_max_value"
            # The smaller worker goes away: a request can land only on the larger one now.
            small_proc.stop()
            assert await wait_until(lambda: pool.windows.max_model_len.get("m") == 8192)
            assert await _window(gw) == 8192
            assert (await _chat(gw, 5000)).status_code == 200
            refresh_gauges(gw.state)
            metrics = gw.state.routing.metrics.render().decode()
            assert 'kvgate_model_context_window_tokens{model="m",pool="p"} 8192.0' in metrics


@pytest.mark.e2e
async def test_a_stated_window_wins_over_the_workers() -> None:
    with _emulators(4096, 1024) as [(larger, _), (smaller, _)]:
        config = _config([larger, smaller], max_model_len=2048)
        async with _gateway(config) as gw:
            pool = _pool(gw)
            await wait_until(lambda: all(pool.windows.reported(w) for w in pool.workers), what="both read")
            assert await _window(gw) == 2048
            assert (await _chat(gw, 2049)).json()["error"]["code"] == "integer_above_max_value"
            assert (await _status(gw))["max_model_len"] == {"m": {"tokens": 2048, "source": "config"}}


@pytest.mark.e2e
async def test_a_worker_restarted_with_another_window_is_read_again() -> None:
    port = free_port()
    args = ("--model", "m", "--time-scale", "100")
    url, proc = start_emulator(*args, "--max-model-len", "4096", port=port)
    try:
        async with _gateway(_config([url])) as gw:
            assert await wait_until(lambda: _window(gw), what="the first window") == 4096
            proc.stop()
            worker = _pool(gw).workers[WorkerId(url)]
            await wait_until(lambda: not worker.healthy, what="the worker is seen down")
            assert _pool(gw).windows.max_model_len == {}  # a down worker's window counts no more
            _, proc = await asyncio.to_thread(start_emulator, *args, "--max-model-len", "2048", port=port)
            assert await wait_until(lambda: _pool(gw).windows.max_model_len.get("m") == 2048)
            assert await _window(gw) == 2048
            assert (await _chat(gw, 2049)).status_code == 400
    finally:
        proc.stop()


# ---------------------------------------------------------------- scripted workers


@dataclass
class ScriptedWorker:
    """`/health` always 200; `/v1/models` answers `models` (raw bytes, or an HTTP status), or
    never when `hang`; `/metrics` shows `start_s` as the process start time; chat answers."""

    models: bytes | int
    hang: bool = False
    start_s: float = 1.7e9
    asked: int = 0  # `/v1/models` requests received
    url: str = ""
    released: asyncio.Event = field(default_factory=asyncio.Event)  # ends a hanging answer

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", _ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _models(self, _: web.Request) -> web.StreamResponse:
        self.asked += 1
        if self.hang:
            await self.released.wait()
        if isinstance(self.models, int):
            return web.Response(status=self.models)
        return web.Response(body=self.models, content_type="application/json")

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running 0\nprocess_start_time_seconds {self.start_s}\n")

    async def _chat(self, _: web.Request) -> web.Response:
        answer = {
            "id": "c",
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer)


@contextlib.asynccontextmanager
async def _scripted(*workers: ScriptedWorker) -> AsyncIterator[None]:
    runners = []
    try:
        for worker in workers:
            runner, port = await serve_app(worker.app())
            runners.append(runner)
            worker.url = f"http://127.0.0.1:{port}"
        yield
    finally:
        for worker in workers:
            worker.released.set()
        for runner in runners:
            await runner.cleanup()


async def _ok(_: web.Request) -> web.Response:
    return web.Response()


def _models(window: object) -> bytes:
    return orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": window}]})


async def test_broken_model_cards_leave_the_assumed_window_and_break_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cards = [{"id": "m", "object": "model", "max_model_len": 4096}]
    too_long = orjson.dumps({"object": "list", "data": cards, "pad": "x" * MAX_MODELS_ANSWER_BYTES})
    workers = [
        ScriptedWorker(404),
        ScriptedWorker(500),
        ScriptedWorker(b"<html>no</html>"),
        ScriptedWorker(too_long),
        ScriptedWorker(_models(2**40)),  # past any window
        ScriptedWorker(_models("4096")),
        ScriptedWorker(_models(True)),
        ScriptedWorker(_models(4096), hang=True),  # never answers: the read times out
    ]
    caplog.set_level(logging.INFO, logger="kvgate.model_window")
    async with _scripted(*workers):
        config = _config([w.url for w in workers])
        config["pools"][0]["health"]["timeout_s"] = 0.2
        async with _gateway(config) as gw:

            def read_by_all() -> bool:
                said = [r for r in caplog.records if r.getMessage() == "worker reports no context window"]
                return {r.__dict__["worker"] for r in said} == {w.url for w in workers}

            await wait_until(read_by_all, what="every worker's cards were read")
            assert all(w.asked for w in workers)
            assert "max_model_len" not in await _card(gw)
            assert _pool(gw).windows.max_model_len == {}
            assert (await _status(gw))["max_model_len"] == {"m": {"tokens": None, "source": None}}
            assert all(w.healthy for w in _pool(gw).workers.values())
            for _ in workers:  # every worker still serves, a budget past any window included
                assert (await _chat(gw, HUGE)).status_code == 200


async def test_a_worker_restarted_in_place_is_read_again_while_health_checks_pass() -> None:
    worker = ScriptedWorker(_models(4096))
    async with _scripted(worker):
        config = _config([worker.url])
        config["scrape"] = {"interval_s": 0.05, "timeout_s": 0.5}
        async with _gateway(config) as gw:
            pool = _pool(gw)
            await wait_until(lambda: pool.windows.max_model_len.get("m") == 4096, what="the first window")
            entry = next(iter(pool.workers.values()))
            await wait_until(lambda: entry.metrics is not None, what="a first scrape")
            asked = worker.asked
            # A new process at the URL, never seen down: its metrics tell, and its cards are read.
            worker.models, worker.start_s = _models(2048), worker.start_s + 60
            await wait_until(lambda: pool.windows.max_model_len.get("m") == 2048, what="the new window")
            assert worker.asked == asked + 1 and entry.healthy
            assert await _window(gw) == 2048
