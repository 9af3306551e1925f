"""Other servers' names for routes the emulator already serves: SageMaker's `/invocations`
(vLLM's dispatch by body shape) and SGLang's `/v1/tokenize`, `/v1/detokenize`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from loadtest.emulator import routes_openai, routes_pooling
from loadtest.emulator.errors import ApiError
from loadtest.emulator.web import read_json

router = APIRouter()
router.add_api_route("/v1/tokenize", routes_openai.tokenize, methods=["POST"], name="v1_tokenize")
router.add_api_route("/v1/detokenize", routes_openai.detokenize, methods=["POST"], name="v1_detokenize")

Handler = Callable[[Request], Awaitable[Response]]


def _pooling_handler(path: str) -> Handler:
    for route in routes_pooling.router.routes:
        if isinstance(route, APIRoute) and route.path == path:
            handler: Handler = route.endpoint
            return handler
    raise LookupError(path)


# vLLM tries chat, then completions, then its pooling request types; the emulated model does all.
_INVOCATION_ORDER: tuple[tuple[str, Handler], ...] = (
    ("messages", routes_openai.chat),
    ("prompt", routes_openai.completions),
    ("input", _pooling_handler("/v1/embeddings")),
)


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    body = await read_json(request)  # the request keeps the bytes for the handler that answers
    for field, handler in _INVOCATION_ORDER:
        if field in body:
            return await handler(request)
    raise ApiError.bad_request("Cannot find suitable handler for request")
