"""An empty `tools` list (`"tools": []`, which SDK wrappers and agent frameworks send for "no
tools") is served as the request without the field, on every route whose request has `tools`
(chat, Responses, Messages, their render routes, Messages `count_tokens`), whichever engine the
worker runs. vLLM refuses it on chat with 400 since it followed OpenAI's chat API; the gateway
forwarded it as sent, so the client got the worker's 400 (and a fleet in the middle of an upgrade,
200 or 400 by the worker picked). A `tool_choice` of auto goes with the list; one that asks for a
call with no tool to call is refused by the gateway, in the route's own error shape, before any
worker is asked.

The gateway runs in-process in front of a scripted worker on 127.0.0.1 that validates `tools` and
`tool_choice` as recent vLLM does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.bodies import parse_body
from gateway.errors import ApiError
from gateway.routes import ROUTES
from policies.baselines import RoundRobin
from tests.support.gateway_config import SECRET, tenant
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import serve_worker

OPENAI_KEY = {"authorization": "Bearer sk-a"}
ANTHROPIC_KEY = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "max_output_tokens": 2, "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


OPENAI_CHOICES = ("auto", "none", "required")
ANTHROPIC_CHOICES = ({"type": "auto"}, {"type": "none"}, {"type": "any"})


@dataclass(frozen=True)
class Case:
    """A route, a body of its API without `tools`, the key its clients send, and its API's tool
    choices: auto, none, and one that asks for a call."""

    path: str
    body: dict[str, Any]
    key: dict[str, str]
    auto: Any
    none: Any
    forced: Any


CHAT_CASE = Case("/v1/chat/completions", CHAT, OPENAI_KEY, *OPENAI_CHOICES)
RESPONSES_CASE = Case("/v1/responses", RESPONSES, OPENAI_KEY, *OPENAI_CHOICES)
MESSAGES_CASE = Case("/v1/messages", MESSAGES, ANTHROPIC_KEY, *ANTHROPIC_CHOICES)
CASES = {
    "chat": CHAT_CASE,
    "chat render": Case("/v1/chat/completions/render", CHAT, OPENAI_KEY, *OPENAI_CHOICES),
    "responses": RESPONSES_CASE,
    "responses render": Case("/v1/responses/render", RESPONSES, OPENAI_KEY, *OPENAI_CHOICES),
    "messages": MESSAGES_CASE,
    "messages render": Case("/v1/messages/render", MESSAGES, ANTHROPIC_KEY, *ANTHROPIC_CHOICES),
    "count_tokens": Case("/v1/messages/count_tokens", MESSAGES, ANTHROPIC_KEY, *ANTHROPIC_CHOICES),
}
_CHAT_PATHS = ("/v1/chat/completions", "/v1/chat/completions/render")


def _vllm_refusal(message: str, param: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    return web.json_response(body, status=400)


@dataclass
class VllmLikeWorker:
    """Validates `tools` and `tool_choice` as recent vLLM does: an empty list is refused on chat;
    a `tool_choice` other than none without tools is refused on chat, and an auto one on Messages
    (a worker started without auto tool choice). Answers the rest 200 in the route's shape, and
    remembers every body it got."""

    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def answer(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        path = request.path
        tools, choice = body.get("tools"), body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if path in _CHAT_PATHS and tools == []:
            return _vllm_refusal(
                "`tools` must not be an empty array. Either provide at least one tool or omit the "
                "field entirely. (parameter=tools)",
                "tools",
            )
        if path in _CHAT_PATHS and choice not in (None, "none") and tools is None:
            return _vllm_refusal("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if path.startswith("/v1/messages") and tools is not None and kind in (None, "auto"):
            return _vllm_refusal(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": "ok"}
            choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
            return web.json_response(
                {"id": "c1", "object": "chat.completion", "choices": choices, "usage": USAGE}
            )
        if path == "/v1/responses":
            usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
            rid = body.get("request_id", "resp_1")
            return web.json_response({"id": rid, "object": "response", "status": "completed", "usage": usage})
        if path == "/v1/messages":
            usage = {"input_tokens": 3, "output_tokens": 1}
            return web.json_response({"id": "msg_1", "type": "message", "content": [], "usage": usage})
        return web.json_response({"token_ids": [1, 2, 3], "input_tokens": 3})


@contextlib.asynccontextmanager
async def _gateway(worker: VllmLikeWorker) -> AsyncIterator[InProcessGateway]:
    async with contextlib.AsyncExitStack() as stack:
        url = await serve_worker(stack, {case.path: worker.answer for case in CASES.values()})
        pool = {"name": "p", "models": ["m"], "workers": [url], "retry_attempts": 0}
        config = {"pools": [pool], "tenants": [tenant("a", "sk-a")], "scrape": {"enabled": False}}
        async with gateway_in_process(config, RoundRobin(), secret=SECRET) as gw:
            yield gw


@pytest.fixture
async def rig() -> AsyncIterator[tuple[InProcessGateway, VllmLikeWorker]]:
    worker = VllmLikeWorker()
    async with _gateway(worker) as gw:
        yield gw, worker


@pytest.mark.parametrize("name", CASES)
async def test_an_empty_tools_list_is_served_as_no_tools(
    rig: tuple[InProcessGateway, VllmLikeWorker], name: str
) -> None:
    gw, worker = rig
    case = CASES[name]
    for extra in ({}, {"tool_choice": case.auto}, {"tool_choice": case.none}):
        answer = await gw.client.post(case.path, json={**case.body, "tools": [], **extra}, headers=case.key)
        assert answer.status_code == 200, (extra, answer.text)
        sent = worker.bodies[-1]
        assert "tools" not in sent
        # Auto among no tools calls none, as leaving it out does; "none" is taken without tools.
        assert sent.get("tool_choice") == (case.none if extra.get("tool_choice") == case.none else None)
        assert {k: v for k, v in sent.items() if k in case.body} == case.body  # the rest as sent


@pytest.mark.parametrize("name", CASES)
async def test_a_tool_choice_that_asks_for_a_call_with_no_tools_is_refused_in_the_routes_shape(
    rig: tuple[InProcessGateway, VllmLikeWorker], name: str
) -> None:
    gw, worker = rig
    case = CASES[name]
    anthropic = case.key is ANTHROPIC_KEY
    named = {"type": "tool", "name": "f"} if anthropic else {"type": "function", "function": {"name": "f"}}
    for choice in (case.forced, named):
        body = {**case.body, "tools": [], "tool_choice": choice}
        answer = await gw.client.post(case.path, json=body, headers=case.key)
        assert answer.status_code == 400, answer.text
        if anthropic:
            assert answer.json()["type"] == "error"
            assert answer.json()["error"]["type"] == "invalid_request_error"
            assert "tool_choice" in answer.json()["error"]["message"]
        else:
            error = answer.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "tool_choice")
    assert worker.bodies == []  # no worker was asked


async def test_tools_that_are_not_empty_are_forwarded_as_sent(
    rig: tuple[InProcessGateway, VllmLikeWorker],
) -> None:
    gw, worker = rig
    for case, tools, choice in (
        (CHAT_CASE, [TOOL], "auto"),
        (RESPONSES_CASE, [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "auto"),
        (MESSAGES_CASE, [ANTHROPIC_TOOL], {"type": "any"}),
    ):
        body = {**case.body, "tools": tools, "tool_choice": choice}
        answer = await gw.client.post(case.path, json=body, headers=case.key)
        assert answer.status_code == 200, answer.text
        sent = worker.bodies[-1]
        assert (sent["tools"], sent["tool_choice"]) == (tools, choice)


def _parsed(path: str, body: dict[str, Any]) -> dict[str, Any]:
    return parse_body(orjson.dumps(body), ROUTES[path])


def test_routes_without_tools_forward_an_empty_list_untouched() -> None:
    """Completions and the batch of chat completions have no `tools` (vLLM ignores the extra
    field, and the batch refuses any tool use on its own): the worker's to judge."""
    completions = {"model": "m", "prompt": "hi", "tools": [], "tool_choice": "required"}
    assert _parsed("/v1/completions", completions) == completions
    batch = {"model": "m", "messages": [[{"role": "user", "content": "hi"}]], "tools": []}
    assert _parsed("/v1/chat/completions/batch", batch) == batch


@pytest.mark.parametrize("tools", [None, {}, "", 0])
def test_a_tools_field_that_is_not_a_list_is_the_workers_to_judge(tools: Any) -> None:
    body = {**CHAT, "tools": tools, "tool_choice": "required"}
    assert _parsed("/v1/chat/completions", body) == body


def test_a_choice_without_a_type_is_refused_with_an_empty_list() -> None:
    with pytest.raises(ApiError) as refused:
        _parsed("/v1/messages", {**MESSAGES, "tools": [], "tool_choice": {"name": "f"}})
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
