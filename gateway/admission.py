"""From an HTTP request to an admitted, routable request: auth, size, parse, model, quota, keys.

Only the fields routing needs are validated here (`model`, `messages` / `prompt`, `stream`,
`stream_options`); everything else is the worker's to judge and is forwarded untouched.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope

from gateway.auth import Tenant
from gateway.errors import ApiError, bad_request
from gateway.quotas import Rejection, TenantLimiter
from gateway.registry import Pool
from gateway.render import render_canonical
from gateway.retries import RETRY_COUNT_HEADER, retries_taken
from gateway.state import GatewayState
from gateway.upstream_headers import ClientHeaders, pick
from policies.base import RouteDecision, RouteRequest
from policies.identity import cache_salt_for, session_key
from policies.records import record
from prompt_normalizer.errors import NormalizerError

Endpoint = Literal["chat", "completions"]
# Body fields that steer an engine's internals rather than the completion. A tenant must not set
# them: `kv_transfer_params` (vLLM disaggregated prefill: where KV is pulled from or pushed to),
# `request_id` / `rid` (the engine's request id; the gateway names requests itself),
# `data_parallel_rank` (pins an engine rank), `bootstrap_host` / `bootstrap_port` /
# `bootstrap_room` (SGLang prefill-decode transfer), `prompt_embeds` (bypasses tokenization, so
# the prefix keys could not describe the prompt). They are refused with 400, naming the field.
# `cache_salt` is not refused: the gateway always replaces it with its own.
ENGINE_INTERNAL_FIELDS = frozenset(
    {
        "kv_transfer_params",
        "request_id",
        "rid",
        "data_parallel_rank",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "prompt_embeds",
    }
)
UPSTREAM_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class Admitted:
    """A request that passed every check and holds a quota slot, released exactly once by
    `outcome.record_request` (which sets `recorded`).

    `forward` is the body to send upstream (the canonical body when the normalizer changed it) and
    `encoded` the client's body as the gateway re-encoded it at parse time (without any client
    `cache_salt`), reused when nothing else needs changing.
    """

    request_id: str
    client_request_id: str | None
    endpoint: Endpoint
    tenant: Tenant
    limiter: TenantLimiter
    pool: Pool
    model: str
    encoded: bytes
    forward: dict[str, Any]
    changed: bool
    stream: bool
    strip_usage: bool
    route: RouteRequest
    max_output_tokens: int
    started_s: float
    public_salt: str
    drift_field: str | None = None
    retries_taken: int = 0  # the client's earlier tries of this call (`retries.py`)
    priority: int = 0  # vLLM's `priority` (lower first): orders the tenant's own queued requests
    queued_s: float | None = None  # time spent in the pool's queue (`queueing.py`), if it queued
    client_headers: ClientHeaders = ()  # the client headers the pool forwards (`upstream_headers.py`)
    recorded: bool = False
    _encoded: dict[str | None, bytes] = field(default_factory=dict)

    @property
    def reply_id(self) -> str:
        """The `x-request-id` sent back to the client."""
        return self.client_request_id if self.client_request_id is not None else self.request_id

    def body_for(self, decision: RouteDecision) -> bytes:
        """The bytes for one dispatch, always with the gateway's own `cache_salt` (a client's is
        replaced): the tenant's salt, or the public salt when the whole prompt lies inside the
        promoted public prefix the policy routed (vLLM's salt covers a request's entire chain, so
        any private token after the public prefix must keep the tenant's salt)."""
        salt = cache_salt_for(
            self.route, decision.shared_prefix_blocks, self.tenant.cache_salt, self.public_salt
        )
        cached = self._encoded.get(salt)
        if cached is not None:
            return cached
        if self.changed:
            out = orjson.dumps({**self.forward, "cache_salt": salt})
        else:
            # `encoded` is a non-empty JSON object with no `cache_salt` key: the salt goes first.
            out = b'{"cache_salt":' + orjson.dumps(salt) + b"," + self.encoded[1:]
        self._encoded[salt] = out
        return out


@record
class RequestHead:
    """The request headers the hot path reads, found in one pass over the raw ASGI headers (no
    header-object layers): `Authorization`, `x-request-id`, `Content-Length` and the SDK's
    `x-stainless-retry-count` (`retries.py`); `raw` is the ASGI header list itself, from which
    a pool's `forward_headers` are picked once the pool is known."""

    authorization: str | None
    client_request_id: str | None
    content_length: int | None
    retries_taken: int = 0
    raw: Sequence[tuple[bytes, bytes]] = ()

    @classmethod
    def of(cls, scope: Scope) -> RequestHead:
        authorization = rid = length = None
        taken = 0
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-request-id":
                rid = _sane_id(value.decode("latin-1"))
            elif name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == RETRY_COUNT_HEADER:
                taken = retries_taken(value)
        return cls(authorization, rid, length, taken, scope["headers"])


@record
class RequestIds:
    """`internal` is always made here: it names the request to the worker, the policy and the
    logs, so two clients that send the same `x-request-id` can never collide. `client` is the
    client's own id (when sane), only echoed back and logged beside the internal one.
    `retries_taken` numbers the client's own tries of one call (`retries.py`), and `headers` are
    the client's raw headers (a pool may forward some, `upstream_headers.py`)."""

    internal: str
    client: str | None
    retries_taken: int = 0
    headers: Sequence[tuple[bytes, bytes]] = ()

    @property
    def reply(self) -> str:
        """The `x-request-id` of the response: the client's own id, else the internal one."""
        return self.client if self.client is not None else self.internal


# Internal ids: a random per-process prefix and a counter. Unique, which is all an engine and the
# policy need, and far cheaper than reading the OS's random source per request.
_ID_PREFIX = os.urandom(6).hex()
_id_counter = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):010x}"


