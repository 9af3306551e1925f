"""A worker that frames its stream with CRLF or bare CR line ends (SSE allows them, and a worker
behind a proxy, or another OpenAI-compatible server, sends them) is served like one that sends LF:
the client gets the whole stream in the gateway's own LF framing, and its usage is counted. Before,
the gateway found no event in such a stream and answered 502.

The gateway runs in-process in front of scripted workers that stream each event in two writes cut
before its last byte (between the CR and the LF of a CRLF), on every route that relays a worker's
stream: chat (both upstream transports), Responses, Anthropic Messages, a stored response's
retrieve, and the decode leg of a split request."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from policies import make_policy
from tests.gateway.answer_rig import gateway
from tests.gateway.routes_rig import KEY, SECRET
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_in
from tests.support.metrics import metric_total
from tests.support.transports import TRANSPORTS

TOKENS = 5
PROMPT = 9
CACHED = 4  # the worker's own hit (a decode worker's: the KV it received)
PREFILL_CACHED = 6  # a prefill worker's hit, what the client of a split request is owed
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "stream": True}

FRAMINGS: dict[str, Callable[[], Iterator[bytes]]] = {
    "crlf": lambda: itertools.repeat(b"\r\n"),
    "cr": lambda: itertools.repeat(b"\r"),
    # Never a CR line end before an LF one: that pair is one CRLF line end.
    "mixed": lambda: itertools.cycle((b"\r\n", b"\n", b"\r")),
}


def _data(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _named(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\n" + _data({"type": kind, **obj})


def _chat_events(cached: int) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _data({"id": "c1", "object": "chat.completion.chunk", "model": "m",
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})  # fmt: skip

    usage = {"prompt_tokens": PROMPT, "completion_tokens": TOKENS, "total_tokens": PROMPT + TOKENS,
             "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    return [
        chunk({"role": "assistant", "content": ""}),
        *(chunk({"content": f"t{i}"}) for i in range(TOKENS)),
        chunk({}, "stop"),
        _data({"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}),
        b"data: [DONE]\n\n",
    ]


def _responses_usage(cached: int) -> dict[str, Any]:
    return {"input_tokens": PROMPT, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": TOKENS, "total_tokens": PROMPT + TOKENS}  # fmt: skip


def _responses_events(rid: str, cached: int) -> list[bytes]:
    done = {"id": rid, "object": "response", "status": "completed", "usage": _responses_usage(cached)}
    return [
        _named("response.created", {"response": {"id": rid, "status": "in_progress"}, "sequence_number": 0}),
        *(
            _named(
                "response.output_text.delta", {"delta": f"t{i}", "item_id": "m1", "sequence_number": i + 1}
            )
            for i in range(TOKENS)
        ),
        _named("response.completed", {"response": done, "sequence_number": TOKENS + 1}),
    ]


def _messages_events() -> list[bytes]:
    usage = {"input_tokens": PROMPT - CACHED, "output_tokens": 0, "cache_read_input_tokens": CACHED}
    return [
        _named(
            "message_start", {"message": {"id": "msg_1", "type": "message", "content": [], "usage": usage}}
        ),
        _named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        *(
            _named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": f"t{i}"}})
            for i in range(TOKENS)
        ),
        _named("content_block_stop", {"index": 0}),
        _named("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": TOKENS}}),
        _named("message_stop", {}),
    ]


@dataclass
class FramingWorker:
    """Streams its events with the line ends `framing` names. As a prefill worker (`prefill`) it
    answers whole, with its own hit; otherwise its usage reports `cached` (a decode worker's)."""

    framing: str
    prefill: bool = False
    cached: int = CACHED

    async def _stream(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        ends = FRAMINGS[self.framing]()
        for event in events:
            lines = event.split(b"\n")
            framed = b"".join(line + next(ends) for line in lines[:-1])
            await resp.write(framed[:-1])  # a CRLF cut between its CR and its LF
            await resp.write(framed[-1:])
        await resp.write_eof()
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.prefill:
            usage = {"prompt_tokens": PROMPT, "completion_tokens": 1,
                     "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED}}  # fmt: skip
            return web.json_response({"choices": [], "usage": usage, "kv_transfer_params": {"k": 1}})
        assert body["stream"] is True
        return await self._stream(request, _chat_events(self.cached))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = body.get("request_id", "resp_1")
        if self.prefill or not body.get("stream"):
            status = "completed" if self.prefill else "in_progress"  # a background response
            usage = _responses_usage(PREFILL_CACHED)
            return web.json_response({"id": rid, "object": "response", "status": status, "usage": usage})
        return await self._stream(request, _responses_events(rid, self.cached))

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        assert request.query["stream"] == "true"
        return await self._stream(request, _responses_events(request.match_info["rid"], self.cached))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        return await self._stream(request, _messages_events())

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{rid}", self.retrieve)
        app.router.add_post("/v1/messages", self.messages)
        return app


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def _events(resp: httpx.Response) -> list[bytes]:
    """The data of each event the client got, checked to be LF-framed (the gateway's own)."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert b"\r" not in resp.content and resp.content.endswith(b"\n\n")
    events = [e for e in resp.content.split(b"\n\n") if e]
    data = [line[6:] for e in events for line in e.split(b"\n") if line.startswith(b"data: ")]
    assert len(data) == len(events)  # one data line each
    return data


async def _posted(gw: InProcessGateway, path: str, body: dict[str, Any]) -> list[Any]:
    """The events of a stream of named events the client got, parsed."""
    return [orjson.loads(d) for d in _events(await gw.client.post(path, json=body, headers=KEY))]


def _metric(gw: InProcessGateway, name: str, **labels: str) -> float:
    return metric_total(gw.state, name, **labels)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("framing", FRAMINGS)
async def test_a_chat_stream_reaches_the_client_whole_and_its_usage_is_counted(
    framing: str, transport: str
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, FramingWorker(framing).app())
        gw, policy = await stack.enter_async_context(gateway(url, transport))
        body = {**CHAT, "stream_options": {"include_usage": True}}
        data = _events(await gw.client.post("/v1/chat/completions", json=body, headers=KEY))
        assert data[-1] == b"[DONE]"
        chunks = [orjson.loads(d) for d in data[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "".join(f"t{i}" for i in range(TOKENS))
        assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
        (obs,) = policy.observations
        assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (PROMPT, CACHED, TOKENS)
        assert _metric(gw, "kvgate_requests_total", status="200") == 1
        assert _metric(gw, "kvgate_completion_tokens_total") == TOKENS


async def test_a_chat_stream_the_client_asked_no_usage_of_is_counted_and_stripped() -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, FramingWorker("crlf").app())
        gw, policy = await stack.enter_async_context(gateway(url, "lean"))
        data = _events(await gw.client.post("/v1/chat/completions", json=CHAT, headers=KEY))
        assert data[-1] == b"[DONE]" and len(data) == TOKENS + 3  # role, tokens, finish, [DONE]
        assert all(b'"usage"' not in d for d in data)
        (obs,) = policy.observations
        assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (PROMPT, CACHED, TOKENS)


async def test_a_responses_stream_reaches_the_client_whole_and_its_usage_is_counted() -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, FramingWorker("crlf").app())
        gw, policy = await stack.enter_async_context(gateway(url, "lean"))
        body = {"model": "m", "input": "hi", "stream": True}
        events = await _posted(gw, "/v1/responses", body)
        assert [e["type"] for e in events] == [
            "response.created",
            *["response.output_text.delta"] * TOKENS,
            "response.completed",
        ]
        (obs,) = policy.observations
        assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (PROMPT, CACHED, TOKENS)
        assert _metric(gw, "kvgate_requests_total", endpoint="responses", status="200") == 1


async def test_a_messages_stream_reaches_the_client_whole_and_its_usage_is_counted() -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, FramingWorker("crlf").app())
        gw, policy = await stack.enter_async_context(gateway(url, "lean"))
        events = await _posted(gw, "/v1/messages", CHAT)  # an Anthropic body too
        assert events[-1]["type"] == "message_stop"
        assert sum(e["type"] == "content_block_delta" for e in events) == TOKENS
        (obs,) = policy.observations
        assert (obs.prompt_tokens, obs.cached_tokens, obs.completion_tokens) == (PROMPT, CACHED, TOKENS)
        assert _metric(gw, "kvgate_requests_total", endpoint="messages", status="200") == 1


async def test_a_stored_response_s_stream_reaches_the_client_whole() -> None:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_in(stack, FramingWorker("crlf").app())
        gw, _ = await stack.enter_async_context(gateway(url, "lean"))
        body = {"model": "m", "input": "hi", "background": True}
        created = await gw.client.post("/v1/responses", json=body, headers=KEY)
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        resp = await gw.client.get(f"/v1/responses/{rid}", params={"stream": "true"}, headers=KEY)
        events = [orjson.loads(d) for d in _events(resp)]
        assert [e["sequence_number"] for e in events] == list(range(TOKENS + 2))
        assert events[-1]["type"] == "response.completed"


@contextlib.asynccontextmanager
async def _split(protocol: str) -> AsyncIterator[InProcessGateway]:
    """A gateway in front of a prefill worker and a decode worker that streams CRLF."""
    async with contextlib.AsyncExitStack() as stack:
        prefill = await serve_in(stack, FramingWorker("crlf", prefill=True).app())
        decode = await serve_in(stack, FramingWorker("crlf", cached=PROMPT - 1).app())
        pool = {
            "name": "p",
            "models": ["m"],
            "prefill_workers": [prefill],
            "decode_workers": [decode],
            "pd": {"protocol": protocol, "conditional": False, "bootstrap_port": 8998},
            "retry_attempts": 0,
        }
        config = {
            "pools": [pool],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
        yield await stack.enter_async_context(
            gateway_in_process(config, make_policy("round_robin"), secret=SECRET)
        )


async def test_a_split_chat_s_decode_stream_reaches_the_client_with_the_prefill_hit() -> None:
    async with _split("vllm") as gw:
        body = {**CHAT, "stream_options": {"include_usage": True}}
        data = _events(await gw.client.post("/v1/chat/completions", json=body, headers=KEY))
        assert data[-1] == b"[DONE]"
        usage = orjson.loads(data[-2])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED
        assert _metric(gw, "kvgate_cached_prompt_tokens_total") == PREFILL_CACHED
        assert _metric(gw, "kvgate_completion_tokens_total") == TOKENS


async def test_a_split_responses_decode_stream_reaches_the_client_with_the_prefill_hit() -> None:
    async with _split("sglang") as gw:
        body = {"model": "m", "input": "hi", "stream": True}
        events = await _posted(gw, "/v1/responses", body)
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["usage"] == _responses_usage(PREFILL_CACHED)
        assert _metric(gw, "kvgate_cached_prompt_tokens_total") == PREFILL_CACHED
        assert _metric(gw, "kvgate_completion_tokens_total") == TOKENS
