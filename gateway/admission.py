"""From an HTTP request to an admitted, routable request: auth, size, parse, model, quota, keys.

Only the fields routing needs are validated here (`model`, `messages` / `prompt`, `stream`,
`stream_options`); everything else is the worker's to judge and is forwarded untouched.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from starlette.requests import Request

from gateway.auth import Tenant
from gateway.errors import ApiError, bad_request
from gateway.quotas import TenantLimiter
from gateway.registry import Pool
from gateway.state import GatewayState
from policies.base import Isolation, RouteRequest
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity

Endpoint = Literal["chat", "completions"]
UPSTREAM_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed every check and holds a quota slot (released by whoever finishes it)."""

    request_id: str
    endpoint: Endpoint
    tenant: Tenant
    limiter: TenantLimiter
    pool: Pool
    model: str
    body: bytes
    stream: bool
    strip_usage: bool
    route: RouteRequest
    max_output_tokens: int
    started_s: float


def request_id_of(request: Request) -> str:
    """Honour a sane inbound `x-request-id`; otherwise make one."""
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return os.urandom(16).hex()


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(
            413, f"request body larger than {max_bytes} bytes", "invalid_request_error", "body_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(
                413, f"request body larger than {max_bytes} bytes", "invalid_request_error", "body_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def authenticate(request: Request, state: GatewayState) -> Tenant:
    tenant = state.keyring.lookup(request.headers.get("authorization"))
    if tenant is None:
        missing = not request.headers.get("authorization")
        message = (
            "missing API key: send 'Authorization: Bearer <key>'" if missing else "incorrect API key provided"
        )
        raise ApiError(401, message, "invalid_request_error", "invalid_api_key")
    return tenant


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' is required and must be a non-empty array", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise bad_request("every entry of 'messages' must be an object", "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise bad_request("'prompt' is required and must be a string or a non-empty array", "prompt")
    if not isinstance(body.get("stream", False), bool | None):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return body


def _max_output_tokens(body: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


async def admit(request: Request, endpoint: Endpoint, state: GatewayState, request_id: str) -> Admitted:
    """Run every check in the order a client would expect: 401, 413, 400, 404, 429."""
    started_s = time.monotonic()
    tenant = authenticate(request, state)
    raw = await read_body(request, state.config.limits.max_body_bytes)
    body = parse_body(raw, endpoint)
    model: str = body["model"]
    pool = state.registry.by_model.get(model)
    if pool is None:
        raise ApiError(
            404, f"The model '{model}' does not exist", "invalid_request_error", "model_not_found", "model"
        )

    namespace = PUBLIC_NAMESPACE if tenant.isolation is Isolation.PUBLIC else tenant.namespace
    identity = KeyIdentity(
        model_id=model, block_size_tokens=pool.config.block_size_tokens, namespace=namespace
    )
    public = (
        KeyIdentity(model_id=model, block_size_tokens=pool.config.block_size_tokens)
        if tenant.isolation is Isolation.SHARED_PUBLIC
        else None
    )
    canonical = state.normalizers[pool.name].canonicalize(endpoint, body, identity, public)

    limiter = state.limiter(tenant)
    rejection = limiter.admit(canonical.n_tokens, started_s)
    if rejection is not None:
        retry_after = max(1, int(rejection.retry_after_s + 0.999))
        headers = {
            "retry-after": str(retry_after),
            "retry-after-ms": str(int(rejection.retry_after_s * 1000)),
        }
        if not rejection.retryable:
            headers["x-should-retry"] = "false"
        raise ApiError(
            429,
            rejection.message,
            "rate_limit_error" if rejection.retryable else "insufficient_quota",
            rejection.code,
            None,
            headers,
        )

    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    changed = False
    if stream and not wants_usage:
        # Ask for usage anyway (the policy learns from cached_tokens) and strip it before the client.
        body["stream_options"] = {**(options or {}), "include_usage": True}
        changed = True
    if tenant.isolation is Isolation.STRICT and body.get("cache_salt") != tenant.cache_salt:
        body["cache_salt"] = tenant.cache_salt
        changed = True
    max_out = _max_output_tokens(body)
    route = RouteRequest(
        request_id=request_id,
        pool=pool.name,
        tenant=tenant.name,
        namespace=namespace,
        block_keys=canonical.block_keys,
        n_prompt_tokens=canonical.n_tokens,
        block_size_tokens=canonical.block_size_tokens,
        isolation=tenant.isolation,
        public_block_keys=canonical.public_block_keys,
        immutable_blocks=canonical.immutable_blocks,
        max_output_tokens=max_out or None,
        session_key=_session_key(body, tenant),
    )
    return Admitted(
        request_id=request_id,
        endpoint=endpoint,
        tenant=tenant,
        limiter=limiter,
        pool=pool,
        model=model,
        body=orjson.dumps(body) if changed else raw,
        stream=stream,
        strip_usage=stream and not wants_usage,
        route=route,
        max_output_tokens=max_out,
        started_s=started_s,
    )


def _session_key(body: dict[str, Any], tenant: Tenant) -> str | None:
    # OpenAI's routing hint; scoped by tenant so two tenants' equal keys never meet.
    key = body.get("prompt_cache_key")
    return f"{tenant.namespace}/{key}" if isinstance(key, str) and key else None
