"""A worker's own error event in a stream counts against no worker: the worker answered, it blamed
itself for this one request (vLLM's 500 `GenerationError`, which a client's input can cause), and
nothing compares it with another worker's answer, since the client already has the stream.
Counted at once, one tenant's streams that fail so opened the breakers of a pool's workers one
after another, for every tenant (`streaming.ProxyStream._failure`). The client's answer is what
it was: the worker's error as the stream's last event, 502 on the access line. A stream cut
without `[DONE]`, or a broken error event, still counts: no client input causes those."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.state import GatewayState
from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.chat_rig import (
    ChatRig,
    chat_answer,
    chat_app,
    is_prefill_leg,
    prefilled,
    registry_worker,
    round_robin_gateway,
    served,
)
from tests.support.transports import TRANSPORTS, through
from tests.support.wait import wait_until

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
NAMES = ("a", "b", "p", "c", "d")
THRESHOLD = 3

# What a worker streams for a prompt after its head, one SSE event's data each; at `RELAYED` it
# waits until the gateway has read what it sent before (its first event: the stream has reached
# the client), so what follows comes mid-stream.
RELAYED = b""
FIRST = orjson.dumps(
    {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "par"}}]}
)
FAILED = {"error": {"message": "GenerationError", "type": "InternalServerError", "code": 500}}
SCRIPTS: dict[str, list[bytes]] = {
    "fails-500": [FIRST, RELAYED, orjson.dumps(FAILED), b"[DONE]"],
    "fails-no-code": [FIRST, RELAYED, orjson.dumps({"error": {"message": "engine error"}}), b"[DONE]"],
    "fails-at-once": [orjson.dumps(FAILED), b"[DONE]"],
    "broken-error": [FIRST, RELAYED, b'{"error": {"message": "cut', b"[DONE]"],
    "cut": [FIRST, RELAYED],  # then the connection closes, without [DONE]
}
POOLS = {"a": "two", "b": "two", "p": "pd", "c": "pd", "d": "pd"}
HEAD_500 = "head-500-on-a"  # worker `a` answers 500 to it; any other worker fails it in its first event


@dataclass
class Workers:
    posts: list[str] = field(default_factory=list)
    state: GatewayState | None = None  # the gateway in front of them, once it runs
    urls: dict[str, str] = field(default_factory=dict)

    def relayed(self, name: str) -> bool:
        """Whether the gateway has read the first events of worker `name`'s stream in flight
        (`Worker.first_token`: the stream's decode context joins the worker's load)."""
        assert self.state is not None
        return registry_worker(self.state, POOLS[name], self.urls[name]).decode_context > 0


@dataclass
class Rig(ChatRig):
    workers: Workers
    lines: AccessLines

    async def chat(self, model: str, prompt: str = "hi", *, tenant: str = "t") -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )

    def failures(self, pool: str, names: str) -> dict[str, int]:
        return {name: self.worker(pool, name).breaker.failures for name in names}

    def all_closed(self, pool: str, names: str) -> bool:
        return all(self.worker(pool, name).breaker.closed for name in names)

    def outcomes(self, pool: str, name: str) -> dict[str, float]:
        """`kvgate_worker_requests_total` of worker `name` of `pool`, by outcome."""
        url = self.urls[name]
        page = self.state.routing.metrics.render().decode()
        return {
            s.labels["outcome"]: s.value
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == "kvgate_worker_requests_total"
            and (s.labels["pool"], s.labels["worker"]) == (pool, url)
        }


def _events(resp: httpx.Response) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in resp.content.split(b"\n\n") if e]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    workers = Workers()

    def app_for(name: str) -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body: dict[str, Any] = await request.json()
            workers.posts.append(name)
            prompt = body["messages"][0]["content"]
            if is_prefill_leg(body):
                return prefilled()
            if prompt == HEAD_500:
                if name == "a":
                    return web.json_response(FAILED, status=500)
                prompt = "fails-at-once"
            if prompt not in SCRIPTS:
                return chat_answer(True, "ok")
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for data in SCRIPTS[prompt]:
                if data is RELAYED:
                    await wait_until(lambda: workers.relayed(name), what="the first event read")
                else:
                    await resp.write(b"data: " + data + b"\n\n")
            if prompt == "cut":
                assert request.transport is not None
                request.transport.close()
            return resp

        return chat_app(chat)

    async with served(NAMES, app_for) as urls:
        # Health checks only at the start: every worker stays healthy, so only breakers decide.
        common = {
            "retry_attempts": 2,
            "breaker": {"failure_threshold": THRESHOLD, "cooldown_s": 3600},
            "health": {"interval_s": 3600},
        }
        pools = [
            {"name": "two", "models": ["m2"], "workers": [urls["a"], urls["b"]], **common},
            {
                "name": "pd",
                "models": ["pd"],
                "prefill_workers": [urls["p"]],
                "decode_workers": [urls["c"], urls["d"]],
                "pd": {"protocol": "vllm", "conditional": False},  # a pair whenever one is free
                **common,
            },
        ]
        workers.urls = urls
        async with round_robin_gateway(pools, KEYS, SECRET) as gw:
            workers.state = gw.state
            yield Rig(gw.client, gw.state, urls, workers, capture_access(gw.state))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("prompt", ["fails-500", "fails-no-code", "fails-at-once"])
async def test_one_tenants_streams_failing_mid_answer_open_no_breaker(
    rig: Rig, transport: str, prompt: str
) -> None:
    through(rig.state, transport)
    for _ in range(2 * THRESHOLD):  # round robin: THRESHOLD on each worker
        resp = await rig.chat("m2", prompt)
        # The client's answer is unchanged: the worker's error, rewritten, then [DONE].
        assert resp.status_code == 200
        *_, error, done = _events(resp)
        assert orjson.loads(error)["error"]["code"] == "upstream_stream_error" and done == b"[DONE]"
        line = rig.lines.of(resp.headers["x-request-id"])
        assert (line["status"], line["error"]) == (502, "upstream_stream_error")
    assert sorted(rig.workers.posts) == ["a"] * THRESHOLD + ["b"] * THRESHOLD
    assert rig.failures("two", "ab") == {"a": 0, "b": 0} and rig.all_closed("two", "ab")
    # Labelled as what happened: the worker failed the request, though its breaker was not told.
    assert rig.outcomes("two", "a") == {"worker_failed": THRESHOLD}
    rig.workers.posts.clear()
    for _ in range(4):  # another tenant's requests still go to both workers
        assert (await rig.chat("m2", tenant="u")).status_code == 200
    assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]


async def test_a_pd_decode_workers_error_event_mid_stream_opens_no_breaker(rig: Rig) -> None:
    for _ in range(2 * THRESHOLD):
        resp = await rig.chat("pd", "fails-500")
        assert resp.status_code == 200 and b"upstream_stream_error" in resp.content
    # One round each (a prefill leg, a decode leg), however the policy spreads the decode legs.
    assert rig.workers.posts.count("p") == 2 * THRESHOLD
    assert rig.workers.posts.count("c") + rig.workers.posts.count("d") == 2 * THRESHOLD
    assert rig.failures("pd", "pcd") == dict.fromkeys("pcd", 0) and rig.all_closed("pd", "pcd")
    assert (await rig.chat("pd", tenant="u")).status_code == 200


async def test_a_stream_failing_in_its_first_event_convicts_no_earlier_worker(rig: Rig) -> None:
    # `a` answers 500 (held), then `b` takes the request and fails it in its first event: `b`
    # did not serve it, so nothing shows `a`'s 500 to be `a`'s.
    for _ in range(2):  # round robin: one starts at `a`, one at `b`
        resp = await rig.chat("m2", HEAD_500)
        assert resp.status_code == 200 and b"upstream_stream_error" in resp.content
    assert "a" in rig.workers.posts and rig.workers.posts.count("b") == 2
    assert rig.failures("two", "ab") == {"a": 0, "b": 0} and rig.all_closed("two", "ab")


@pytest.mark.parametrize("prompt", ["cut", "broken-error"])
async def test_a_stream_cut_or_broken_still_counts_against_its_worker(rig: Rig, prompt: str) -> None:
    for _ in range(2):  # one on each worker
        resp = await rig.chat("m2", prompt)
        assert resp.status_code == 200 and b"upstream_stream_error" in resp.content
    assert rig.failures("two", "ab") == {"a": 1, "b": 1}


async def test_a_half_open_workers_trial_ending_in_its_error_event_is_freed(rig: Rig) -> None:
    long_ago_s = time.monotonic() - 2 * 3600  # past the breakers' cooldown
    for name in "ab":
        breaker = rig.worker("two", name).breaker
        for _ in range(THRESHOLD):
            breaker.on_failure(long_ago_s, trial=None)
    # Both half-open: the first request is `a`'s trial, the second `b`'s.
    for _ in range(2):
        assert (await rig.chat("m2", "fails-500")).status_code == 200
    assert sorted(rig.workers.posts) == ["a", "b"]
    # No verdict either way: each trial is freed, and the next request is a trial again.
    rig.workers.posts.clear()
    for _ in range(2):
        assert (await rig.chat("m2", tenant="u")).status_code == 200
    assert sorted(rig.workers.posts) == ["a", "b"] and rig.all_closed("two", "ab")
