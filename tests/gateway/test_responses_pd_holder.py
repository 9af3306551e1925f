"""A Responses request split between a prefill and a decode worker under SGLang's protocol sends
both legs the same body, its `request_id` too; the gateway asks the prefill leg not to store it
(`store: false`), but a prefill worker that stores responses anyway keeps a copy under the
response's id. The client's response is the decode worker's: a gateway process
that does not know the id finds it there, for a follow-up, a retrieve and a cancel alike, and
never pins a follow-up to the prefill worker (which takes generation requests only as half of a
pair)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.auth import hash_api_key
from tests.gateway.routes_rig import Recording
from tests.gateway.routes_worker import RoutesWorker, start
from tests.support.inprocess import gateway_in_process

SECRET = b"pd-holder"
KEY = {"authorization": "Bearer sk-t"}


@contextlib.asynccontextmanager
async def pd_workers() -> AsyncIterator[tuple[RoutesWorker, RoutesWorker]]:
    prefill, decode = RoutesWorker("prefill", ignores_store=True), RoutesWorker("decode")
    runners = [await start(prefill), await start(decode)]
    # A pool's workers are in the order of their URLs: the prefill worker's comes first.
    decode.url = decode.url.replace("127.0.0.1", "localhost")
    try:
        yield prefill, decode
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(prefill: RoutesWorker, decode: RoutesWorker) -> AsyncIterator[httpx.AsyncClient]:
    """One gateway process of the deployment: a pair for every request."""
    config = {
        "pools": [
            {
                "name": "p",
                "models": ["m"],
                "prefill_workers": [prefill.url],
                "decode_workers": [decode.url],
                "pd": {"protocol": "sglang", "conditional": False, "bootstrap_port": 8998},
                "retry_attempts": 0,
            }
        ],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
        "scrape": {"enabled": False},
    }
    async with gateway_in_process(config, Recording(), secret=SECRET) as gw:
        yield gw.client


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_workers_response_is_found_not_the_prefill_workers_copy(stream: bool) -> None:
    async with pd_workers() as (prefill, decode):
        async with gateway(prefill, decode) as first:
            body = {"model": "m", "input": "hello", "stream": stream}
            created = await first.post("/v1/responses", json=body, headers=KEY)
            assert created.status_code == 200
            rid = created.text.split('"id":"', 1)[1].split('"', 1)[0]
        # Both legs carried the id: the prefill worker, which ignores `store: false`, holds a copy.
        assert rid in prefill.responses and rid in decode.responses
        asked = len(prefill.received)
        async with gateway(prefill, decode) as restarted:
            got = await restarted.get(f"/v1/responses/{rid}", headers=KEY)
            assert got.status_code == 200 and decode.received[-1].path == f"/v1/responses/{rid}"
        async with gateway(prefill, decode) as another:
            cancel = await another.post(f"/v1/responses/{rid}/cancel", headers=KEY)
            assert (cancel.status_code, cancel.json()["error"]["message"]) == (400, "cannot cancel")
            assert decode.received[-1].path == f"/v1/responses/{rid}/cancel"
        async with gateway(prefill, decode) as third:
            follow_up = {"model": "m", "input": "and?", "previous_response_id": rid}
            resp = await third.post("/v1/responses", json=follow_up, headers=KEY)
            # Found on the decode server, which cannot continue it alone: refused as a known
            # holder's follow-up is (`test_responses_holder_pd`), after asking only that server.
            assert resp.status_code == 400, resp.text
            assert decode.received[-1].path == f"/v1/responses/{rid}"
        # The prefill worker was never asked, nor sent the follow-up.
        assert len(prefill.received) == asked
