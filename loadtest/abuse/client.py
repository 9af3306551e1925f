"""The well-behaved client side of the probes: whole answers and streams read to `[DONE]`, each
with its own time limit, outcomes as records (a transport failure is an outcome, not an
exception)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from loadtest.abuse.stack import MODEL
from loadtest.workloads.text import synth_text

CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer; `status` 0 when the request failed in transport (`error` says how)."""

    status: int
    body: dict[str, Any] | None
    elapsed_s: float
    error: str | None = None

    @property
    def error_code(self) -> str | None:
        error = (self.body or {}).get("error")
        return error.get("code") if isinstance(error, dict) else None

    @property
    def cached_tokens(self) -> int:
        usage = (self.body or {}).get("usage") or {}
        return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A streamed answer: whether it reached `[DONE]` without an error event."""

    status: int
    done: bool
    error_event: bool
    events: int
    elapsed_s: float
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and not self.error_event and self.error is None


def text(key: str, n_chars: int) -> str:
    """Deterministic filler text, different for every key (prompts no cache has seen)."""
    return synth_text(key, n_chars)


def chat_body(content: str, max_tokens: int, *, stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _headers(key: str, request_id: str | None) -> dict[str, str]:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return headers


async def post(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    body: dict[str, Any] | bytes,
    *,
    request_id: str | None = None,
    timeout_s: float = 30.0,
) -> Reply:
    """POST a JSON body (or raw bytes) and read the whole answer."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    started = time.monotonic()
    try:
        async with session.post(
            url, data=data, headers=_headers(key, request_id), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            raw = await resp.read()
            try:
                parsed = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                parsed = None
            return Reply(
                resp.status, parsed if isinstance(parsed, dict) else None, time.monotonic() - started
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Reply(0, None, time.monotonic() - started, type(exc).__name__)


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    body: dict[str, Any],
    *,
    request_id: str | None = None,
    timeout_s: float = 60.0,
) -> StreamReply:
    """POST a streamed request and read its events until the server ends the response."""
    started = time.monotonic()
    done = error_event = False
    events = 0
    status = 0
    try:
        async with session.post(
            url,
            data=orjson.dumps(body),
            headers=_headers(key, request_id),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status = resp.status
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                events += 1
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b'data: {"error"'):
                    error_event = True
        return StreamReply(status, done, error_event, events, time.monotonic() - started)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamReply(status, done, error_event, events, time.monotonic() - started, type(exc).__name__)


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """A client session with no connection cap of its own (`limit` 0) unless one is asked for."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False))
