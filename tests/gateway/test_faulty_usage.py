"""A faulty worker's usage: a count below zero is no count, as one that is not an integer is.

Before, a worker that answered `"prompt_tokens": -5` took `kvgate_prompt_tokens_total` (a counter)
down, and `TenantLimiter.reconcile` gave the tenant back its whole prompt estimate and five tokens
more. Here the real app relays answers from a scripted worker whose usage holds one faulty value
in every count, on each route that reads usage, streamed and not: what it charges and counts is
what it charges and counts for an answer without usage."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.answer_usage import Usage, usage_of
from gateway.auth import hash_api_key
from gateway.config import QuotaConfig
from gateway.metrics import GatewayMetrics
from gateway.quotas import TenantLimiter
from policies import make_policy
from tests.gateway.access_lines import AccessLines, capture_access
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_app
from tests.support.metrics import metric_total, text_total

SECRET = b"faulty-usage"
HEADERS = {"authorization": "Bearer sk-t", "x-api-key": "sk-t"}
ABSENT = object()  # the worker's answer has no usage at all
FAULTY = [-5, "5"]  # "5" is the reference: a count that is not an integer was never one
COUNTERS = (
    "kvgate_prompt_tokens_total",
    "kvgate_cached_prompt_tokens_total",
    "kvgate_completion_tokens_total",
)


def _usage(path: str, count: Any) -> dict[str, Any]:
    """Usage in the shape of `path`'s API, every count `count`."""
    if path == "/v1/responses":
        return {"input_tokens": count, "output_tokens": count, "total_tokens": count,
                "input_tokens_details": {"cached_tokens": count}}  # fmt: skip
    if path == "/v1/messages":
        return {"input_tokens": count, "output_tokens": count, "cache_read_input_tokens": count,
                "cache_creation_input_tokens": count}  # fmt: skip
    return {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
            "prompt_tokens_details": {"cached_tokens": count}}  # fmt: skip