def request_ids(head: RequestHead) -> RequestIds:
    return RequestIds(new_request_id(), head.client_request_id, head.retries_taken, head.raw)


def _sane_id(rid: str | None) -> str | None:
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return None


def client_request_id(request: Request) -> str | None:
    """A sane inbound `x-request-id` (printable ASCII, at most 128 characters), else None."""
    return _sane_id(request.headers.get("x-request-id"))


def request_id_of(request: Request) -> str:
    """The id to answer with on routes that send nothing upstream."""
    return client_request_id(request) or new_request_id()


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"request body larger than {max_bytes} bytes", "invalid_request_error", "body_too_large"
    )


async def read_body(receive: Receive, head: RequestHead, max_bytes: int) -> bytes:
    """The whole body, straight from the ASGI `receive` channel; 413 as soon as it is too large."""
    if head.content_length is not None and head.content_length > max_bytes:
        raise _too_large(max_bytes)
    message = await receive()
    body: bytes = message.get("body", b"")
    if message["type"] == "http.disconnect":
        raise ClientDisconnect
    if not message.get("more_body", False):
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
        return body
    chunks = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def authenticate(head: RequestHead, state: GatewayState) -> Tenant:
    tenant = state.keyring.lookup(head.authorization)
    if tenant is None:
        missing = not head.authorization
        message = (
            "missing API key: send 'Authorization: Bearer <key>'" if missing else "incorrect API key provided"
        )
        raise ApiError(401, message, "invalid_request_error", "invalid_api_key")
    return tenant


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The request body as a JSON object, with the fields routing needs checked; 400 otherwise."""
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
    if options is not None and not isinstance(options.get("include_usage", False), bool | None):
        # A non-boolean would otherwise be read as "no usage" and silently dropped.
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad_request("'priority' must be an integer (lower is served earlier)", "priority")
    if not ENGINE_INTERNAL_FIELDS.isdisjoint(body):
        name = min(ENGINE_INTERNAL_FIELDS.intersection(body))
        raise bad_request(f"'{name}' is an engine-internal field and cannot be set through the gateway", name)
    return body


# orjson parses up to 1024 levels but encodes at most 254, and every body is encoded again on its
# way to the worker (with the gateway's `cache_salt`), as are parts of it by the normalizer.
MAX_JSON_DEPTH = 254


def encode_body(body: dict[str, Any]) -> bytes:
    """The body re-encoded without any client `cache_salt` (the gateway always sets its own).

    This is also the nesting bound: encoding refuses JSON nested deeper than `MAX_JSON_DEPTH`, at
    the cost of one `orjson.dumps`, which `Admitted.body_for` then reuses instead of encoding again
    (faster than counting brackets in the raw bytes or walking the parsed objects in Python).
    """
    body.pop("cache_salt", None)
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise bad_request(
            f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of JSON objects and arrays"
        ) from None


def _max_output_tokens(body: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def enter(head: RequestHead, state: GatewayState, now_s: float) -> Tenant:
    """What the headers alone decide, before the body is read: 401 without a valid key, 413 when
    `Content-Length` is already too large, 429 when the tenant is at its concurrency limit or out
    of requests. Otherwise the request takes one of its tenant's slots (`TenantLimiter.enter`),
    which its caller gives back unless `admit` hands it to the admitted request."""
    tenant = authenticate(head, state)
    max_bytes = state.config.limits.max_body_bytes
    if head.content_length is not None and head.content_length > max_bytes:
        raise _too_large(max_bytes)
    rejection = state.limiter(tenant).enter(now_s)
    if rejection is not None:
        raise _quota_error(rejection)
    return tenant


async def admit(
    raw: bytes, endpoint: Endpoint, state: GatewayState, ids: RequestIds, tenant: Tenant, started_s: float
) -> Admitted:
    """Run every check that needs the body, in the order a client would expect: 400, 404, 429
    (tokens); the request already holds its tenant's slot (`enter`)."""
    request_id = ids.internal
    body = parse_body(raw, endpoint)
    encoded = encode_body(body)
    model: str = body["model"]
    pool = state.registry.by_model.get(model)
    if pool is None:
        raise ApiError(
            404, f"The model '{model}' does not exist", "invalid_request_error", "model_not_found", "model"
        )
    identity, public = state.identities(pool, model, tenant)
    normalizer = state.normalizer(pool)
    try:
        if normalizer.config.mode == "render":
            plan = normalizer.prepare_render(endpoint, body)
            canonical = await render_canonical(
                normalizer, plan, pool, state.upstream(), identity, public, request_id
            )
        elif normalizer.config.mode == "tokenizer":
            # Tokenizing and templating a long prompt takes milliseconds: off the event loop, on
            # the normalizer's one thread (so a Normalizer is never entered concurrently).
            canonical = await asyncio.get_running_loop().run_in_executor(
                state.normalizer_executor(),
                functools.partial(normalizer.canonicalize, endpoint, body, identity, public),
            )
        else:
            canonical = normalizer.canonicalize(endpoint, body, identity, public)
    except NormalizerError as exc:
        raise ApiError(400, exc.message, "invalid_request_error", exc.code, exc.param) from None

    limiter = state.limiter(tenant)
    rejection = limiter.admit(canonical.n_tokens, started_s)
    if rejection is not None:
        raise _quota_error(rejection)

    changed = canonical.canonical_body is not None
    forward = dict(canonical.canonical_body) if canonical.canonical_body is not None else body
    stream = body.get("stream") is True
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    if stream and not wants_usage:
        # Ask for usage anyway (the policy learns from cached_tokens) and strip it before the client.
        forward["stream_options"] = {**(options or {}), "include_usage": True}
        changed = True
    max_out = _max_output_tokens(body)
    route = RouteRequest(
        request_id=request_id,
        pool=pool.name,
        tenant=tenant.name,
        namespace=identity.namespace,
        block_keys=canonical.block_keys,
        n_prompt_tokens=canonical.n_tokens,
        block_size_tokens=canonical.block_size_tokens,
        isolation=tenant.isolation,
        public_block_keys=canonical.public_block_keys,
        immutable_blocks=canonical.immutable_blocks,
        max_output_tokens=max_out or None,
        session_key=session_key(tenant, body.get("prompt_cache_key")),
        adapter=identity.adapter or None,
    )
    drift = canonical.drift
    return Admitted(
        request_id=request_id,
        client_request_id=ids.client,
        endpoint=endpoint,
        tenant=tenant,
        limiter=limiter,
        pool=pool,
        model=model,
        encoded=encoded,
        forward=forward,
        changed=changed,
        stream=stream,
        strip_usage=stream and not wants_usage,
        route=route,
        max_output_tokens=max_out,
        started_s=started_s,
        public_salt=state.keyring.public_salt,
        drift_field=drift.field if drift is not None and drift.first_diff_block is not None else None,
        retries_taken=ids.retries_taken,
        priority=body.get("priority", 0),
        client_headers=pick(ids.headers, pool.forward) if pool.forward else (),
    )


def _quota_error(rejection: Rejection) -> ApiError:
    retry_after = max(1, int(rejection.retry_after_s + 0.999))
    headers = {"retry-after": str(retry_after), "retry-after-ms": str(int(rejection.retry_after_s * 1000))}
    if not rejection.retryable:
        headers["x-should-retry"] = "false"
    return ApiError(
        429,
        rejection.message,
        "rate_limit_error" if rejection.retryable else "insufficient_quota",
        rejection.code,
        None,
        headers,
    )
