"""HTTP plumbing every route family shares: JSON in and out, and waiting on a request's tokens.

A handler submits a `LiveGroup`, then either waits for it to finish (`wait_finished`, which
aborts it when the client goes away) or streams it (`token_batches`, which yields the tokens
each engine step made ready and aborts whatever is left when the stream is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from loadtest.emulator.errors import ApiError
from loadtest.emulator.live import LiveGroup, LiveRequest
from loadtest.emulator.worker import EmulatedWorker

MAX_BODY_BYTES = 64 * 1024 * 1024
DISCONNECT_POLL_S = 0.5


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def worker_of(request: Request) -> EmulatedWorker:
    """The app's worker (set by the lifespan)."""
    w: EmulatedWorker = request.app.state.worker
    return w


def named_event(kind: str, data: Mapping[str, Any]) -> bytes:
    """A server-sent event named `kind` whose JSON data leads with `"type": kind`: the framing of
    the Responses and Anthropic Messages streams (chat streams send data-only events)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


async def read_body(request: Request, limit_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The raw body; 413 above `limit_bytes` (checked on the header first, then on the bytes)."""
    length = request.headers.get("content-length")
    too_large = ApiError(413, f"request body larger than {limit_bytes} bytes", "BadRequestError")
    if length is not None and length.isdigit() and int(length) > limit_bytes:
        raise too_large
    raw = await request.body()
    if len(raw) > limit_bytes:
        raise too_large
    return raw


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else."""
    raw = await read_body(request)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError.bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError.bad_request("request body must be a JSON object")
    return body


async def wait_finished(request: Request, w: EmulatedWorker, group: LiveGroup) -> Response | None:
    """Wait until every sequence of `group` finished. Returns a 499 response if the client went
    away (the group is aborted); raises a 500 ApiError if the engine failed."""
    try:
        # Tokens wake this loop every step; look for a client disconnect every poll period.
        next_check_s = time.monotonic() + DISCONNECT_POLL_S
        while not group.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(group.wait(), timeout=DISCONNECT_POLL_S)
            if time.monotonic() >= next_check_s:
                next_check_s = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    w.abort(group)
                    return Response(status_code=499)
    finally:
        w.abort(group)  # no-op once finished; frees blocks if the handler is cancelled
    if group.failed:
        raise ApiError(500, "the emulated engine failed while running this request", "InternalServerError")
    return None


async def token_batches(
    w: EmulatedWorker, group: LiveGroup
) -> AsyncGenerator[list[tuple[LiveRequest, int, int]]]:
    """Yield, after each wake-up, `(sequence, start, stop)` for the output tokens made ready
    since the last batch (tokens of several steps go out together to a slow reader), until every
    sequence finished. Closing the iterator aborts the sequences still running."""
    sent = [0] * len(group.lives)
    try:
        while True:
            batch: list[tuple[LiveRequest, int, int]] = []
            for i, live in enumerate(group.lives):
                ready = min(live.produced, live.num_output_tokens)
                if ready > sent[i]:
                    batch.append((live, sent[i], ready))
                    sent[i] = ready
            if batch:
                yield batch
            if group.finished:
                return
            await group.wait()
    finally:
        w.abort(group)


async def answer_steps(w: EmulatedWorker, group: LiveGroup) -> AsyncGenerator[tuple[bool, list[str]]]:
    """For a one-answer group (Responses, Messages): per batch of `token_batches`, whether it is
    the first (the stream's opening events go with the first token, so usage knows the cache hit)
    and the text each of its tokens streams (`Answer.deltas`). Closing the iterator aborts what
    is still running."""
    first = True
    async with contextlib.aclosing(token_batches(w, group)) as batches:
        async for batch in batches:
            yield first, [delta for live, start, stop in batch for delta in live.answer.deltas[start:stop]]
            first = False
