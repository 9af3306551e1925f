"""Server-sent-event passthrough with minimal per-chunk work.

Upstream bytes arrive in arbitrary pieces; the relay forwards whole events only (so a terminal
error event can always be appended cleanly) and looks inside an event only when a cheap byte test
says it may be the usage chunk, `[DONE]` or an in-stream error.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import error_body

DONE_EVENT = b"data: [DONE]\n\n"
_MAX_PENDING_BYTES = 4 * 1024 * 1024


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    return b"data: " + error_body(message, type_, code) + b"\n\n"


class SseRelay:
    """Splits an SSE byte stream into events and rewrites the few that need it.

    - a usage chunk with `"choices": null` gets `"choices": []` (vLLM quirk; SDKs expect a list);
    - with `strip_usage`, the usage-only chunk the gateway asked for on the client's behalf is
      dropped after its usage is recorded;
    - `done` and `error` record whether the worker finished the stream or reported a failure.
    """

    __slots__ = ("_pending", "done", "error", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self._pending = b""
        self.done = False
        self.error: Any = None
        self.usage: Any = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to forward now (whole events only); the partial tail waits for the next chunk."""
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_PENDING_BYTES:
                raise ValueError("upstream sent an oversized SSE event")
            self._pending = data
            return b""
        head = data[: cut + 2]
        self._pending = data[cut + 2 :]
        if (
            b'"usage":{' in head
            or b'"usage": {' in head
            or b"data: [DONE]" in head
            or b'data: {"error"' in head
        ):
            return self._inspect(head)
        return head

    def _inspect(self, head: bytes) -> bytes:
        out: list[bytes] = []
        for event in head.split(b"\n\n"):
            if not event:
                continue
            payload = event[6:] if event.startswith(b"data: ") else None
            if payload == b"[DONE]":
                self.done = True
            elif payload is not None and (b'"usage"' in payload or payload.startswith(b'{"error"')):
                rewritten = self._rewrite(payload)
                if rewritten is None:
                    continue
                event = b"data: " + rewritten
            out.append(event + b"\n\n")
        return b"".join(out)

    def _rewrite(self, payload: bytes) -> bytes | None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return payload
        if not isinstance(obj, dict):
            return payload
        if "error" in obj:
            self.error = obj["error"]
            return payload
        usage = obj.get("usage")
        if usage is None:
            return payload
        self.usage = usage
        choices = obj.get("choices")
        if self.strip_usage and not choices:
            return None
        if "choices" in obj and choices is None:
            obj["choices"] = []
            return orjson.dumps(obj)
        return payload
