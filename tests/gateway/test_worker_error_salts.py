"""A worker's error never shows the client the salt the gateway sent with its request.

vLLM's 400 for a request a model-level validator refuses quotes the whole request, `cache_salt`
included: its handler lists pydantic's error records, whose `input` is the request (in full), and
a `str()` of the error shows `input_value=` cut to its first 25 and last 24 characters (a part of
the salt). The worker here refuses the same way, with pydantic's own output, and quotes the
request in the error event of a stream; the client gets the worker's error with the salt, or the
part of it quoted, replaced by the placeholder, and otherwise as the worker said it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gateway.errors import SALT_PLACEHOLDER, withhold_salts
from tests.gateway.routes_rig import KEY, SECRET, Recording, config
from tests.support.inprocess import gateway_in_process
from tests.support.loopback import serve_app

PLACEHOLDER = SALT_PLACEHOLDER.decode()
# No client sees this many consecutive characters of a salt the gateway sent.
RUN = 8


class _Request(BaseModel):
    """A request as a vLLM-like worker validates it: a check of the whole body before its fields."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("top_logprobs") and not data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return data


def _listed(exc: ValidationError) -> str:
    """The errors' records one a line, as vLLM's validation handler words its 400."""
    records = exc.errors()
    return f"{len(records)} validation error:\n" + "\n".join(f"  {record}" for record in records)


@dataclass
class QuotingWorker:
    """Refuses an invalid request with a 400 quoting it (`quote`: "records", every record in
    full; "str", pydantic's `str()`, values cut short); streams a valid one, then an error event
    quoting it. Keeps each body it got and each message it said."""

    quote: str = "records"
    # The error event of a stream on a named-event route (Messages, Responses) in the OpenAI
    # shape, `{"error": {...}}` with no event type, instead of the route's own.
    untyped_events: bool = False
    # Answer every request with this status (not 200, not an error) and a body quoting it.
    other_status: int | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", _health)
        for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/generate"):
            app.router.add_post(path, self._answer)
        app.router.add_get("/v1/responses/{response_id}", self._stored)
        return app

    async def _stored(self, request: web.Request) -> web.StreamResponse:
        """A stored response's retrieval fails, quoting the request that made it (the last body);
        as the error event of its stream with `stream=true`, else with status `?status=`."""
        message = f"retrieval failed for {self.bodies[-1]!r}"
        self.said.append(message)
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        if request.query.get("stream") != "true":
            return web.json_response({"error": error}, status=int(request.query["status"]))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        event = {"type": "error", "code": "retrieval_failed", "message": message, "param": None}
        await resp.write(b"event: error\ndata: " + orjson.dumps(event) + b"\n\n")
        await resp.write_eof()
        return resp

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        if self.other_status is not None:
            message = f"see other for {body!r}"
            self.said.append(message)
            return web.json_response({"message": message}, status=self.other_status)
        try:
            _Request.model_validate(body)
        except ValidationError as exc:
            message = _listed(exc) if self.quote == "records" else str(exc)
            self.said.append(message)
            error = {"message": message, "type": "BadRequestError", "param": "top_logprobs", "code": 400}
            return web.json_response({"error": error}, status=400)
        message = f"generation failed for {body!r}"
        self.said.append(message)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if request.path in ("/v1/responses", "/v1/messages") and self.untyped_events:
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            await resp.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
        elif request.path == "/v1/responses":
            created = {"type": "response.created", "response": {"id": body["request_id"]}}
            error = {"type": "error", "code": "generation_failed", "message": message, "param": None}
            await resp.write(b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
            await resp.write(b"event: error\ndata: " + orjson.dumps(error) + b"\n\n")
        else:
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
        await resp.write_eof()
        return resp


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@contextlib.asynccontextmanager
async def _gateway(worker: QuotingWorker) -> AsyncIterator[httpx.AsyncClient]:
    runner, port = await serve_app(worker.app())
    try:
        built = config([f"http://127.0.0.1:{port}"])
        async with gateway_in_process(built, Recording(), secret=SECRET) as gw:
            yield gw.client
    finally:
        await runner.cleanup()


def _salt_runs(text: str, salt: str) -> list[str]:
    """The runs of `RUN` characters of `salt` that `text` contains."""
    windows = (salt[i : i + RUN] for i in range(len(salt) - RUN + 1))
    return [window for window in windows if window in text]


def _assert_withheld(client_message: str, worker_message: str, salt: str) -> None:
    """The client's message is the worker's, with the salt (or the part of it the worker quoted)
    replaced by the placeholder, once; nothing else changed."""
    assert _salt_runs(worker_message, salt), "the worker quoted (part of) the salt"
    before, placeholder, after = client_message.partition(PLACEHOLDER)
    assert placeholder and PLACEHOLDER not in after
    assert worker_message.startswith(before) and worker_message.endswith(after)
    quoted = worker_message[len(before) : len(worker_message) - len(after)]
    assert len(quoted) >= RUN and quoted in salt


# path, body, the field the gateway puts its salt in
HI = [{"role": "user", "content": "hi"}]
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions", {"messages": HI}, "cache_salt"),
    "chat streamed": ("/v1/chat/completions", {"messages": HI, "stream": True}, "cache_salt"),
    "messages": ("/v1/messages", {"max_tokens": 5, "messages": HI}, "cache_salt"),
    "responses": ("/v1/responses", {"input": "hi"}, "cache_salt"),
    "sglang generate": ("/generate", {"text": "hi"}, "extra_key"),
}


