"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from starlette.types import Receive, Scope, Send


@dataclass(frozen=True, slots=True)
class ApiError(Exception):
    """An error the gateway answers itself, with the status the OpenAI SDKs map to an exception."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_request", param)


def upstream_error(status: int, message: str) -> ApiError:
    code = {502: "bad_gateway", 503: "no_worker_available", 504: "upstream_timeout"}.get(
        status, "server_error"
    )
    headers = {"retry-after": "1"} if status == 503 else {}
    return ApiError(status, message, "server_error", code, None, headers)


class RawResponse:
    """A complete response sent as two raw ASGI messages (no header-object layers on the hot path)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def error_response(err: ApiError, request_id: str) -> RawResponse:
    headers = [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode())]
    headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
    return RawResponse(err.status, err.body(), headers)
