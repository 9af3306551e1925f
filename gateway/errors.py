"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson


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
