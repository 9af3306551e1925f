"""A stream that ends before the worker's usage is charged the content events it relayed.

Before, a client that read every token of a stream but the last and then left (the worker's
usage comes at the very end) was charged its prompt alone: a tenant at `tpm` could stream many
times its quota. Here the real app relays from a worker that streams its tokens and then holds
its usage back until the connection closes; the client leaves once it has every token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.sse import SseRelay
from gateway.sse_named import MessagesRelay, ResponsesRelay
from policies import make_policy
from tests.gateway.access_lines import AccessLines, capture_access
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.leaving_client import leaving_request
from tests.support.loopback import serve_app
from tests.support.metrics import metric_total
from tests.support.wait import wait_until

SECRET = b"cut"
TOKENS = 30  # content events the worker streams before it holds back its usage


def _chat_events(n: int) -> list[bytes]:
    head = b'{"id":"c1","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":'
    role = b"data: " + head + b'{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    tokens = [b"data: " + head + b'{"content":"t%d"},"finish_reason":null}]}\n\n' % i for i in range(n)]
    return [role, *tokens]


def _chat_tail(n: int) -> list[bytes]:
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
    chunk = orjson.dumps({"id": "c1", "choices": [], "usage": usage})
    return [b"data: " + chunk + b"\n\n", b"data: [DONE]\n\n"]


def _named(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _responses_events(n: int) -> list[bytes]:
    start: dict[str, Any] = {"id": "resp_1", "status": "in_progress", "output": [], "usage": None}
    out = [_named(kind, {"response": start}) for kind in ("response.created", "response.in_progress")]
    out.append(_named("response.output_item.added", {"item": {"type": "message", "id": "m1"}}))
    out += [_named("response.output_text.delta", {"delta": f"t{i}", "item_id": "m1"}) for i in range(n)]
    return out


def _messages_events(n: int) -> list[bytes]:
    usage = {"input_tokens": 3, "output_tokens": 0}
    out = [_named("message_start", {"message": {"id": "msg_1", "content": [], "usage": usage}})]
    out.append(_named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
    out += [
        _named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": f"t{i}"}})
        for i in range(n)
    ]
    return out


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@dataclass
class HoldingWorker:
    """Streams `TOKENS` content events in the route's shape, then waits for `release` before its
    usage and end (the client leaves meanwhile). With `finish` it ends at once."""

    finish: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/v1/chat/completions", self._stream(_chat_events, _chat_tail))
        app.router.add_post("/v1/responses", self._stream(_responses_events, lambda _: []))
        app.router.add_post("/v1/messages", self._stream(_messages_events, lambda _: []))
        return app

    def _stream(
        self, events: Callable[[int], list[bytes]], tail: Callable[[int], list[bytes]]
    ) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for event in events(TOKENS):
                await resp.write(event)
            if not self.finish:
                await self.release.wait()  # cancelled when the gateway closes the connection
            for event in tail(TOKENS):
                await resp.write(event)
            await resp.write_eof()
            return resp

        return handle


@dataclass
class Rig:
    gw: InProcessGateway
    lines: AccessLines
    worker: HoldingWorker


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    worker = HoldingWorker()
    runner, port = await serve_app(worker.app(), handler_cancellation=True)
    worker.url = f"http://127.0.0.1:{port}"
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [worker.url], "retry_attempts": 0}],
        "tenants": [
            {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")], "quotas": {"tpm": 100}},
        ],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            yield Rig(gw, capture_access(gw.state), worker)
    finally:
        worker.release.set()
        await runner.cleanup()


def _body(path: str) -> dict[str, Any]:
    if path == "/v1/responses":
        return {"model": "m", "input": "hi", "stream": True}
    return {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def _cut_stream(rig: Rig, path: str, request_id: str, content: bytes) -> list[bytes]:
    """Send a streamed request straight to the app, as a server would, and leave (a disconnect on
    `receive`) once `content` has arrived `TOKENS` times; the bytes the client got."""
    sent: list[MutableMapping[str, Any]] = []
    headers = [
        (b"host", b"gw"),
        (b"authorization", b"Bearer sk-t"),
        (b"x-api-key", b"sk-t"),
        (b"content-type", b"application/json"),
        (b"x-request-id", request_id.encode()),
    ]
    task, leave = leaving_request(rig.gw.app, "POST", path, headers, orjson.dumps(_body(path)), sent)

    def got() -> list[bytes]:
        return [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]

    # A refused request (429) ends before any token: the client has nothing to leave.
    await wait_until(lambda: task.done() or b"".join(got()).count(content) >= TOKENS, what="every token")
    leave.set()
    await asyncio.wait_for(task, 10)
    return got()


CASES = [
    ("/v1/chat/completions", b'"content":"t'),
    ("/v1/responses", b'"response.output_text.delta"'),
    ("/v1/messages", b'"content_block_delta"'),
]


@pytest.mark.parametrize(("path", "content"), CASES, ids=["chat", "responses", "messages"])
async def test_a_stream_cut_before_its_usage_is_charged_the_tokens_it_relayed(
    rig: Rig, path: str, content: bytes
) -> None:
    got = await _cut_stream(rig, path, "cut-1", content)
    assert b"".join(got).count(content) == TOKENS  # the client had every token it was sent
    line = rig.lines.of("cut-1")
    assert (line["status"], line["error"]) == (499, "client_disconnected")
    # The content events relayed, no more (the chat role chunk carries no token).
    assert line["completion_tokens"] == TOKENS
    assert metric_total(rig.gw.state, "kvgate_completion_tokens_total", tenant="t") == TOKENS


async def test_cut_streams_spend_the_tenants_tpm(rig: Rig) -> None:
    # tpm 100: the first cut stream spends its prompt and 30 tokens, so by the fourth the
    # bucket is spent. Charged their prompts alone, as before, the tenant streamed on.
    statuses = []
    for n in range(4):
        await _cut_stream(rig, "/v1/chat/completions", f"cut-{n}", b'"content":"t')
        statuses.append(rig.lines.of(f"cut-{n}")["status"])
    assert statuses[:3] == [499, 499, 499]
    assert statuses[3] == 429
    charged = sum(rig.lines.of(f"cut-{n}")["completion_tokens"] for n in range(3))
    assert charged == 3 * TOKENS


async def test_a_stream_read_to_its_end_is_charged_the_workers_count(rig: Rig) -> None:
    rig.worker.finish = True
    resp = await rig.gw.client.post(
        "/v1/chat/completions",
        json=_body("/v1/chat/completions"),
        headers={"authorization": "Bearer sk-t", "x-request-id": "whole"},
    )
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    line = rig.lines.of("whole")
    assert (line["status"], line["completion_tokens"], line["prompt_tokens"]) == (200, TOKENS, 3)


def _feed_all(relay: SseRelay | ResponsesRelay | MessagesRelay, events: list[bytes], split: int) -> bytes:
    stream = b"".join(events)
    return b"".join(relay.feed(stream[i : i + split]) for i in range(0, len(stream), split))


@pytest.mark.parametrize("split", [1, 7, 64, 100_000])
def test_relays_count_their_content_events_however_the_bytes_are_split(split: int) -> None:
    chat = SseRelay(strip_usage=True)
    out = _feed_all(chat, _chat_events(5) + _chat_tail(5), split)
    assert chat.content_events == 5 and chat.done and b'"usage"' not in out
    responses = ResponsesRelay()
    _feed_all(responses, _responses_events(4), split)
    assert responses.content_events == 4
    messages = MessagesRelay()
    _feed_all(messages, _messages_events(3), split)
    assert messages.content_events == 3


def test_a_chat_relay_counts_nothing_after_a_workers_error() -> None:
    relay = SseRelay(strip_usage=False)
    error = b'data: {"error":{"message":"boom","code":500}}\n\n'
    relay.feed(b"".join(_chat_events(2)) + error + b"".join(_chat_events(3)[1:]))
    assert relay.error is not None and relay.content_events == 2