def _with_usage(obj: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    return obj if usage is None else {**obj, "usage": usage}


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _named(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _answer(path: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    if path == "/v1/responses":
        output = [{"type": "message", "id": "m1", "content": [{"type": "output_text", "text": "ok"}]}]
        return _with_usage(
            {"id": "resp_1", "object": "response", "status": "completed", "output": output}, usage
        )
    if path == "/v1/messages":
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}  # fmt: skip
        return _with_usage(message, usage)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    choice.update(
        {"text": "ok"} if path == "/v1/completions" else {"message": {"role": "assistant", "content": "ok"}}
    )
    return _with_usage({"id": "c1", "choices": [choice]}, usage)


def _stream(path: str, usage: dict[str, Any] | None) -> bytes:
    if path == "/v1/responses":
        start = {"id": "resp_1", "status": "in_progress", "output": [], "usage": None}
        return b"".join((
            _named("response.created", {"response": start}),
            _named("response.output_text.delta", {"delta": "ok", "item_id": "m1"}),
            _named("response.completed", {"response": _answer(path, usage)}),
        ))  # fmt: skip
    if path == "/v1/messages":
        message = {**_answer(path, usage), "content": [], "stop_reason": None}
        delta = {"delta": {"stop_reason": "end_turn"}}
        return b"".join((
            _named("message_start", {"message": message}),
            _named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            _named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
            _named("content_block_stop", {"index": 0}),
            _named("message_delta", _with_usage(delta, usage)),
            _named("message_stop", {}),
        ))  # fmt: skip
    delta = {"text": "ok"} if path == "/v1/completions" else {"delta": {"content": "ok"}}
    tail = [] if usage is None else [_data({"id": "c1", "choices": [], "usage": usage})]
    return b"".join((_data({"id": "c1", "choices": [{"index": 0, **delta}]}), *tail, b"data: [DONE]\n\n"))


@dataclass
class UsageWorker:
    """Answers every route in its API's shape, with `count` in every count of its usage (none at
    all when `ABSENT`)."""

    count: Any = ABSENT

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
            app.router.add_post(path, self._answer)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = None if self.count is ABSENT else _usage(request.path, self.count)
        if not body.get("stream"):
            return web.json_response(_answer(request.path, usage))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_stream(request.path, usage))
        await resp.write_eof()
        return resp


@dataclass
class Rig:
    gw: InProcessGateway
    lines: AccessLines
    worker: UsageWorker
    limiter: TenantLimiter


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    worker = UsageWorker()
    runner, port = await serve_app(worker.app())
    config = {
        "pools": [
            {"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"], "retry_attempts": 0}
        ],
        "tenants": [
            {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")], "quotas": {"tpm": 100_000}},
        ],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(config, make_policy("round_robin"), secret=SECRET) as gw:
            limiter = gw.state.gate.limiters["t"]
            limiter.told_gap_s = math.inf  # what it charged stays to be read, however slow the test
            yield Rig(gw, capture_access(gw.state), worker, limiter)
    finally:
        await runner.cleanup()


def _body(path: str, stream: bool) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": stream}
    if path == "/v1/responses":
        return {"model": "m", "input": "hello there", "stream": stream}
    return {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
    }


@dataclass(frozen=True)
class Charged:
    """What one request was charged and counted: its access line's counts, the tokens its
    tenant's tpm was charged, and how much each token counter rose."""

    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    tpm_tokens: int
    counters: tuple[float, ...]


async def _charged(rig: Rig, path: str, stream: bool, count: Any, request_id: str) -> Charged:
    rig.worker.count = count
    rig.limiter.unshared(False, time.monotonic())  # forget what earlier requests charged
    before = [metric_total(rig.gw.state, name, tenant="t") for name in COUNTERS]
    resp = await rig.gw.client.post(
        path, json=_body(path, stream), headers={**HEADERS, "x-request-id": request_id}
    )
    assert resp.status_code == 200, resp.text
    told = rig.limiter.unshared(False, time.monotonic())
    after = [metric_total(rig.gw.state, name, tenant="t") for name in COUNTERS]
    line = rig.lines.of(request_id)
    return Charged(
        line["prompt_tokens"],
        line["cached_tokens"],
        line["completion_tokens"],
        told.tokens if told is not None else 0,
        tuple(a - b for a, b in zip(after, before, strict=True)),
    )


ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ROUTES, ids=["chat", "completions", "responses", "messages"])
async def test_a_faulty_count_is_charged_and_counted_as_no_count(rig: Rig, path: str, stream: bool) -> None:
    absent = await _charged(rig, path, stream, ABSENT, "absent")
    assert absent.prompt_tokens is None and absent.tpm_tokens > 0  # the prompt estimate stands
    for n, count in enumerate(FAULTY):
        faulty = await _charged(rig, path, stream, count, f"faulty-{n}")
        assert faulty == absent, count
        assert min(faulty.counters) >= 0  # counters never go down


def test_usage_reads_a_count_below_zero_as_none_in_every_shape() -> None:
    for path in ROUTES:
        assert usage_of(_usage(path, -5)) == usage_of(_usage(path, "5")) == usage_of(None), path
    # One faulty count leaves the others: Anthropic's prompt is its uncached rest plus its cache reads.
    anthropic = {"input_tokens": 4, "cache_read_input_tokens": -32, "output_tokens": 2}
    assert usage_of(anthropic) == Usage(4, 2, None)
    openai = {"prompt_tokens": 9, "completion_tokens": -1, "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage_of(openai) == Usage(9, None, 0)


def test_token_counters_never_go_down() -> None:
    metrics = GatewayMetrics()
    for count in (7, -5):
        metrics.observe(model="m", tenant="t", endpoint="chat", status=200, duration_s=0.1, ttft_s=None,
                        prompt_tokens=count, cached_tokens=count, completion_tokens=count)  # fmt: skip
    page = metrics.render().decode()
    assert [text_total(page, name) for name in COUNTERS] == [7.0, 7.0, 7.0]


def test_reconcile_keeps_the_estimate_for_a_count_below_zero() -> None:
    lim = TenantLimiter(QuotaConfig(tpm=100), now_s=0.0)
    assert lim.enter(0.0) is None and lim.admit(80, 0.0) is None
    lim.reconcile(80, -5, 0.0)  # nothing given back: the 80 stay charged
    assert lim.remaining(0.0)["tokens"] == 20
