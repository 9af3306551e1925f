"""A split request's answer in its route's own shape: a streamed Anthropic Messages or OpenAI
Responses decode leg is relayed as such a stream (it ends at its terminal event, not `[DONE]`),
and the prefill worker's cached tokens replace the decode worker's in the usage field the route's
clients read, with the prompt's total kept (Anthropic's `input_tokens` is the uncached rest).

The gateway runs in-process in front of a scripted prefill worker and decode worker: each answers
with the usage of its role (the decode worker counts the KV it received as cached)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.state import GatewayState
from policies.base import WorkerId
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app
from tests.support.metrics import metric_total

SECRET = b"k"
KEY = {"authorization": "Bearer sk-t"}
PROMPT = 100
PREFILL_CACHED = 60  # the prefix-cache hit, what the client is owed
DECODE_CACHED = PROMPT - 1  # what the decode worker counts after the transfer


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **obj}) + b"\n\n"


def _messages_usage(cached: int, vllm_style: bool) -> dict[str, int]:
    """vLLM's Messages route reports the whole prompt as `input_tokens` and no cache fields;
    Anthropic's (and the emulator's) reports the uncached rest and `cache_read_input_tokens`."""
    if vllm_style:
        return {"input_tokens": PROMPT, "output_tokens": 2}
    return {"input_tokens": PROMPT - cached, "output_tokens": 2, "cache_read_input_tokens": cached}


def _responses_usage(cached: int) -> dict[str, Any]:
    return {
        "input_tokens": PROMPT,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": 2,
        "total_tokens": PROMPT + 2,
    }


@dataclass
class Scripted:
    """A worker of one role: a prefill worker answers whole with its hit; a decode worker
    answers (streamed or whole) with the prompt less one token cached."""

    prefill: bool
    vllm_style: bool = False
    url: str = ""
    responses_bodies: list[dict[str, Any]] = field(default_factory=list)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.prefill:
            usage = _messages_usage(PREFILL_CACHED, vllm_style=False)
            return web.json_response({"type": "message", "content": [], "usage": usage})
        usage = _messages_usage(DECODE_CACHED, self.vllm_style)
        if not body.get("stream"):
            return web.json_response({"type": "message", "content": [], "usage": usage})
        start = {"id": "msg_1", "type": "message", "content": [], "usage": {**usage, "output_tokens": 0}}
        events = [
            _event("message_start", {"message": start}),
            _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
            _event("content_block_stop", {"index": 0}),
            _event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": usage}),
            _event("message_stop", {}),
        ]
        return await _stream(request, events)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.responses_bodies.append(body)
        cached = PREFILL_CACHED if self.prefill else DECODE_CACHED
        rid = body["request_id"]  # vLLM and SGLang name the response after it (the gateway sets it)
        done: dict[str, Any] = {"id": rid, "object": "response", "status": "completed", "output": []}
        done["usage"] = _responses_usage(cached)
        if self.prefill or not body.get("stream"):
            return web.json_response(done)
        events = [
            _event("response.created", {"response": {"id": rid, "status": "in_progress"}}),
            _event("response.output_text.delta", {"delta": "hi"}),
            _event("response.completed", {"response": done}),
        ]
        return await _stream(request, events)


async def _stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(event)
    await resp.write_eof()
    return resp


@dataclass
class Rig:
    client: httpx.AsyncClient
    state: GatewayState
    prefill: Scripted
    decode: Scripted

    def metric(self, name: str, **labels: str) -> float:
        return metric_total(self.state, name, **labels)

    def decode_failures(self) -> int:
        return self.state.registry.pools["p"].workers[WorkerId(self.decode.url)].breaker.failures


@contextlib.asynccontextmanager
async def pd_rig(protocol: str, *, vllm_style: bool = False) -> AsyncIterator[Rig]:
    async with contextlib.AsyncExitStack() as stack:
        prefill, decode = Scripted(prefill=True), Scripted(prefill=False, vllm_style=vllm_style)
        for scripted in (prefill, decode):

            async def health(_: web.Request) -> web.Response:
                return web.Response(text="ok")

            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_post("/v1/messages", scripted.messages)
            app.router.add_post("/v1/responses", scripted.responses)
            runner, port = await serve_app(app)
            stack.push_async_callback(runner.cleanup)
            scripted.url = f"http://127.0.0.1:{port}"
        config = {
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "prefill_workers": [prefill.url],
                    "decode_workers": [decode.url],
                    # A pair whenever one is free.
                    "pd": {"protocol": protocol, "conditional": False, "bootstrap_port": 8998},
                    "retry_attempts": 0,
                }
            ],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
        gw = await stack.enter_async_context(gateway_in_process(config, Recording(), secret=SECRET))
        yield Rig(gw.client, gw.state, prefill, decode)


def _data(text: str) -> list[dict[str, Any]]:
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return [orjson.loads(d) for d in data if d != "[DONE]"]


_MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("vllm_style", [True, False])
async def test_a_streamed_messages_split_ends_at_message_stop_with_the_prefill_hit(vllm_style: bool) -> None:
    async with pd_rig("vllm", vllm_style=vllm_style) as rig:
        resp = await rig.client.post("/v1/messages", json={**_MESSAGES, "stream": True}, headers=KEY)
        assert resp.status_code == 200
        events = _data(resp.text)
        assert [e["type"] for e in events][-1] == "message_stop"  # no error event, no [DONE] after it
        assert "[DONE]" not in resp.text and '"error"' not in resp.text
        for usage in (events[0]["message"]["usage"], events[-2]["usage"]):
            assert usage["cache_read_input_tokens"] == PREFILL_CACHED
            assert usage["input_tokens"] == PROMPT - PREFILL_CACHED  # the prompt's total is kept
        assert rig.metric("kvgate_requests_total", endpoint="messages", status="200") == 1
        assert rig.metric("kvgate_prompt_tokens_total") == PROMPT
        assert rig.metric("kvgate_cached_prompt_tokens_total") == PREFILL_CACHED
        assert rig.decode_failures() == 0


@pytest.mark.parametrize("vllm_style", [True, False])
async def test_a_whole_messages_split_reports_the_prefill_hit_within_the_prompt(vllm_style: bool) -> None:
    async with pd_rig("vllm", vllm_style=vllm_style) as rig:
        resp = await rig.client.post("/v1/messages", json=_MESSAGES, headers=KEY)
        assert resp.status_code == 200
        usage = resp.json()["usage"]
        assert usage["cache_read_input_tokens"] == PREFILL_CACHED
        assert usage["input_tokens"] == PROMPT - PREFILL_CACHED
        assert rig.metric("kvgate_prompt_tokens_total") == PROMPT
        assert rig.metric("kvgate_cached_prompt_tokens_total") == PREFILL_CACHED


@pytest.mark.parametrize("stream", [True, False])
async def test_a_responses_split_reports_the_prefill_hit_in_its_own_field(stream: bool) -> None:
    """Responses is split under SGLang (vLLM runs it alone)."""
    async with pd_rig("sglang") as rig:
        body = {"model": "m", "input": "hello", "stream": stream}
        resp = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert resp.status_code == 200
        if stream:
            events = _data(resp.text)
            assert [e["type"] for e in events][-1] == "response.completed"
            assert "[DONE]" not in resp.text and '"error"' not in resp.text
            usage = events[-1]["response"]["usage"]
        else:
            usage = resp.json()["usage"]
        assert usage == _responses_usage(PREFILL_CACHED)  # and no Anthropic field added
        assert rig.metric("kvgate_requests_total", endpoint="responses", status="200") == 1
        assert rig.metric("kvgate_prompt_tokens_total") == PROMPT
        assert rig.metric("kvgate_cached_prompt_tokens_total") == PREFILL_CACHED
        assert rig.decode_failures() == 0


async def test_a_follow_up_of_a_response_an_sglang_decode_server_holds_is_refused() -> None:
    """The decode worker answered (and stored) the response, and an SGLang decode server runs only
    requests prefilled elsewhere, while no prefill server holds the conversation: a follow-up
    naming it gets a 400 saying so, and reaches no worker."""
    async with pd_rig("sglang") as rig:
        first = await rig.client.post(
            "/v1/responses", json={"model": "m", "input": "hello", "stream": True}, headers=KEY
        )
        assert first.status_code == 200
        rid = _data(first.text)[0]["response"]["id"]
        sent = len(rig.decode.responses_bodies)
        body = {"model": "m", "input": "and?", "previous_response_id": rid}
        follow_up = await rig.client.post("/v1/responses", json=body, headers=KEY)
        assert follow_up.status_code == 400, follow_up.text
        error = follow_up.json()["error"]
        assert error["param"] == "previous_response_id" and "input items" in error["message"]
        assert len(rig.decode.responses_bodies) == sent


async def test_a_responses_split_stores_the_answer_on_the_decode_worker_only() -> None:
    """Both SGLang legs carry the request's id; the prefill leg asks its worker not to store a copy
    under it (a follow-up could not continue there), the decode leg keeps what the client asked."""
    async with pd_rig("sglang") as rig:
        resp = await rig.client.post("/v1/responses", json={"model": "m", "input": "hello"}, headers=KEY)
        assert resp.status_code == 200
        (prefill,) = rig.prefill.responses_bodies
        (decode,) = rig.decode.responses_bodies
        assert prefill["request_id"] == decode["request_id"]
        assert prefill["store"] is False and "store" not in decode
