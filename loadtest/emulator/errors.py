"""OpenAI-shaped API errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the emulator returns to the client with an HTTP status."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, "BadRequestError", param)

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> ApiError:
        return cls(404, message, "NotFoundError", param)

    @classmethod
    def unavailable(cls, message: str) -> ApiError:
        return cls(503, message, "ServiceUnavailableError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


class RequestValidationError(ApiError):
    """vLLM's answer when FastAPI refuses a request for its handler (the body by vLLM's pydantic
    request model, or a typed query parameter): FastAPI's `RequestValidationError`, turned into a
    400 by vLLM's handler (type `Bad Request`, no `param`), the message naming the error as
    FastAPI prints it. That happens before any route runs, so every route answers it in this
    (OpenAI) envelope, Anthropic Messages too."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(400, f"1 validation error:\n  {error}\n {[error]}", "Bad Request")
