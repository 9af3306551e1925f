"""vLLM's base request id (`OpenAIServing._base_request_id`): the client's `X-Request-Id` header,
else the id the body gave, else a fresh random one. The routes of vLLM 0.33 this emulator added
(`routes_batch`, `routes_reads`, `routes_scale_out`) name their answers with it."""

from __future__ import annotations

import uuid

from fastapi import Request


def base_request_id(request: Request, default: str | None = None) -> str:
    header = request.headers.get("x-request-id")
    if header is not None:
        return header
    return default if default is not None else uuid.uuid4().hex
