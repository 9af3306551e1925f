"""vLLM 0.33's routes the gateway serves as their kind (`gateway/routes.py`): what reaches the
worker (the path, the tenant's `cache_salt` on the routes that fill the prefix cache and only
there, no client `priority`, no field the worker's model would refuse), what the policy is told
(no keys: load-aware), and the answer passed on. The same routes against the emulator, over real
HTTP: `tests/e2e/test_vllm033_routes.py`."""

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
from gateway.routes import ROUTES
from tests.gateway.routes_rig import Recording
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

SECRET = b"vllm033"
KEY = {"authorization": "Bearer sk-t"}
CHAT = [{"role": "user", "content": "hello"}]
_NO_SCALE_OUT = "This endpoint requires --enable-scale-out"


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


async def _health(_: web.Request) -> web.Response:
    return web.json_response({})


@dataclass
class Worker:
    """Answers every POST with a JSON object carrying usage; remembers what it got."""

    seen: list[Seen] = field(default_factory=list)
    scale_out: bool = True  # False: its render and derender routes answer 403, as vLLM's do then

    async def handle(self, request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append(Seen(request.path, headers, orjson.loads(await request.read())))
        if not self.scale_out and request.path.endswith(("/render", "/derender")):
            error = {"message": _NO_SCALE_OUT, "type": "PermissionDeniedError", "param": None, "code": 403}
            return web.json_response({"error": error}, status=403)
        return web.json_response({"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/{tail:.*}", self.handle)
        return app


@contextlib.asynccontextmanager
async def gateway(
    worker: Worker | None = None, quotas: dict[str, int] | None = None, **pool: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Worker, Recording]]:
    worker = worker or Worker()
    limits = {"quotas": quotas} if quotas else {}
    runner, port = await serve_app(worker.app())
    policy = Recording()
    config = {
        "pools": [{"name": "p", "models": ["m"], "workers": [f"http://127.0.0.1:{port}"], **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")], **limits}],
        "scrape": {"enabled": False},
    }
    try:
        async with gateway_in_process(config, policy, secret=SECRET) as gw:
            yield gw.client, worker, policy
    finally:
        await runner.cleanup()


# path, body, salted (the tenant's cache_salt reaches the worker)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("/v1/chat/completions/batch", {"model": "m", "messages": [CHAT, CHAT], "max_tokens": 2}, True),
    (
        "/generative_scoring",
        {"model": "m", "query": "q", "items": ["a", "b"], "label_token_ids": [1, 2]},
        True,
    ),
    (
        "/v1/systemone",
        {"model": "m", "state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}},
        True,
    ),
    (
        "/v1/decisions",
        {"model": "m", "input": "s", "questions": [{"type": "predicate", "instructions": "?"}]},
        True,
    ),
    ("/v1/messages/render", {"model": "m", "max_tokens": 2, "messages": CHAT}, False),
    ("/v1/responses/render", {"model": "m", "input": "hello"}, False),
    ("/v1/chat/completions/derender", {"model": "m", "generate_response": {"choices": []}}, False),
    ("/v1/completions/derender", {"model": "m", "generate_responses": []}, False),
]


@pytest.mark.parametrize(("path", "body", "salted"), CASES, ids=[c[0] for c in CASES])
async def test_each_route_reaches_the_worker_as_its_kind(
    path: str, body: dict[str, Any], salted: bool
) -> None:
    async with gateway() as (client, worker, policy):
        sent = {**body, "cache_salt": "the-clients-own", "priority": 5}
        answer = await client.post(path, json=sent, headers=KEY)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
        got = worker.seen[-1]
        assert got.path == path
        # A client's salt never reaches a worker; the tenant's does where the route fills the cache.
        assert got.body.get("cache_salt") != "the-clients-own"
        assert ("cache_salt" in got.body) is salted
        # The client's priority orders its own queue only, and this pool's engines use none.
        assert "priority" not in got.body
        assert {k: v for k, v in got.body.items() if k != "cache_salt"} == body
        # Load-aware: the policy saw the request's size, no keys.
        assert policy.requests[-1].block_keys == ()
        assert ROUTES[path].prompt is None


async def test_the_batch_is_not_read_as_a_stream_and_counts_its_whole_body() -> None:
    """vLLM's batch model has no `stream` (an extra field it ignores): the answer is one JSON
    object whatever the client's `stream` says. The batch's prompt tokens are its body's."""
    async with gateway() as (client, worker, policy):
        body = {"model": "m", "messages": [CHAT] * 8, "stream": True}
        answer = await client.post("/v1/chat/completions/batch", json=body, headers=KEY)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
        assert worker.seen[-1].body["stream"] is True
        one = await client.post("/v1/chat/completions/batch", json={**body, "messages": [CHAT]}, headers=KEY)
        assert one.status_code == 200
        assert policy.requests[-2].n_prompt_tokens > policy.requests[-1].n_prompt_tokens


async def test_the_decisions_route_names_its_model() -> None:
    async with gateway() as (client, worker, _):
        body = {"input": "s", "questions": [{"type": "predicate", "instructions": "?"}]}
        answer = await client.post("/v1/decisions", json=body, headers=KEY)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
        assert worker.seen == []


async def test_on_a_pool_scheduling_by_priority_decisions_get_none_and_the_reads_theirs() -> None:
    """vLLM's Decisions model has no `priority` and refuses fields it lacks: the tenant's engine
    priority, which the other salted routes carry, would make every such request a 400."""
    async with gateway(priority_scheduling="lower_first") as (client, worker, _):
        decisions = {"model": "m", "input": "s", "questions": [{"type": "predicate", "instructions": "?"}]}
        answer = await client.post("/v1/decisions", json=decisions, headers=KEY)
        assert answer.status_code == 200, answer.text
        assert "priority" not in worker.seen[-1].body
        scoring = {"model": "m", "query": "q", "items": ["a"], "label_token_ids": [1]}
        assert (await client.post("/generative_scoring", json=scoring, headers=KEY)).status_code == 200
        assert "priority" in worker.seen[-1].body


async def test_a_workers_403_on_a_scale_out_route_is_its_answer_not_a_refused_key() -> None:
    """vLLM 0.33 answers its render and derender routes 403 unless started with
    `--enable-scale-out`: the client gets that answer, as any 4xx, and the worker is not taken
    for one refusing the gateway's credentials (502 `worker_auth_failed`, retried elsewhere)."""
    async with gateway(Worker(scale_out=False)) as (client, worker, _):
        for path in ("/v1/chat/completions/render", "/v1/completions/derender"):
            answer = await client.post(path, json={"model": "m", "messages": CHAT}, headers=KEY)
            assert answer.status_code == 403, answer.text
            assert answer.json()["error"]["message"] == _NO_SCALE_OUT
        chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": CHAT}, headers=KEY)
        assert chat.status_code == 200
        assert len(worker.seen) == 3  # each tried once


async def test_the_responses_render_route_is_served_not_taken_for_a_stored_response() -> None:
    """`POST /v1/responses/render` was answered 405 by `GET /v1/responses/{id}`; a GET there is
    a retrieve of a response named `render`, as on vLLM (404: tests/gateway/
    test_wire_responses_render.py), and a path vLLM does not have is still 404."""
    async with gateway() as (client, worker, _):
        answer = await client.post("/v1/responses/render", json={"model": "m", "input": "x"}, headers=KEY)
        assert answer.status_code == 200 and worker.seen[-1].path == "/v1/responses/render"
        assert (await client.get("/v1/responses/render", headers=KEY)).status_code == 404
        cohere = await client.post("/cohere/v2/chat", json={"model": "m", "messages": CHAT}, headers=KEY)
        assert cohere.status_code == 404


async def test_a_batch_of_chat_completions_counts_its_conversations_as_sequences() -> None:
    """Each conversation of the batch decodes on its own: the conversations count against
    `limits.max_choices` as a completions batch's prompts do. 100,000 conversations with a
    budget of the window each reached the worker."""
    async with gateway() as (client, worker, _):
        for count in (129, 100_000):
            body = {"model": "m", "messages": [CHAT] * count, "max_tokens": 4096}
            answer = await client.post("/v1/chat/completions/batch", json=body, headers=KEY)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["code"], error["param"]) == ("integer_above_max_value", "messages")
            assert f"batch of {count} conversations" in error["message"]
        two = {"model": "m", "messages": [CHAT] * 65, "n": 2}
        assert (await client.post("/v1/chat/completions/batch", json=two, headers=KEY)).status_code == 400
        assert worker.seen == []
        full = {"model": "m", "messages": [CHAT] * 128, "max_tokens": 4}
        assert (await client.post("/v1/chat/completions/batch", json=full, headers=KEY)).status_code == 200
        assert len(worker.seen[-1].body["messages"]) == 128


async def test_a_batch_of_chat_completions_counts_every_conversations_budget() -> None:
    """The budget of a batch is each conversation's: the worker's load counts it once per
    conversation, at most the window each, as a completions batch's is (it counted 0)."""
    async with gateway(max_model_len=4096) as (client, worker, policy):
        body = {"model": "m", "messages": [CHAT] * 100, "max_tokens": 500}
        assert (await client.post("/v1/chat/completions/batch", json=body, headers=KEY)).status_code == 200
        assert policy.requests[-1].max_output_tokens == 100 * 500
        chat_field = {**body, "max_completion_tokens": 7}
        answer = await client.post("/v1/chat/completions/batch", json=chat_field, headers=KEY)
        assert answer.status_code == 200 and policy.requests[-1].max_output_tokens == 100 * 7
        window = {**body, "max_tokens": 4096}
        answer = await client.post("/v1/chat/completions/batch", json=window, headers=KEY)
        assert answer.status_code == 200 and policy.requests[-1].max_output_tokens == 100 * 4095
        past = await client.post("/v1/chat/completions/batch", json={**body, "max_tokens": 4097}, headers=KEY)
        assert past.status_code == 400 and past.json()["error"]["param"] == "max_tokens"
        assert len(worker.seen) == 3


def _reads(shared: str, count: int) -> dict[str, dict[str, Any]]:
    """The three read routes' bodies, each of `count` items or questions sharing `shared`."""
    return {
        "/generative_scoring": {
            "model": "m",
            "query": shared,
            "items": [f"item {i}" for i in range(count)],
            "label_token_ids": [1, 2],
        },
        "/v1/systemone": {
            "model": "m",
            "state": shared,
            "questions": {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(count)},
        },
        "/v1/decisions": {
            "model": "m",
            "input": shared,
            "questions": [{"type": "predicate", "instructions": "?"}] * count,
        },
    }


async def test_a_read_counts_what_its_items_or_questions_share_once_per_read() -> None:
    """vLLM prefills the query (state, input) once per item (question): 300 items of a 3,500
    character query were admitted as the body's 1.8k tokens and prefilled a million."""
    shared = "word " * 800  # 4,000 characters: 1,000 approximate tokens
    async with gateway() as (client, worker, policy):
        for path, body in _reads(shared, 40).items():
            answer = await client.post(path, json=body, headers=KEY)
            assert answer.status_code == 200, answer.text
            assert policy.requests[-1].n_prompt_tokens >= 40 * 1000, path
            one = await client.post(path, json=_reads(shared, 1)[path], headers=KEY)
            assert one.status_code == 200
            assert 1000 <= policy.requests[-1].n_prompt_tokens < 1200, path
        assert len(worker.seen) == 6


async def test_a_read_past_the_tpm_quota_is_refused_before_the_worker() -> None:
    shared = "word " * 800
    async with gateway(quotas={"tpm": 100_000}) as (client, worker, _):
        for path, body in _reads(shared, 120).items():
            answer = await client.post(path, json=body, headers=KEY)
            assert answer.status_code == 429, answer.text
            assert answer.json()["error"]["code"] == "insufficient_quota"
            assert answer.headers["x-ratelimit-remaining-tokens"] == "100000"
        assert worker.seen == []


async def test_a_read_runs_at_most_max_choices_items_or_questions() -> None:
    async with gateway() as (client, worker, _):
        for path, body in _reads("s", 129).items():
            answer = await client.post(path, json=body, headers=KEY)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["code"] == "integer_above_max_value"
            assert error["param"] == ("items" if path == "/generative_scoring" else "questions")
            assert "holds 129" in error["message"] and "at most 128" in error["message"]
        assert worker.seen == []
        for path, body in _reads("s", 128).items():
            assert (await client.post(path, json=body, headers=KEY)).status_code == 200
