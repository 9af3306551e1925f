"""From an HTTP request to an admitted, routable request: auth, size, parse, model, quota, keys.

Every proxied route (`gateway.routes`) comes through here, its head and ids already read
(`gateway.request_head`). Only the fields routing needs are validated (`gateway.bodies`);
everything else is the worker's to judge and is forwarded untouched. A route with a prompt is
keyed by the normalizer; a pass-through route is sized from its body and routed on load alone.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from gateway.admitted import JSON_HEAD, Admitted
from gateway.auth import Tenant
from gateway.bodies import (
    asks_usage,
    encode_body,
    engine_priority,
    forced_usage,
    form_head,
    output_budget,
    parse_body,
    parse_form,
    streams,
    with_priority,
)
from gateway.errors import ApiError, echoed
from gateway.gate import Gate
from gateway.keying import canonical_prompt, keyed_apart, only_model, prompt_error, read_large_body
from gateway.pd_requests import unrunnable
from gateway.prompt_batch import batch_tokens
from gateway.quotas import Rejection, TenantLimiter
from gateway.rate_buckets import openai_rate_headers
from gateway.request_head import RequestHead, RequestIds
from gateway.responses_affinity import (
    mint_response_id,
    pin,
    unknown_previous,
    with_response_id,
)
from gateway.routes import ApiRoute
from gateway.upstream_headers import pick
from policies.base import RouteRequest
from policies.identity import session_key
from prompt_normalizer.errors import NormalizerError


class Refused(Exception):
    """`admit` refused a request whose body it had parsed: the error, and what the access line
    can say of the request by then (its route after `pick`, whether it streams, and its served
    model once known; a model the gateway does not serve is the client's string, never logged).
    Raised only on the way out, so the success path pays nothing for it; a body that does not
    parse raises its plain `ApiError`."""

    def __init__(self, error: ApiError, endpoint: str, stream: bool, model: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.endpoint = endpoint
        self.stream = stream
        self.model = model


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


def authenticate(head: RequestHead, gate: Gate) -> Tenant:
    """The tenant the request's key names; 401 without a known key, 400 when the key is sent
    twice (`RequestHead.repeated_key`)."""
    if head.repeated_key:
        raise ApiError(
            400,
            "send one API key: the request has more than one 'Authorization' (or 'x-api-key') header",
            "invalid_request_error",
            "invalid_api_key",
        )
    tenant = gate.keyring.lookup(head.authorization)
    if tenant is None:
        missing = not head.authorization
        message = (
            "missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>' on /v1/messages)"
            if missing
            else "incorrect API key provided"
        )
        raise ApiError(401, message, "invalid_request_error", "invalid_api_key")
    return tenant


def enter(head: RequestHead, gate: Gate, tenant: Tenant, now_s: float) -> None:
    """What the headers alone decide once the key is known (`authenticate`), before the body is
    read: 413 when `Content-Length` is already too large, 429 when the tenant is at its
    concurrency limit or out of requests. Otherwise the request takes one of its tenant's slots
    (`TenantLimiter.enter`), which its caller gives back unless `admit` hands it to the admitted
    request."""
    max_bytes = gate.limits.max_body_bytes
    if head.content_length is not None and head.content_length > max_bytes:
        raise _too_large(max_bytes)
    limiter = gate.limiters[tenant.name]
    rejection = limiter.enter(now_s)
    if rejection is not None:
        raise _quota_error(rejection, limiter, now_s)


async def admit(
    raw: bytes,
    api: ApiRoute,
    gate: Gate,
    ids: RequestIds,
    tenant: Tenant,
    started_s: float,
    head: RequestHead | None = None,
) -> Admitted:
    """Run every check that needs the body, in the order a client would expect: 400, 404, 429
    (tokens); the request already holds its tenant's slot (`enter`). `head` is needed for a
    multipart body (its boundary)."""
    request_id = ids.internal
    large = None
    apart = False  # a JSON body read (and keyed) in the keying process (`keyed_apart`)
    try:
        if api.multipart:
            content_type = head.content_type if head is not None else None
            body = parse_form(raw, content_type, api)
            encoded = raw
            upstream_head = form_head(content_type)
        else:
            apart = keyed_apart(raw)
            if apart:
                large = await read_large_body(raw, api, gate.keying, gate.models, tenant, gate.limits)
            if large is not None:
                api, body, encoded = large.api, large.body, large.encoded
            else:
                body = parse_body(raw, api, gate.limits.max_choices, gate.limits.max_pooling_inputs)
                if api.pick is not None:
                    api = api.pick(body)  # SageMaker's `/invocations`: admitted as the route its body names
                encoded = encode_body(body)
            upstream_head = JSON_HEAD
    except ApiError as err:
        # A body that does not parse may be compressed: say so rather than quote the parser
        # (looked for only here, so a request that parses pays nothing for it).
        raise _compressed(head) or err from None
    model = body.get("model") or only_model(gate.models)
    pool = gate.models.get(model)
    if pool is None:
        unknown = ApiError(
            404,
            f"The model '{echoed(model)}' does not exist",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
        raise Refused(unknown, api.endpoint, streams(body, api))
    try:
        max_out = output_budget(body, api.prompt, pool.windows.max_model_len.get(model), api.fanout)
    except ApiError as err:
        raise _refused(err, api, body, model) from None
    if (unserved := unrunnable(pool, api.pd_split, body)) is not None:
        raise _refused(unserved, api, body, model)
    keying = gate.keying
    identity, public = keying.identities(pool, model, tenant)
    normalizer = keying.normalizers[pool.name]
    if large is not None and large.model == model and large.prompt_error is not None:
        raise _refused(large.prompt_error, api, body, model)
    if large is not None and large.model == model and large.canonical is not None:
        canonical = large.canonical
    elif api.prompt is not None and normalizer.config.mode == "approximate" and not apart:
        try:  # the common case, right here: no coroutine of its own
            canonical = normalizer.canonicalize(api.prompt, body, identity, public)
        except NormalizerError as exc:
            raise _refused(prompt_error(exc), api, body, model) from None
    else:
        try:
            canonical = await canonical_prompt(
                api, raw, body, keying, pool, identity, public, request_id, tenant.name
            )
        except ApiError as err:
            raise _refused(err, api, body, model) from None

    responses = gate.responses if api.prompt == "responses" else None
    response_id = None
    if responses is not None:
        try:
            response_id = mint_response_id(responses, body, tenant.name)
        except ApiError as err:
            raise _refused(err, api, body, model) from None

    # A batch's prompts all count (the normalizer keyed the first), and what a read's items or
    # questions share counts once per read: in the quota and the load.
    n_tokens = batch_tokens(
        body, api.prompt, canonical.n_tokens, normalizer.config.chars_per_token, api.fanout, api.pooled
    )
    limiter = gate.limiters[tenant.name]
    rejection = limiter.admit(n_tokens, started_s)
    if rejection is not None:
        raise _refused(_quota_error(rejection, limiter, started_s), api, body, model)
    # After the token check, as a worker's 404 for an id nobody holds comes after it: another
    # tenant's id must read the same as an unknown one (`responses_affinity`).
    try:
        pinned = pin(responses, body, tenant.name, pool, started_s) if responses is not None else None
    except ApiError as err:
        raise _refused(err, api, body, model) from None

    # Only chat and completions bodies are rewritten: a Responses or Messages body is keyed as
    # the worker will convert it, and forwarded as sent (a Responses body with the gateway's
    # `request_id`, below).
    changed = canonical.canonical_body is not None and api.rewrites
    forward = dict(canonical.canonical_body) if changed and canonical.canonical_body is not None else body
    response_stem = None
    if response_id is not None:  # vLLM names the response after it (`responses_ids`)
        response_stem = body.get("request_id")  # the client's own, checked by `mint_response_id`
        forward, encoded = with_response_id(forward, encoded, response_id)
    stream = streams(body, api)
    options = body.get("stream_options")
    strip_usage = stream and api.rewrites and not asks_usage(options)
    if strip_usage:
        # Ask for usage anyway (the policy learns from cached_tokens) and strip it before the
        # client. Only the final usage: with `continuous_usage_stats` as well, vLLM would put
        # usage on every chunk, which the client did not ask for.
        forward["stream_options"] = forced_usage(options)
        changed = True
    client_priority: int = body.get("priority", 0)  # an int: `parse_body`
    # The client's `priority` orders only its tenant's requests in the gateway's queue
    # (`queueing`) and is never sent: the engines order every tenant's requests by it. The
    # routes that generate carry the tenant's own instead, when the pool's engines use one
    # (`ApiRoute.engine_priority`).
    sent = (
        engine_priority(client_priority, tenant.engine_priority, pool.config.priority_scheduling)
        if api.salted and api.engine_priority
        else None
    )
    forward, encoded = _with_engine_priority(forward, encoded, changed, body, sent)
    route = RouteRequest(
        request_id=request_id,
        pool=pool.name,
        tenant=tenant.name,
        namespace=identity.namespace,
        block_keys=canonical.block_keys,
        n_prompt_tokens=n_tokens,
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
        api=api,
        endpoint=api.endpoint,
        tenant=tenant,
        limiter=limiter,
        pool=pool,
        model=model,
        encoded=encoded,
        forward=forward,
        changed=changed,
        stream=stream,
        strip_usage=strip_usage,
        route=route,
        max_output_tokens=max_out,
        started_s=started_s,
        public_salt=gate.keyring.public_salt,
        head=upstream_head,
        pinned=pinned,
        find_previous=unknown_previous(body) if responses is not None and pinned is None else None,
        responses=responses,
        drift_field=drift.field if drift is not None and drift.first_diff_block is not None else None,
        retries_taken=ids.retries_taken,
        priority=client_priority,
        client_headers=pick(ids.headers, pool.forward) if pool.forward else (),
        response_stem=response_stem,
    )


def _with_engine_priority(
    forward: dict[str, Any], encoded: bytes, changed: bool, body: dict[str, Any], priority: int | None
) -> tuple[dict[str, Any], bytes]:
    """`forward` and `encoded` carrying the engine `priority` (None: no `priority` field) in place
    of the client's. Once `changed`, `forward` is sent and `encoded` is the client's body as
    parsed: both lose the client's field."""
    if not changed:
        return with_priority(forward, encoded, priority)
    forward = with_priority(forward, b"{}", priority)[0]
    if "priority" in body:
        encoded = with_priority(body, encoded, None)[1]
    return forward, encoded


def _compressed(head: RequestHead | None) -> ApiError | None:
    """415 for a body sent with a `Content-Encoding` (neither the gateway nor the engines
    decompress request bodies); None without one."""
    for name, value in head.raw if head is not None else ():
        if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            coding = value.decode("latin-1")[:64]
            message = f"request bodies are read as sent: Content-Encoding {coding!r} is not supported"
            return ApiError(415, message, "invalid_request_error", "unsupported_content_encoding")
    return None


def _refused(err: ApiError, api: ApiRoute, body: dict[str, Any], model: str) -> Refused:
    return Refused(err, api.endpoint, streams(body, api), model)


def _quota_error(rejection: Rejection, limiter: TenantLimiter, now_s: float) -> ApiError:
    if rejection.retryable:
        retry_after = max(1, int(rejection.retry_after_s + 0.999))
        headers = {
            "retry-after": str(retry_after),
            "retry-after-ms": str(int(rejection.retry_after_s * 1000)),
        }
    else:
        headers = {"x-should-retry": "false"}  # no wait makes it pass: no Retry-After to honour
    standings = limiter.standings(now_s)
    headers |= {name.decode(): value.decode() for name, value in openai_rate_headers(standings)}
    return ApiError(
        429,
        rejection.message,
        "rate_limit_error" if rejection.retryable else "insufficient_quota",
        rejection.code,
        None,
        headers,
        standings,
    )
