"""A split request's time to first token counts from its first leg's dispatch: the prompt is
computed on the prefill worker, and the client waits for it.

The gateway runs in-process in front of a scripted vLLM prefill worker that takes 0.3 s and a
decode worker that streams at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import orjson
from aiohttp import web

from gateway.state import GatewayState
from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.routes_rig import Recording
from tests.support.gateway_config import pd_pool, tenant
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_worker
from tests.support.metrics import metric_total

SECRET = b"pd-ttft"
KEY = {"authorization": "Bearer sk-t"}
PREFILL_S = 0.3
_PARAMS = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_request_id": "r"}


async def _prefill(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(PREFILL_S)
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    return web.json_response({"choices": [], "usage": usage, "kv_transfer_params": _PARAMS})


async def _decode(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    usage = {"prompt_tokens": 8, "completion_tokens": 1}
    for chunk in ({"choices": [{"index": 0, "delta": {"content": "ok"}}]}, {"choices": [], "usage": usage}):
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextlib.asynccontextmanager
async def rig() -> AsyncIterator[tuple[httpx.AsyncClient, GatewayState, AccessLines]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await serve_worker(stack, {"/v1/chat/completions": h}) for h in (_prefill, _decode)]
        config = {
            "pools": [pd_pool(urls[:1], urls[1:])],
            "tenants": [tenant("t", "sk-t", SECRET)],
            "scrape": {"enabled": False},
        }
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        yield gw.client, gw.state, capture_access(gw.state)


async def test_a_split_requests_ttft_includes_its_prefill_leg() -> None:
    async with rig() as (client, state, lines):
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": "m", "messages": messages, "max_tokens": 1, "stream": True}
        resp = await client.post("/v1/chat/completions", json=body, headers=KEY)
        assert resp.status_code == 200
        lines.flush()
        (line,) = lines.records
        assert line["reason"] == "pd_split" and line["ttft_ms"] >= PREFILL_S * 1000
        assert metric_total(state, "kvgate_time_to_first_token_seconds_sum") >= PREFILL_S
        # The decode worker's own time to first token is still the decode leg's alone.
        decode_ttft = metric_total(state, "kvgate_pd_time_to_first_token_seconds_sum", role="decode")
        assert 0 < decode_ttft < PREFILL_S