@pytest.mark.parametrize("quote", ["records", "str"])
@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_a_refusal_quoting_the_request_reaches_the_client_without_the_salt(
    case: str, quote: str
) -> None:
    path, body, salt_field = REFUSED[case]
    worker = QuotingWorker(quote)
    async with _gateway(worker) as client:
        resp = await client.post(path, json={"model": "m", "top_logprobs": 2, **body}, headers=KEY)
    assert resp.status_code == 400
    (sent,) = worker.bodies
    salt = sent[salt_field]
    assert isinstance(salt, str) and len(salt) >= RUN
    assert _salt_runs(resp.text, salt) == []
    error = resp.json()["error"]
    (said,) = worker.said
    _assert_withheld(error["message"], said, salt)
    if path != "/v1/messages":  # the OpenAI shape keeps the worker's `param`
        assert (error["type"], error["param"]) == ("invalid_request_error", "top_logprobs")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_an_error_event_quoting_the_request_reaches_the_client_without_the_salt(path: str) -> None:
    worker = QuotingWorker()
    prompt: dict[str, Any] = {"input": "hi"} if path == "/v1/responses" else {"messages": HI}
    body = {"model": "m", "stream": True, **prompt}
    async with _gateway(worker) as client:
        resp = await client.post(path, json=body, headers=KEY)
    assert resp.status_code == 200
    (sent,) = worker.bodies
    salt = sent["cache_salt"]
    assert _salt_runs(resp.text, salt) == []
    events = [data_line[6:] for data_line in resp.text.splitlines() if data_line.startswith("data: {")]
    errors = [orjson.loads(event) for event in events if '"message"' in event]
    (error,) = errors
    message = error["error"]["message"] if "error" in error else error["message"]
    (said,) = worker.said
    _assert_withheld(message, said, salt)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_an_openai_style_error_event_on_a_named_event_route_is_rewritten_without_the_salt(
    path: str,
) -> None:
    worker = QuotingWorker(untyped_events=True)
    prompt: dict[str, Any] = {"input": "hi"} if path == "/v1/responses" else {"max_tokens": 5, "messages": HI}
    async with _gateway(worker) as client:
        resp = await client.post(path, json={"model": "m", "stream": True, **prompt}, headers=KEY)
    assert resp.status_code == 200
    (sent,) = worker.bodies
    salt = sent["cache_salt"]
    assert _salt_runs(resp.text, salt) == []
    # One error event, the route's own, carrying the worker's message (the salt withheld).
    events = [orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    (error,) = [event for event in events if event.get("type") == "error"]
    message = error["error"]["message"] if path == "/v1/messages" else error["message"]
    (said,) = worker.said
    _assert_withheld(message, said, salt)


@pytest.mark.parametrize("status", [201, 302])
async def test_an_answer_that_is_neither_a_200_nor_an_error_reaches_the_client_without_the_salt(
    status: int,
) -> None:
    worker = QuotingWorker(other_status=status)
    async with _gateway(worker) as client:
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": HI}, headers=KEY)
    assert resp.status_code == status
    (sent,) = worker.bodies
    salt = sent["cache_salt"]
    assert _salt_runs(resp.text, salt) == []
    (said,) = worker.said
    _assert_withheld(resp.json()["message"], said, salt)


@pytest.mark.parametrize("query", ["status=400", "status=500", "stream=true"])
async def test_a_stored_responses_retrieval_error_reaches_the_client_without_the_salt(query: str) -> None:
    worker = QuotingWorker()
    async with _gateway(worker) as client:
        made = await client.post(
            "/v1/responses", json={"model": "m", "input": "hi", "stream": True}, headers=KEY
        )
        assert made.status_code == 200
        rid = worker.bodies[0]["request_id"]
        resp = await client.get(f"/v1/responses/{rid}?{query}", headers=KEY)
    salt = worker.bodies[0]["cache_salt"]
    assert _salt_runs(resp.text, salt) == []
    said = worker.said[-1]
    if query == "stream=true":
        (error,) = [orjson.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        _assert_withheld(error["message"], said, salt)
    else:
        assert resp.status_code == int(query.split("=")[1])
        _assert_withheld(resp.json()["error"]["message"], said, salt)


async def test_the_salt_is_the_first_field_of_every_body_sent() -> None:
    """So that a quote of the request cut short after some length keeps it whole, and whole it is
    withheld; also when the gateway rewrote the body (a stream asks for usage)."""
    worker = QuotingWorker()
    async with _gateway(worker) as client:
        for stream in (False, True):
            body = {"model": "m", "messages": HI, "stream": stream, "top_logprobs": 2}
            await client.post("/v1/chat/completions", json=body, headers=KEY)
    assert [next(iter(body)) for body in worker.bodies] == ["cache_salt", "cache_salt"]
    assert "stream_options" in worker.bodies[1]


def test_a_salt_is_withheld_whole_or_in_the_part_a_quote_cut_short_keeps() -> None:
    salt, public = "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6"
    salts = (salt, public)
    assert withhold_salts(f"x {salt} y {public}".encode(), salts) == b"x [salt withheld] y [salt withheld]"
    # pydantic's cut `input_value=`: the head of the salt, or its tail.
    head = f"input_value={{'cache_salt': '{salt[:9]}...t': 'hi'}}]}}".encode()
    assert withhold_salts(head, salts) == b"input_value={'cache_salt': '[salt withheld]...t': 'hi'}]}"
    tail = f"input_value={{'model': 'm', 'messa...{salt[-22:]}'}}".encode()
    assert withhold_salts(tail, salts) == b"input_value={'model': 'm', 'messa...[salt withheld]'}"
    # Both, around pydantic's cut of a short value (the cut falls inside the salt).
    both = f"{{'cache_salt': '{salt[:9]}...{salt[-15:]}'}}".encode()
    assert withhold_salts(both, salts) == b"{'cache_salt': '[salt withheld]...[salt withheld]'}"
    # Where the gateway's bound on a message cut the salt short (its message ends there).
    assert (
        withhold_salts(f"'cache_salt': '{public[:20]}".encode(), salts) == b"'cache_salt': '[salt withheld]"
    )
    # Fewer than 8 of its first characters are ordinary text, and so is text with no salt.
    assert withhold_salts(f"max_tokens {salt[:7]}".encode(), salts) == f"max_tokens {salt[:7]}".encode()
    plain = b"max_tokens is too large"
    assert withhold_salts(plain, salts) is plain
