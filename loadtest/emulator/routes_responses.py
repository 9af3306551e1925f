"""`POST /v1/responses` (plain and streamed), `GET /v1/responses/{id}`, `POST .../{id}/cancel`.

Streamed responses send vLLM's event sequence: `response.created` and `response.in_progress` at
once; with the first token `response.output_item.added` and `response.content_part.added`; one
`response.output_text.delta` per token; then `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` and `response.completed` (tool calls:
`response.function_call_arguments.delta` / `.done` instead of the text and part events).

A `background` request (`background.py`) is stored `queued` and answered at once, plainly with
that object or streamed by replaying its recorded events; it runs on without its client, and its
finished object replaces the queued one (if `store`, and unless it was cancelled meanwhile). As
in vLLM, the stored object says `queued` until the run ends, and only a background response that
has not ended can be cancelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from loadtest.emulator.background import BackgroundResponses
from loadtest.emulator.errors import ApiError, RequestValidationError
from loadtest.emulator.live import LiveGroup
from loadtest.emulator.logprobs import responses_delta_logprobs
from loadtest.emulator.responses_api import (
    EventWriter,
    ResponsesCall,
    ResponseStore,
    StoredResponse,
    finished_history,
    item_id,
    not_found,
    output_item,
    parse_responses,
    response_object,
)
from loadtest.emulator.web import answer_steps, json_response, read_json, wait_finished, worker_of
from loadtest.emulator.worker import EmulatedWorker
from prompt_normalizer.lax import lax_bool, lax_int

router = APIRouter()
T = TypeVar("T")


def store_of(request: Request) -> ResponseStore:
    """The app's response store (set by the lifespan)."""
    store: ResponseStore = request.app.state.response_store
    return store


def background_of(request: Request) -> BackgroundResponses:
    """The app's background responses (set by the lifespan)."""
    background: BackgroundResponses = request.app.state.background_responses
    return background


# What vLLM can still cancel; any other stored status is "a synchronous response" to it.
_RUNNING = ("queued", "in_progress")


def _keep(store: ResponseStore, call: ResponsesCall, group: LiveGroup) -> dict[str, object]:
    """The finished object, stored if asked, unless a cancel got there first (as vLLM)."""
    body = response_object(call, group, done=True)
    stored = store.get(call.response_id)
    if call.store and (stored is None or stored.body["status"] != "cancelled"):
        store.put(call.response_id, StoredResponse(body, finished_history(call, group)))
    return body


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    body = await read_json(request)
    w = worker_of(request)
    store = store_of(request)
    call = parse_responses(body, w.cfg, w.tokenizer, store)
    group = w.submit(call.gen, call.response_id)
    if call.background:
        return _start_in_background(background_of(request), w, store, call, group)
    if call.gen.stream:
        return StreamingResponse(_stream(w, store, call, group), media_type="text/event-stream")
    gone = await wait_finished(request, w, group)
    return gone if gone is not None else json_response(_keep(store, call, group))


def _start_in_background(
    background: BackgroundResponses,
    w: EmulatedWorker,
    store: ResponseStore,
    call: ResponsesCall,
    group: LiveGroup,
) -> Response:
    """Store the response `queued` (whether or not `store` was asked: vLLM's background store does
    not look) and let it run on; answer the queued object, or replay the recorded stream."""
    queued = response_object(call, group, done=False, status="queued")
    store.put(call.response_id, StoredResponse(queued, call.history if call.store else ()))
    if call.gen.stream:
        events = background.run_stream(call.response_id, _stream(w, store, call, group))
        return StreamingResponse(events.replay(0), media_type="text/event-stream")
    background.run(call.response_id, _run_in_background(w, store, call, group))
    return json_response(queued)


