"""`Admitted`: a request admission let through, with everything the rest of its path reads (its
bodies for each worker, its route request, its tenant and pool); `admission.admit` builds it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.anthropic import rate_headers
from gateway.auth import Tenant
from gateway.errors import ApiError, RawResponse, withhold_salts
from gateway.quotas import TenantLimiter
from gateway.rate_buckets import openai_rate_headers
from gateway.registry import Pool
from gateway.responses_affinity import ResponseAffinity, note_response, with_new_response_id
from gateway.routes import ApiRoute
from gateway.upstream_headers import ClientHeaders
from policies.base import RouteDecision, RouteRequest, WorkerId
from policies.identity import cache_salt_for

# The bytes that start the headers of every JSON request to a worker (the request id follows).
JSON_HEAD = b"Content-Type: application/json\r\nX-Request-Id: "


@dataclass(slots=True)
class Admitted:
    """A request that passed every check and holds a quota slot, released exactly once by
    `outcome.record_request` (which sets `recorded`).

    `forward` is the body to send upstream (the canonical body when the normalizer changed it) and
    `encoded` the client's body as the gateway re-encoded it at parse time (without any client
    `cache_salt`; a multipart body as the client sent it), reused when nothing else needs
    changing. Neither holds the client's `priority`: the routes that generate carry their
    tenant's engine priority instead when the pool's engines schedule by one
    (`bodies.engine_priority`). `max_output_tokens` is the output budget as it counts in the
    worker's load (`bodies.output_budget`). `head` starts the headers sent to the worker (its
    request id follows). `pinned` is the worker a Responses follow-up must reach (the one holding
    `previous_response_id`);
    `find_previous` is that id when it is the tenant's own but this process does not know its
    holder (another process or replica routed it, or this one restarted): the holder is looked
    for before the request is routed (`responses_search.find_holder`).
    """

    request_id: str
    client_request_id: str | None
    api: ApiRoute
    endpoint: str  # the route's label in metrics, logs and spans
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
    head: bytes = JSON_HEAD
    pinned: WorkerId | None = None
    find_previous: str | None = None
    responses: ResponseAffinity | None = None  # Responses requests: where answers' ids are learned
    drift_field: str | None = None
    retries_taken: int = 0  # the client's earlier tries of this call (`retries.py`)
    priority: int = 0  # the client's `priority` (lower first): orders the tenant's own queued requests
    queued_s: float | None = None  # time spent in the pool's queue (`queueing.py`), if it queued
    held_s: float | None = None  # how long the policy had it held before deciding (`SupportsHold`)
    client_headers: ClientHeaders = ()  # the client headers the pool forwards (`upstream_headers.py`)
    response_stem: str | None = None  # a Responses request's own `request_id`, which its ids start with
    recorded: bool = False
    dispatched: bool = False  # an attempt was started (`attempt_started`)
    _encoded: dict[str | None, bytes] = field(default_factory=dict)

    def attempt_started(self, own_body: bool) -> None:
        """An attempt at this request starts (`outcome.Attempt`). Each attempt of a Responses
        request but the first sends a new `request_id` (`renew_response_id`). An attempt with a
        body of its own (a P/D leg, built from `forward`) keeps the id that body names: its round
        renewed the id before building its legs."""
        if not own_body:
            self.renew_response_id()
        self.dispatched = True

    def renew_response_id(self) -> None:
        """Before a dispatch whose body is built from `forward`: a Responses request already sent
        to a worker gets a new `request_id` (in `forward` and `encoded` from now on, so `body_for`
        and `learn_response` use it): a worker that failed may have stored the response it was
        asked for all the same, and one id must never be held by two workers (`responses_ids`).
        A P/D round calls it once, before it builds its legs' bodies (`pd_pairs`): both legs of a
        round name one id (SGLang's two legs are one request to its engine) and each round a new
        one."""
        if self.responses is not None and self.dispatched:
            self.forward, self.encoded = with_new_response_id(
                self.responses, self.forward, self.encoded, self.tenant.name, self.response_stem
            )
            self._encoded.clear()

    def learn_response(self, worker: WorkerId, answer_id: Any) -> None:
        """A Responses answer came from `worker`: follow-ups naming its id will go there."""
        if self.responses is not None:
            note_response(
                self.responses,
                self.forward,
                self.tenant.name,
                self.pool.name,
                worker,
                answer_id,
                time.monotonic(),
            )

    @property
    def reply_id(self) -> str:
        """The `x-request-id` sent back to the client."""
        return self.client_request_id if self.client_request_id is not None else self.request_id

    def reply_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers every answer to this request carries: `x-request-id`, and the tenant's
        rate limits as they stand now (`TenantLimiter.standings`), in its route's headers:
        Anthropic's on the Messages routes, with the id in `request-id` too; OpenAI's elsewhere."""
        reply_id = self.reply_id.encode()
        if self.api.dialect.name == "anthropic":
            # Where the Anthropic SDKs read the id.
            return [(b"x-request-id", reply_id), (b"request-id", reply_id), *self._rate_headers()]
        return [(b"x-request-id", reply_id), *self._rate_headers()]

    def error_response(self, err: ApiError) -> RawResponse:
        """The gateway's own error for this request, in its route's dialect, with the tenant's rate
        limits as they stand now: an error after admission also tells the client its quota."""
        response = self.api.dialect.error_response(err, self.reply_id)
        response.headers += self._rate_headers()
        return response

    def _rate_headers(self) -> list[tuple[bytes, bytes]]:
        """The tenant's rate limits now, as the route's API writes them: Anthropic's
        `anthropic-ratelimit-*` on the Messages routes (an Anthropic client reads no other),
        OpenAI's `x-ratelimit-*` elsewhere."""
        standings = self.limiter.standings(time.monotonic())
        if not standings:
            return []
        if self.api.dialect.name == "anthropic":
            return rate_headers(standings, time.time())
        return openai_rate_headers(standings)

    def body_for(self, decision: RouteDecision) -> bytes:
        """The bytes for one dispatch, always with the gateway's own `cache_salt` (in the route's
        `salt_field`; a client's is replaced): the tenant's salt, or the public salt when the
        whole prompt lies inside the promoted public prefix the policy routed (vLLM's salt covers
        a request's entire chain, so any private token after the public prefix must keep the
        tenant's salt). Routes whose requests have no salt field get the client's body as
        encoded."""
        if not self.api.salted:
            return self.encoded
        salt = cache_salt_for(
            self.route, decision.shared_prefix_blocks, self.tenant.cache_salt, self.public_salt
        )
        cached = self._encoded.get(salt)
        if cached is not None:
            return cached
        field = self.api.salt_field
        # The salt goes first: a worker's error that quotes the request and is cut short (by the
        # worker or by the gateway's bound on a relayed message) then keeps the whole salt, which
        # is withheld, never a piece of it past a long prompt.
        # `forward` and `encoded` never hold a salt key (`bodies.encode_body` drops the client's).
        rest = orjson.dumps(self.forward) if self.changed else self.encoded
        head = b'{"' + field.encode() + b'":' + orjson.dumps(salt)
        out = head + (b"," + rest[1:] if len(rest) > 2 else b"}")
        self._encoded[salt] = out
        return out

    def withhold_salts(self, text: bytes) -> bytes:
        """`text`, a worker's error about this request as the client would get it, without the
        salts the request's bodies may have carried (`body_for`: the tenant's or the public
        one): a worker's error may quote the request (vLLM's validation errors do)."""
        return withhold_salts(text, (self.tenant.cache_salt, self.public_salt))
