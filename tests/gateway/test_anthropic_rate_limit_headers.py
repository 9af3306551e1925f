"""On the Messages routes a tenant's rate limits are Anthropic's headers: `anthropic-ratelimit-
{requests,tokens}-{limit,remaining,reset}`, the reset an RFC 3339 time at which the bucket is
full again, with `retry-after` on a quota's 429; OpenAI's `x-ratelimit-*` stay on the other
routes. Whole answers, streams, `count_tokens`, the quotas' 429s (before the body is read, and for
tokens once it is) and the gateway's own errors after admission carry them, and a browser page may
read them (`cors.expose_headers` by default)."""

from __future__ import annotations

import calendar
import contextlib
import math
import re
import time
from typing import Any

import httpx
from aiohttp import web

from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_worker

KEY = {"x-api-key": "sk-limited", "anthropic-version": "2023-06-01"}
BODY: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
APP = "https://app.example"
RFC_3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def _config(url: str, **quotas: int) -> dict[str, Any]:
    return {
        "pools": [{"name": "p", "models": ["m"], "workers": [url]}],
        "tenants": [tenant("limited", "sk-limited", quotas=quotas or {"rpm": 3, "tpm": 100_000})],
        "scrape": {"enabled": False},
        "cors": {"allow_origins": [APP]},
    }


def _anthropic(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("anthropic-ratelimit-")}


def _openai(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("x-ratelimit-")}


def _unix(stamp: str) -> int:
    assert RFC_3339_UTC.fullmatch(stamp), stamp
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))


async def test_messages_answers_carry_anthropics_headers_in_place_of_openais(emulator: str) -> None:
    async with gateway_in_process(_config(emulator), RoundRobin(), secret=SECRET) as gw:
        before_s = time.time()
        first = await gw.client.post("/v1/messages", json=BODY, headers=KEY)
        after_s = time.time()
        assert first.status_code == 200, first.text
        limits = _anthropic(first)
        assert set(limits) == {
            f"anthropic-ratelimit-{unit}-{what}"
            for unit in ("requests", "tokens")
            for what in ("limit", "remaining", "reset")
        }  # no input-tokens / output-tokens pair: kvgate's tpm is one bucket for both
        assert limits["anthropic-ratelimit-requests-limit"] == "3"
        assert limits["anthropic-ratelimit-requests-remaining"] == "2"
        assert limits["anthropic-ratelimit-tokens-limit"] == "100000"
        assert 0 < int(limits["anthropic-ratelimit-tokens-remaining"]) < 100_000  # the prompt was charged
        # rpm 3: the request taken comes back 20 s after it was charged, and the time is rounded up
        # to the second.
        full_at = _unix(limits["anthropic-ratelimit-requests-reset"])
        assert math.ceil(before_s + 20) <= full_at <= math.ceil(after_s + 20)
        assert (
            math.floor(before_s)
            <= _unix(limits["anthropic-ratelimit-tokens-reset"])
            <= math.ceil(after_s + 60)
        )
        assert _openai(first) == {}  # an Anthropic client reads no other
        assert first.headers["request-id"] == first.headers["x-request-id"]

        streamed = await gw.client.post("/v1/messages", json={**BODY, "stream": True}, headers=KEY)
        assert streamed.status_code == 200 and "event: message_stop" in streamed.text
        assert _anthropic(streamed)["anthropic-ratelimit-requests-remaining"] == "1"
        assert _openai(streamed) == {}

        counted = await gw.client.post("/v1/messages/count_tokens", json=BODY, headers=KEY)
        assert counted.status_code == 200, counted.text
        assert _anthropic(counted)["anthropic-ratelimit-requests-remaining"] == "0"

        # Refused from the headers alone, before its body is read.
        refused = await gw.client.post("/v1/messages", json=BODY, headers={**KEY, "origin": APP})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert _anthropic(refused)["anthropic-ratelimit-requests-remaining"] == "0"
        assert int(refused.headers["retry-after"]) >= 1 and "retry-after-ms" in refused.headers
        assert _openai(refused) == {}
        exposed = refused.headers["access-control-expose-headers"].split(", ")
        assert {"anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-remaining"} <= set(exposed)

        # The OpenAI routes keep OpenAI's headers, whether the rpm has refilled by now or not.
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        bearer = {"authorization": "Bearer sk-limited"}
        openai = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer)
        assert openai.status_code in (200, 429), openai.text
        assert _openai(openai)["x-ratelimit-limit-requests"] == "3" and _anthropic(openai) == {}


async def test_a_request_larger_than_the_tpm_is_told_in_anthropics_headers(emulator: str) -> None:
    async with gateway_in_process(_config(emulator, tpm=50), RoundRobin(), secret=SECRET) as gw:
        body = {**BODY, "messages": [{"role": "user", "content": "word " * 400}]}
        refused = await gw.client.post("/v1/messages", json=body, headers=KEY)
        assert refused.status_code == 429, refused.text
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
        # No wait lets it pass: no Retry-After, and the bucket is as it was.
        assert refused.headers["x-should-retry"] == "false" and "retry-after" not in refused.headers
        limits = _anthropic(refused)
        assert limits["anthropic-ratelimit-tokens-limit"] == "50"
        assert limits["anthropic-ratelimit-tokens-remaining"] == "50"
        assert "anthropic-ratelimit-requests-limit" not in limits  # the tenant has no rpm
        assert _openai(refused) == {}


async def test_a_workers_absurd_usage_leaves_the_headers_a_date() -> None:
    """A worker reporting 10^19 output tokens drains the tpm bucket for longer than a date can
    say: the answer still comes (its reset a year away at most), and so does the next 429."""

    async def answer(_: web.Request) -> web.Response:
        usage = {"input_tokens": 3, "output_tokens": 10**19}
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "usage": usage}
        return web.json_response(
            message | {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}
        )

    async with contextlib.AsyncExitStack() as stack:
        url = await serve_worker(stack, {"/v1/messages": answer})
        async with gateway_in_process(_config(url, tpm=1000), RoundRobin(), secret=SECRET) as gw:
            first = await gw.client.post("/v1/messages", json=BODY, headers=KEY)
            assert first.status_code == 200, first.text
            second = await gw.client.post("/v1/messages", json=BODY, headers=KEY)
            assert second.status_code == 429, second.text
            reset = _unix(second.headers["anthropic-ratelimit-tokens-reset"])
            assert time.time() < reset <= time.time() + 366 * 86400
