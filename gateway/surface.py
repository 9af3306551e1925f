"""The gateway's own GET routes of the OpenAI surface: models, one model, health, version.

`/v1/models` lists only models that have a routable worker now (healthy, breaker not open), so a
client never picks a model whose every worker is down; `/v1/models/{id}` answers the same card or
404. `/health` is the gateway's own liveness (it never asks a worker), as is SageMaker's `/ping`
(GET or POST, as vLLM serves it), and `/version` its version; none needs a key, like vLLM's.
SGLang's `/health_generate` asks whether a request could be served: 200 while some model has a
routable worker, else 503 (it never sends a worker a generation of its own).
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

import orjson
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route, compile_path
from starlette.types import Scope

from gateway.admission import authenticate
from gateway.auth import Tenant
from gateway.breaker import BreakerState
from gateway.errors import ApiError, echoed
from gateway.gate import Gate
from gateway.keying import base_model
from gateway.registry import Registry
from gateway.request_head import RequestHead, request_id_of
from gateway.routes import ROUTES, STORED_RESPONSE_PATH


def _version() -> str:
    try:
        return version("kvgate")
    except PackageNotFoundError:
        return "unknown"


VERSION = _version()


class _ModelId(Convertor[str]):
    """A model id in a path: one or more characters, slashes included (`org/model`)."""

    regex = ".+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("kvgate_model_id", _ModelId())


def model_cards(registry: Registry, created_s: int) -> dict[str, dict[str, object]]:
    """The fixed part of every served model's card, in vLLM's shape: `root` the model id (the
    gateway does not know the path a worker loaded), `parent` the pool's base model for a LoRA
    adapter id (null otherwise), `permission` empty; `owned_by` names the gateway. The context
    window changes with the workers: `with_window` adds it."""
    cards: dict[str, dict[str, object]] = {}
    for pool in registry.pools.values():
        adapters = pool.config.adapters
        base = base_model(pool)
        for model in pool.config.models:
            cards[model] = {
                "id": model,
                "object": "model",
                "created": created_s,
                "owned_by": "kvgate",
                "root": model,
                "parent": base if model in adapters else None,
                "permission": [],
            }
    return cards


def with_window(card: dict[str, object], max_model_len: int | None) -> dict[str, object]:
    """The card with the model's context window as vLLM places it (before `permission`): the
    pool's stated or learned window (`model_window.PoolWindows`); the card as it is when none
    is known."""
    if max_model_len is None:
        return card
    out = {name: value for name, value in card.items() if name != "permission"}
    out["max_model_len"] = max_model_len
    out["permission"] = card["permission"]
    return out


def routable_models(registry: Registry) -> list[str]:
    """Every served model id whose pool has a worker that may take a request now."""
    now_s = time.monotonic()
    out: list[str] = []
    for pool in registry.pools.values():
        if any(w.healthy and w.breaker.state(now_s) is not BreakerState.OPEN for w in pool.workers.values()):
            out.extend(pool.config.models)
    return out


def error(err: ApiError, request_id: str) -> Response:
    return Response(
        err.body(),
        err.status,
        headers={"x-request-id": request_id, **err.headers},
        media_type="application/json",
    )


def json_response(obj: object, status: int, request_id: str) -> Response:
    return Response(
        orjson.dumps(obj), status, headers={"x-request-id": request_id}, media_type="application/json"
    )


def tenant_of(request: Request, gate: Gate) -> Tenant:
    """The tenant of a request to one of the Starlette routes, by the proxied routes' own rule
    (`admission.authenticate` over the request's head): 401 without a known key, 400 when the
    key is sent twice (which of two keys named the tenant would otherwise depend on the route)."""
    return authenticate(RequestHead.of(request.scope), gate)


# A GET that `responses_routes` serves: vLLM's `GET /v1/responses/{response_id}` takes any one
# path segment as an id, so a GET of its `POST /v1/responses/render` is a retrieve of a response
# named `render` (404 there), never a method not allowed.
_STORED_RESPONSE = compile_path(STORED_RESPONSE_PATH)[0]


class _OtherMethods(Route):
    """A proxied POST route's path with any method it is not served with: a 405 whose `Allow`
    names the ones it is (RFC 9110 §15.5.6). POST reaches the proxy before Starlette does; GET
    (and HEAD) where the path could name a stored response is that response's retrieve, as on
    vLLM, and this route passes it on to `responses_routes`."""

    def __init__(self, path: str) -> None:
        stored = _STORED_RESPONSE.match(path) is not None
        self.allowed = frozenset({"POST", "GET", "HEAD"} if stored else {"POST"})
        allow = ", ".join(sorted(self.allowed))

        async def not_allowed(request: Request) -> Response:
            # Answered by the app's 405 handler, in the route's API's shape.
            raise HTTPException(405, headers={"Allow": allow})

        super().__init__(path, not_allowed)
        self.methods = None  # every method reaches `not_allowed`, but those `matches` passes on

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and scope["method"] in self.allowed:
            return Match.NONE, {}
        return super().matches(scope)


def allow_header(exc: Exception) -> dict[str, str]:
    """The `Allow` header a 405 carries, from the route's `HTTPException` (Starlette's, or
    `_OtherMethods`'), its methods in a fixed order (Starlette joins a set's)."""
    headers = exc.headers if isinstance(exc, HTTPException) else None
    allow = (headers or {}).get("Allow")
    if allow is None:
        return {}
    return {"allow": ", ".join(sorted(method.strip() for method in allow.split(",")))}


def surface_routes(gate: Gate, registry: Registry, created_s: int) -> list[Route]:
    """The GET routes above, and 405 for any other method on a proxied POST route."""

    cards = model_cards(registry, created_s)  # the pools' models are fixed for the process

    def card(model: str) -> dict[str, object]:
        return with_window(cards[model], registry.by_model[model].windows.max_model_len.get(model))

    async def models(request: Request) -> Response:
        request_id = request_id_of(request)
        try:
            tenant_of(request, gate)
        except ApiError as err:
            return error(err, request_id)
        data = [card(model) for model in routable_models(registry)]
        return json_response({"object": "list", "data": data}, 200, request_id)

    async def model(request: Request) -> Response:
        request_id = request_id_of(request)
        try:
            tenant_of(request, gate)
        except ApiError as refused:
            return error(refused, request_id)
        model_id = request.path_params["model_id"]
        if model_id not in routable_models(registry):
            message = f"The model '{echoed(model_id)}' does not exist"
            err = ApiError(404, message, "invalid_request_error", "model_not_found", "model")
            return error(err, request_id)
        return json_response(card(model_id), 200, request_id)

    async def health(request: Request) -> Response:
        return json_response({"status": "ok"}, 200, request_id_of(request))

    async def health_generate(request: Request) -> Response:
        if routable_models(registry):
            return json_response({"status": "ok"}, 200, request_id_of(request))
        return json_response({"status": "no routable worker"}, 503, request_id_of(request))

    async def version_info(request: Request) -> Response:
        return json_response({"version": VERSION}, 200, request_id_of(request))

    return [
        *(_OtherMethods(path) for path in ROUTES),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:kvgate_model_id}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/version", version_info, methods=["GET"]),
    ]
