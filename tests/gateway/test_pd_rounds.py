"""A prefill/decode request's rounds after failures: what they count.

The gateway runs in-process in front of a scripted vLLM prefill worker and two decode workers
whose answers follow one shared script (the n-th request any decode worker gets has the n-th
status)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from gateway.state import GatewayState
from tests.gateway.routes_rig import Recording
from tests.support.gateway_config import pd_pool, tenant
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_worker
from tests.support.metrics import metric_total

SECRET = b"k"
KEY = {"authorization": "Bearer sk-t"}
SLOW_S = 1.0
_PARAMS = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_request_id": "r"}


@dataclass
class Script:
    """The statuses decode workers answer with, in order (then 200; 0 is a 200 whose body is not
    JSON, -1 a 200 after `SLOW_S`), and what they were sent."""

    statuses: list[int]
    decode_bodies: list[dict[str, Any]] = field(default_factory=list)
    params: bool = True  # the prefill answer names its KV (a vLLM server without a connector does not)

    async def prefill(self, request: web.Request) -> web.Response:
        await request.json()
        usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        answer: dict[str, Any] = {"choices": [], "usage": usage}
        if self.params:
            answer["kv_transfer_params"] = _PARAMS
        return web.json_response(answer)

    async def responses(self, request: web.Request) -> web.Response:
        """vLLM names a stored response after the body's `request_id` (the gateway sets it)."""
        body = await request.json()
        usage = {"input_tokens": 8, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 0}}
        return web.json_response(
            {"id": body["request_id"], "object": "response", "output": [], "usage": usage}
        )

    async def decode(self, request: web.Request) -> web.Response:
        self.decode_bodies.append(await request.json())
        status = self.statuses.pop(0) if self.statuses else 200
        if status == -1:
            await asyncio.sleep(SLOW_S)
            status = 200
        if status == 0:
            return web.Response(text="not json", content_type="application/json")
        if status != 200:
            return web.json_response({"error": {"message": "no", "code": status}}, status=status)
        return web.json_response({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}})


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    script: Script

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.state, name, **labels)

    async def chat(self) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        return await self.client.post("/v1/chat/completions", json=body, headers=KEY)


@contextlib.asynccontextmanager
async def pd_rig(statuses: list[int], *, params: bool = True, read_s: float = 60.0) -> AsyncIterator[Rig]:
    script = Script(statuses, params=params)
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            await serve_worker(stack, {"/v1/chat/completions": handler, "/v1/responses": script.responses})
            for handler in (script.prefill, script.decode, script.decode)
        ]
        pool = pd_pool(urls[:1], urls[1:], retry_attempts=2, timeouts={"read_s": read_s})
        config = {"pools": [pool], "tenants": [tenant("t", "sk-t", SECRET)], "scrape": {"enabled": False}}
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        yield Rig(gw.client, gw.state, script)


async def test_a_request_recomputed_twice_is_one_skipped_split() -> None:
    """The transfer fails (the decode worker's 500), the request is recomputed alone on a decode
    worker that fails too, then on the other, which serves it: one request run alone."""
    async with pd_rig([500, 500]) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        sent = rig.script.decode_bodies
        assert ["kv_transfer_params" in body for body in sent] == [True, False, False]
        assert rig.metric("kvgate_pd_requests_total", role="alone") == 2  # requests sent to workers
        assert rig.metric("kvgate_pd_skipped_splits_total") == 1
        assert rig.metric("kvgate_pd_skipped_splits_total", reason="transfer_failed") == 1
        assert rig.metric("kvgate_pd_transfer_outcomes_total", outcome="recomputed") == 1
        assert rig.metric("kvgate_pd_transfer_outcomes_total", outcome="decode_error") == 1


async def test_a_responses_follow_up_is_an_unsplittable_request() -> None:
    """vLLM runs Responses requests alone, and a follow-up on the worker holding its state: each is
    a skipped split of a request that cannot be split, as the first turn is."""
    async with pd_rig([]) as rig:
        first = await rig.client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=KEY)
        assert first.status_code == 200
        body = {"model": "m", "input": "and?", "previous_response_id": first.json()["id"]}
        follow_up = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert follow_up.status_code == 200
        assert rig.metric("kvgate_pd_skipped_splits_total") == 2
        assert rig.metric("kvgate_pd_skipped_splits_total", reason="unsplittable") == 2


async def test_a_decode_failure_without_a_transfer_is_no_transfer_failure() -> None:
    """The prefill answer carried no `kv_transfer_params`, so the decode leg moved no KV: its 500
    is the decode worker's own failure, retried as any other (here on the other decode worker,
    split again), not a failed transfer recomputed alone."""
    async with pd_rig([500], params=False) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert rig.metric("kvgate_pd_transfers_total") == 0
        assert rig.metric("kvgate_pd_transfer_failures_total") == 0
        assert rig.metric("kvgate_pd_transfer_outcomes_total") == 0
        assert rig.metric("kvgate_pd_leg_failures_total", role="decode", reason="worker_error") == 1
        assert rig.metric("kvgate_pd_requests_total", role="decode") == 2
        assert rig.metric("kvgate_pd_skipped_splits_total") == 0


async def test_a_malformed_decode_answer_is_no_transfer_ok() -> None:
    """The decode worker answers 200 with a body that is not JSON: its own failure (a new round,
    on the other decode worker), and only the transfer that led to an answer counts as `ok`."""
    async with pd_rig([0]) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert rig.metric("kvgate_pd_transfers_total") == 2
        assert rig.metric("kvgate_pd_transfer_outcomes_total", outcome="ok") == 1
        assert rig.metric("kvgate_pd_leg_failures_total", role="decode") == 1


async def test_a_whole_decode_answer_past_read_s_is_the_decode_workers_timeout() -> None:
    """vLLM sends nothing of a whole answer before it is complete: a decode leg that runs past
    `read_s` is that worker's read timeout, not a failed transfer; the next round splits again, on
    the other decode worker."""
    async with pd_rig([-1], read_s=SLOW_S / 3) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert ["kv_transfer_params" in body for body in rig.script.decode_bodies] == [True, True]
        assert rig.metric("kvgate_pd_transfer_failures_total") == 0
        assert rig.metric("kvgate_pd_leg_failures_total", role="decode", reason="read_timeout") == 1
        assert rig.metric("kvgate_pd_skipped_splits_total") == 0
