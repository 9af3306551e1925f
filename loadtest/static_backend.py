"""An instant static backend for overhead benchmarks: the same canned answer to every request.

The overhead benchmark needs a backend that costs (almost) nothing, so that what is measured is the
router in front of it. nginx with `return 200 '<json>'` is the preferred one (`nginx_config()`); when
nginx is not installed this raw asyncio HTTP/1.1 server stands in. It answers GET /health,
GET /v1/models and POST /v1/chat/completions, /v1/completions with a fixed vLLM-shaped JSON body,
keeps connections alive, and reads (then ignores) request bodies by Content-Length. With `stream`
(`--stream`), chat answers are a fixed vLLM-shaped event stream instead: 16 one-token deltas, the
finish chunk, the usage chunk and `[DONE]`, written at once (this server: chunked transfer
encoding, one chunk per event, as an engine sends them; nginx: one body with a Content-Length).

    python -m loadtest.static_backend --port 31001 [--host 127.0.0.1] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import cast

MODEL = "bench-model"
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024

CHAT_BODY = json.dumps(
    {
        "id": "chatcmpl-static",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 1,
            "total_tokens": 301,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    },
    separators=(",", ":"),
)
COMPLETION_BODY = json.dumps(
    {
        "id": "cmpl-static",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301},
    },
    separators=(",", ":"),
)
MODELS_BODY = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "static"}]},
    separators=(",", ":"),
)
STREAM_DELTAS = 16


def _chat_stream_body() -> str:
    def event(choices: list[dict[str, object]], usage: dict[str, object] | None = None) -> str:
        chunk: dict[str, object] = {
            "id": "chatcmpl-static",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return "data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n"

    events = [event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    events += [
        event([{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}])
        for i in range(STREAM_DELTAS)
    ]
    events.append(event([{"index": 0, "delta": {}, "finish_reason": "length"}]))
    usage = {
        "prompt_tokens": 300,
        "completion_tokens": STREAM_DELTAS,
        "total_tokens": 300 + STREAM_DELTAS,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    events.append(event([], usage))
    return "".join(events) + "data: [DONE]\n\n"


CHAT_STREAM_BODY = _chat_stream_body()
METRICS_BODY = (
    'vllm:num_requests_running{model_name="bench-model"} 0\n'
    'vllm:num_requests_waiting{model_name="bench-model"} 0\n'
    'vllm:kv_cache_usage_perc{model_name="bench-model"} 0\n'
)

ROUTES: dict[tuple[str, str], tuple[str, str]] = {
    ("POST", "/v1/chat/completions"): ("application/json", CHAT_BODY),
    ("POST", "/v1/completions"): ("application/json", COMPLETION_BODY),
    ("GET", "/v1/models"): ("application/json", MODELS_BODY),
    ("GET", "/health"): ("text/plain", ""),
    ("GET", "/metrics"): ("text/plain; version=0.0.4", METRICS_BODY),
}
STREAM_ROUTES = {**ROUTES, ("POST", "/v1/chat/completions"): ("text/event-stream", CHAT_STREAM_BODY)}


def routes(stream: bool) -> dict[tuple[str, str], tuple[str, str]]:
    """What each route answers: chat as JSON, or as an event stream with `stream`."""
    return STREAM_ROUTES if stream else ROUTES


def _response(status: str, content_type: str, body: str, close: bool) -> bytes:
    raw = body.encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(raw)}\r\n"
        f"connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + raw


def _chunked_stream() -> bytes:
    # As an engine sends it: chunked transfer encoding, one chunk per event.
    head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    head += "connection: keep-alive\r\n\r\n"
    events = [e + b"\n\n" for e in CHAT_STREAM_BODY.encode().split(b"\n\n") if e]
    return head.encode() + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _prebuilt(stream: bool) -> dict[tuple[str, str], bytes]:
    answers = {key: _response("200 OK", ct, body, close=False) for key, (ct, body) in routes(stream).items()}
    if stream:
        answers[("POST", "/v1/chat/completions")] = _chunked_stream()
    return answers


_NOT_FOUND = _response("404 Not Found", "application/json", '{"error":"not found"}', close=False)


class _StaticHttp(asyncio.Protocol):
    """One connection: parse request heads, skip bodies, write the canned answer."""

    def __init__(self, answers: dict[tuple[str, str], bytes]) -> None:
        self._answers = answers
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses but have the same interface.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while self._transport is not None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEADER_BYTES:
                    self._fail("431 Request Header Fields Too Large")
                return
            head = bytes(self._buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3:
                self._fail("400 Bad Request")
                return
            length = 0
            close = parts[2] == "HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                lname = name.strip().lower()
                if lname == "content-length":
                    try:
                        length = int(value.strip())
                    except ValueError:
                        self._fail("400 Bad Request")
                        return
                elif lname == "transfer-encoding":
                    self._fail("411 Length Required")
                    return
                elif lname == "connection":
                    close = value.strip().lower() == "close"
            if length < 0 or length > MAX_BODY_BYTES:
                self._fail("413 Content Too Large")
                return
            if len(self._buf) < end + 4 + length:
                return
            del self._buf[: end + 4 + length]
            path = parts[1].split("?", 1)[0]
            answer = self._answers.get((parts[0], path), _NOT_FOUND)
            self._transport.write(answer)
            if close:
                self._transport.close()
                self._transport = None

    def _fail(self, status: str) -> None:
        if self._transport is not None:
            self._transport.write(_response(status, "text/plain", "", close=True))
            self._transport.close()
            self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None


async def serve(host: str, port: int, stream: bool = False) -> None:
    loop = asyncio.get_running_loop()
    answers = _prebuilt(stream)
    server = await loop.create_server(lambda: _StaticHttp(answers), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def nginx_config(prefix: str, port: int, host: str = "127.0.0.1", stream: bool = False) -> str:
    """An nginx.conf (one worker, no logs) serving the same routes as the built-in server."""
    chat_type, chat_body = routes(stream)[("POST", "/v1/chat/completions")]

    def ret(body: str, ctype: str) -> str:
        escaped = body.replace("\\", "\\\\").replace("'", "\\'")
        return f"default_type {ctype}; return 200 '{escaped}';"

    locations = [
        f"location = /v1/chat/completions {{ {ret(chat_body, chat_type)} }}",
        f"location = /v1/completions {{ {ret(COMPLETION_BODY, 'application/json')} }}",
        f"location = /v1/models {{ {ret(MODELS_BODY, 'application/json')} }}",
        f"location = /health {{ {ret('', 'text/plain')} }}",
        f"location = /metrics {{ {ret(METRICS_BODY, 'text/plain')} }}",
    ]
    temp = "\n".join(
        f"  {kind}_temp_path {prefix}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process on;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
user root;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_max_body_size 16m;
{temp}
  server {{
    listen {host}:{port} backlog=1024;
    {chr(10).join("    " + loc for loc in locations).lstrip()}
  }}
}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description="instant static backend for overhead benchmarks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stream", action="store_true", help="answer chat with an event stream")
    args = parser.parse_args()
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port, args.stream))


if __name__ == "__main__":
    main()