async def _run_in_background(
    w: EmulatedWorker, store: ResponseStore, call: ResponsesCall, group: LiveGroup
) -> None:
    try:
        while not group.finished:
            await group.wait()
    finally:
        w.abort(group)  # no-op once finished; a cancel frees what is still running
    if not group.failed:
        _keep(store, call, group)
        return
    stored = store.get(call.response_id)
    if stored is not None and stored.body["status"] not in ("completed", "cancelled"):
        stored.body["status"] = "failed"


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    """The stored response; with `stream=true`, a replay of a background stream's events after
    `starting_after`. vLLM keeps events only of background streams: for any other response its
    replay generator raises once the 200 has gone out, so the client gets the event-stream
    headers and then a cut connection, no event."""
    stream = _query(request, "stream", lax_bool, "bool_parsing", "a valid boolean, unable to interpret input")
    after = _query(
        request,
        "starting_after",
        lax_int,
        "int_parsing",
        "a valid integer, unable to parse string as an integer",
    )
    stored = store_of(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    if stream:
        events = background_of(request).events(response_id)
        replay = (
            _no_stored_events(response_id)
            if events is None
            else events.replay(0 if after is None else after + 1)
        )
        return StreamingResponse(replay, media_type="text/event-stream")
    return json_response(stored.body)


def _query(request: Request, name: str, read: Callable[[object], T | None], kind: str, what: str) -> T | None:
    """An optional query parameter as FastAPI reads it for vLLM's handler (a typed argument),
    refused with vLLM's validation 400."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    value = read(raw)
    if value is None:
        raise RequestValidationError(
            {"type": kind, "loc": ("query", name), "msg": f"Input should be {what}", "input": raw}
        )
    return value


async def _no_stored_events(response_id: str) -> AsyncIterator[bytes]:
    raise ValueError(f"Unknown response_id: {response_id}")
    yield b""  # pragma: no cover - never reached; makes this an async generator


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    """A background response that has not ended becomes `cancelled` and its run stops; the
    stored object (still without output) is the answer. Anything else is vLLM's 400."""
    stored = store_of(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    if stored.body["status"] not in _RUNNING:
        raise ApiError(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
    stored.body["status"] = "cancelled"
    await background_of(request).cancel(response_id)
    return json_response(stored.body)


async def _stream(
    w: EmulatedWorker, store: ResponseStore, call: ResponsesCall, group: LiveGroup
) -> AsyncGenerator[bytes]:
    event = EventWriter()
    yield event("response.created", response=response_object(call, group, done=False))
    yield event("response.in_progress", response=response_object(call, group, done=False))
    is_call = group.gen.tool_call is not None
    ids = {"item_id": item_id("fc" if is_call else "msg", group), "output_index": 0}
    part = {"content_index": 0}
    top_k = group.gen.logprobs
    sent = 0  # tokens streamed so far: each piece is one token's text
    async with contextlib.aclosing(answer_steps(w, group)) as steps:
        async for first, pieces in steps:
            out: list[bytes] = []
            if first:
                out.append(event("response.output_item.added", output_index=0,
                                 item=output_item(group, "in_progress", "")))  # fmt: skip
                if not is_call:
                    out.append(event("response.content_part.added", **ids, **part, part=_text_part("")))
            for piece in pieces:
                token, sent = sent, sent + 1
                if not piece:  # a token held back for a stop string streams no delta (vLLM's either)
                    continue
                if is_call:
                    out.append(event("response.function_call_arguments.delta", **ids, delta=piece))
                    continue
                entries = group.lives[0].logprobs[token:sent]
                lps = [] if top_k is None else responses_delta_logprobs(entries, top_k)
                out.append(event("response.output_text.delta", **ids, **part, delta=piece, logprobs=lps))
            yield b"".join(out)
    if group.failed:
        yield event("error", code="server_error", message="the emulated engine failed", param=None)
        return
    text = group.lives[0].answer.text
    if is_call:
        yield event("response.function_call_arguments.done", **ids, arguments=text)
    else:
        yield event("response.output_text.done", **ids, **part, text=text, logprobs=[])
        yield event("response.content_part.done", **ids, **part, part=_text_part(text))
    yield event("response.output_item.done", output_index=0, item=output_item(group, "completed", text))
    yield event("response.completed", response=_keep(store, call, group))


def _text_part(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
