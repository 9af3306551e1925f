"""Responses state: which worker holds each stored response, and whose it is.

vLLM keeps stored responses in the serving process only, so a request with
`previous_response_id` (and `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`) must reach
the worker that answered the original request. The gateway learns that worker from the answer's
`id` (a whole answer's, or a stream's `response.created` event) and pins follow-ups to it.

Rules, all checked here:
- Every `POST /v1/responses` carries a `request_id` the gateway mints (`responses_ids`: vLLM makes
  it the new response's id), tagged with its tenant and new for every request and for every
  attempt of one (a worker that failed may have stored its response all the same; both legs of a
  prefill/decode split are one attempt, whose id each new round renews): the client's
  own `request_id`, when it sent one, starts the id, and a client that sends one again gets
  another id, so one id is never stored on two workers. A client's `request_id` that is not at most
  `MAX_REQUEST_ID_CHARS` characters from `[A-Za-z0-9_.:-]` is refused with 400. Only an answer
  whose id is the one minted for it is remembered, so the map's bytes are bounded by its entry
  count.
- An id belongs to the tenant it was minted for, and any process tells so from the id alone
  (`ResponseIds.owned_by`). A follow-up, `GET` or `cancel` naming an id that is not the asking
  tenant's (another tenant's, made up, or not minted by the gateway) gets vLLM's own 404 for an
  unknown response (same status, body and `param`) without asking a worker.
- The map is consulted only for the tenant's own ids, and keeps each id's tenant too: a probe by
  another tenant never refreshes an id.
- The pinned worker is the only one tried (another worker cannot continue the conversation, so a
  retry elsewhere would silently lose its state). Unroutable now (down, breaker open, at its
  cap): 503 with Retry-After. Gone from the pool (discovery removed it): 404, the response is gone
  with it. A worker that restarted answers its own 404, passed through.
- A follow-up naming the tenant's own id that this process does not know (evicted, expired, from
  before a restart, or routed by another gateway process or replica) is pinned to the worker of
  its pool that holds it, the first of its healthy workers to answer 200 when asked in turn
  (`responses_follow_up.locate_previous`), and remembered; vLLM's 404 when every worker says it
  does not hold it. A `GET` or `cancel` of one asks the workers of the pool its id names (its
  scope: `responses_ids`), or of every pool for an id without one (`responses_routes`).
  Both look with the one search (`responses_search.find_holder`: who is asked, what a worker's
  answer proves, and its bounds in time).

The map is bounded: at most `max_entries` ids, each forgotten `ttl_s` after its last use. Each of
the `tenants` tenants is reserved an equal share, `max_entries // tenants` ids: when the map is
full, a tenant above its reserve loses its own least recently used id first, and otherwise a
tenant above its reserve pays. So a tenant within its reserve never loses an id to another
tenant's requests, while an idle tenant's reserve is still usable by the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import orjson

from gateway.errors import ApiError, bad_request, echoed
from gateway.failure import Failure, RetryReason
from gateway.registry import Pool
from gateway.responses_ids import MAX_REQUEST_ID_CHARS, MAX_RESPONSE_ID_CHARS, ResponseIds, valid_response_id
from gateway.worker import Worker
from policies.base import Outcome, RouteDecision, WorkerId, WorkerView
from policies.records import record

PINNED_REASON = "response_affinity"
# The headers a worker is asked with (name, value), as aiohttp takes them.


@record
class Holder:
    """Where one stored response lives, and whose it is."""

    tenant: str
    pool: str
    worker: WorkerId
    used_s: float


class ResponseAffinity:
    """Response id → `Holder`, and the deployment's `ids` (who owns an id). Invariants: at most
    `max_entries` ids; each tenant's ids are kept least recently used first, and `_all` holds
    every id in the order of its last use; `_over` holds exactly the tenants holding more than
    `reserve`."""

    def __init__(self, max_entries: int, ttl_s: float, tenants: int = 1, *, ids: ResponseIds) -> None:
        self.ids = ids
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.reserve = max(1, max_entries // max(1, tenants))
        self._items: dict[str, Holder] = {}
        self._lru: dict[str, OrderedDict[str, None]] = {}  # tenant -> its ids, oldest first
        self._all: OrderedDict[str, None] = OrderedDict()  # every id, oldest first
        self._over: dict[str, None] = {}  # tenants above their reserve, in the order they went over

    def __len__(self) -> int:
        return len(self._items)

    def held_by(self, tenant: str) -> int:
        """How many ids `tenant` holds."""
        lru = self._lru.get(tenant)
        return 0 if lru is None else len(lru)

    def learn(self, response_id: str, tenant: str, pool: str, worker: WorkerId, now_s: float) -> None:
        """Remember that `worker` holds `response_id`, created by `tenant`. An id that is already
        another tenant's keeps its owner; an id the gateway does not accept is not remembered."""
        if not valid_response_id(response_id):
            return
        if self._all:  # no earlier than the newest use (`holder`)
            now_s = max(now_s, self._items[next(reversed(self._all))].used_s)
        held = self._items.get(response_id)
        if held is not None:
            if held.tenant != tenant and now_s - held.used_s <= self.ttl_s:
                return
            self._drop(response_id)
        self._items[response_id] = Holder(tenant, pool, worker, now_s)
        self._all[response_id] = None
        lru = self._lru.setdefault(tenant, OrderedDict())
        lru[response_id] = None
        if len(lru) > self.reserve:
            self._over[tenant] = None
        if len(self._items) > self.max_entries:
            self._evict_for(tenant, now_s)

    def holder(self, response_id: str, tenant: str, now_s: float) -> Holder | None:
        """`tenant`'s holder of `response_id` (its use refreshed), or None when unknown, expired or
        another tenant's (then left as it is: a probe must not keep another tenant's id alive)."""
        held = self._items.get(response_id)
        if held is None or held.tenant != tenant:
            return None
        if now_s - held.used_s > self.ttl_s:
            self._drop(response_id)
            return None
        # A caller's clock may lag (admission pins with the request's start, and other requests'
        # ids were used since): the use is recorded no earlier than the newest, so that the order
        # of last use, which eviction and expiry read from its oldest end, and the times agree.
        newest_s = self._items[next(reversed(self._all))].used_s
        fresh = Holder(held.tenant, held.pool, held.worker, max(now_s, newest_s))
        self._items[response_id] = fresh
        self._lru[tenant].move_to_end(response_id)
        self._all.move_to_end(response_id)
        return fresh

    def _evict_for(self, tenant: str, now_s: float) -> None:
        """Make room after `tenant` added an id: the oldest id of all when it has expired (a quiet
        tenant's expired ids do not keep its reserve), else `tenant`'s own oldest when it is above
        its reserve, else the oldest of a tenant above its reserve. One exists whenever no more
        tenants hold ids than the reserve was divided among; otherwise `tenant` pays."""
        oldest = next(iter(self._all))
        if now_s - self._items[oldest].used_s > self.ttl_s:
            self._drop(oldest)
            return
        victim = tenant if tenant in self._over else next(iter(self._over), tenant)
        self._drop(next(iter(self._lru[victim])))

    def _drop(self, response_id: str) -> None:
        tenant = self._items.pop(response_id).tenant
        del self._all[response_id]
        lru = self._lru[tenant]
        del lru[response_id]
        if len(lru) <= self.reserve:
            self._over.pop(tenant, None)
        if not lru:
            del self._lru[tenant]

    def check_invariants(self) -> None:
        assert len(self._items) <= self.max_entries
        assert sum(len(lru) for lru in self._lru.values()) == len(self._items) == len(self._all)
        assert set(self._all) == set(self._items)
        for tenant, lru in self._lru.items():
            assert lru, "no empty tenant lists"
            holders = [self._items[rid] for rid in lru]
            assert all(h.tenant == tenant for h in holders)
            times = [h.used_s for h in holders]
            assert times == sorted(times), "least recently used first"
        assert set(self._over) == {t for t, lru in self._lru.items() if len(lru) > self.reserve}


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for a response it does not hold, byte for byte (also the gateway's, for an
    id that is not the asking tenant's: the two must read the same)."""
    # A valid id is quoted whole (byte for byte vLLM's); a longer string is no id anyone holds.
    quoted = echoed(response_id, MAX_RESPONSE_ID_CHARS)
    return ApiError(
        404, f"Response with id '{quoted}' not found.", "invalid_request_error", None, "response_id"
    )


def mint_response_id(affinity: ResponseAffinity, body: Mapping[str, Any], tenant: str) -> str:
    """The `request_id` the worker gets, which names the response it creates: minted for `tenant`
    on the client's own `request_id`, if any (400 unless at most `MAX_REQUEST_ID_CHARS`
    characters from the id alphabet)."""
    own_id, model = body.get("request_id"), _model(body)
    if own_id is None:
        return affinity.ids.mint(tenant, model=model)
    if isinstance(own_id, str) and len(own_id) > MAX_REQUEST_ID_CHARS:
        message = (
            f"Invalid 'request_id': string too long. Expected a string with maximum length "
            f"{MAX_REQUEST_ID_CHARS}, but got a string with length {len(own_id)} instead."
        )
        raise ApiError(400, message, "invalid_request_error", "string_above_max_length", "request_id")
    if not valid_response_id(own_id, MAX_REQUEST_ID_CHARS):
        raise bad_request(
            "'request_id' must be a non-empty string of letters, digits, '_', '-', '.' and ':'",
            "request_id",
        )
    return affinity.ids.mint(tenant, own_id, model)


def _model(body: Mapping[str, Any]) -> str | None:
    """The served model a Responses body names (admission found its pool by it): the scope of
    the id minted for it (`responses_ids`)."""
    model = body.get("model")
    return model if isinstance(model, str) else None


def with_response_id(body: dict[str, Any], encoded: bytes, response_id: str) -> tuple[dict[str, Any], bytes]:
    """`body` with `request_id` set to `response_id`, and its encoding (`encoded` is `body`'s): the
    field is put in front of the encoded object when the client sent none, so a large body is not
    encoded a second time."""
    named = {**body, "request_id": response_id}
    if "request_id" in body:
        return named, orjson.dumps(named)
    head = b'{"request_id":' + orjson.dumps(response_id)
    return named, head + (b"," + encoded[1:] if encoded != b"{}" else b"}")


def with_new_response_id(
    affinity: ResponseAffinity, body: dict[str, Any], encoded: bytes, tenant: str, own_id: str | None
) -> tuple[dict[str, Any], bytes]:
    """`body` (a Responses body naming the id minted for an earlier attempt, `encoded` its
    encoding) naming a new id minted for `tenant` on the client's own `request_id` `own_id`, and
    its encoding: the id's bytes are replaced where they are, so a large body is not encoded again
    (an id has no character JSON escapes, and inside a string the quotes around it would be
    escaped, so the first match is the field)."""
    old, new = body["request_id"], affinity.ids.mint(tenant, own_id, _model(body))
    named = {**body, "request_id": new}
    field = b'"request_id":' + orjson.dumps(old)
    at = encoded.find(field)
    if at < 0:
        return named, orjson.dumps(named)
    return named, encoded[:at] + b'"request_id":' + orjson.dumps(new) + encoded[at + len(field) :]


def pin(
    affinity: ResponseAffinity, body: Mapping[str, Any], tenant: str, pool: Pool, now_s: float
) -> WorkerId | None:
    """The worker a Responses follow-up must reach (None: the policy chooses), or vLLM's 404 when
    its `previous_response_id` is not `tenant`'s or its holder left the pool."""
    previous = body.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        return None
    if not affinity.ids.owned_by(previous, tenant):
        raise not_found(previous)
    held = affinity.holder(previous, tenant, now_s)
    if held is None:
        return None
    if held.pool != pool.name or held.worker not in pool.workers:
        raise not_found(previous)
    check_continuable(pool, pool.workers[held.worker])
    return held.worker


def check_continuable(pool: Pool, holder: Worker) -> None:
    """400 when a follow-up cannot be continued on `holder`, the worker of `pool` holding its
    `previous_response_id`: an SGLang decode server (`_DECODE_HOLDER`). The one rule for a holder
    this process knows (`pin`) and one it found (`responses_follow_up.locate_previous`)."""
    pd = pool.config.pd
    if pd is not None and pd.protocol == "sglang" and holder.role == "decode":
        raise bad_request(_DECODE_HOLDER, "previous_response_id")


# An SGLang decode server holds the responses it answered, and admits only requests whose KV a
# prefill server computes: a follow-up it alone could continue, it cannot run.
_DECODE_HOLDER = (
    "previous_response_id cannot be continued in this prefill/decode pool: the response is held by "
    "an SGLang decode server, which runs only requests prefilled elsewhere; send the conversation "
    "as input items instead"
)


def unknown_previous(body: Mapping[str, Any]) -> str | None:
    """The `previous_response_id` of a follow-up that `pin` let through unpinned: the tenant's own
    id whose holder this process does not know (None: not a follow-up)."""
    previous = body.get("previous_response_id")
    return previous if isinstance(previous, str) and previous else None


def pinned_decision(worker: WorkerId, views: Sequence[WorkerView]) -> RouteDecision | None:
    """The decision for a pinned request: its worker when it may take a request now, else None
    (the request then ends in 503: no other worker holds its state)."""
    for view in views:
        if view.worker_id == worker:
            cap = view.max_in_flight
            if view.healthy and (cap is None or view.in_flight_requests < cap):
                return RouteDecision(worker, 0.0, PINNED_REASON)
            return None
    return None


_HOLDER_UNAVAILABLE = "the worker holding the conversation (previous_response_id) is unavailable"
# An attempt that never reached the pinned worker: the worker is the problem, not the answer.
_UNREACHED = (RetryReason.CONNECT_ERROR, RetryReason.WORKER_BUSY, RetryReason.CONNECTION_LOST)


def holder_unavailable(failure: Failure | None) -> Failure:
    """Why a pinned follow-up ended without an answer, told as what it is: the one worker that
    can continue the conversation is down, unhealthy or full (a generic "no healthy worker" would
    read as a pool outage while the pool's other workers are fine). `failure` is the pinned
    worker's last attempt's, None when it was not routable; status and code stay as they are."""
    if failure is None:
        message = f"{_HOLDER_UNAVAILABLE} (unhealthy or at its capacity); no other worker holds its state"
        return Failure(503, message, "no_worker_available", Outcome.ABORTED, param="previous_response_id")
    if failure.retry in _UNREACHED:
        message = f"{_HOLDER_UNAVAILABLE}: {failure.message}"
        return replace(failure, message=message, param="previous_response_id")
    return failure


def note_response(
    affinity: ResponseAffinity,
    body: Mapping[str, Any],
    tenant: str,
    pool: str,
    worker: WorkerId,
    answer_id: Any,
    now_s: float,
) -> None:
    """Learn the worker of a response the worker just created, when its id is the one minted for
    the attempt it answered (`body` is the body that attempt sent, with that `request_id`) and
    the request did not ask not to store it (then there is nothing to find later)."""
    if answer_id == body.get("request_id") and body.get("store") is not False:
        affinity.learn(answer_id, tenant, pool, worker, now_s)
