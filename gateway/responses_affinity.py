"""Responses state: which worker holds each stored response, and whose it is.

vLLM keeps stored responses in the serving process only, so a request with
`previous_response_id` (and `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`) must reach
the worker that answered the original request. The gateway learns that worker from the answer's
`id` (a whole answer's, or a stream's `response.created` event) and pins follow-ups to it.

Rules, all checked here:
- An id is at most `MAX_RESPONSE_ID_CHARS` characters from `[A-Za-z0-9_.:-]` (vLLM's own are
  `resp_` and 32 hex digits). A client's `request_id` (vLLM makes it the new response's id) that is
  not is refused with 400; an answer's id that is not is never remembered. The map's bytes are
  therefore bounded by its entry count.
- An id belongs to the tenant whose request created it, and only that tenant's requests see it:
  another tenant's id reads as one the gateway does not know, and looking it up does not refresh
  it. Followed up by another tenant, the gateway answers vLLM's own 404 for an unknown response
  (same status, body and `param`) without asking a worker. A request may not name another
  tenant's live response as its own `request_id` (the worker holding it would overwrite it): 400.
- The pinned worker is the only one tried (another worker cannot continue the conversation, so a
  retry elsewhere would silently lose its state). Unroutable now (down, breaker open, at its
  cap): 503 with Retry-After. Gone from the pool (discovery removed it): 404, the response is gone
  with it. A worker that restarted answers its own 404, passed through.
- An id the gateway does not know (evicted, expired, from before a restart, or routed by another
  gateway process) is routed by the policy like any request; the worker that lacks it answers 404.

The map is bounded: at most `max_entries` ids, each forgotten `ttl_s` after its last use. Each of
the `tenants` tenants is reserved an equal share, `max_entries // tenants` ids: when the map is
full, a tenant above its reserve loses its own least recently used id first, and otherwise a
tenant above its reserve pays. So a tenant within its reserve never loses an id to another
tenant's requests, while an idle tenant's reserve is still usable by the others.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.errors import ApiError, bad_request
from gateway.failure import Failure, RetryReason
from gateway.registry import Pool
from policies.base import Outcome, RouteDecision, WorkerId, WorkerView
from policies.records import record

PINNED_REASON = "response_affinity"

# vLLM's ids are 37 characters; this leaves room for a client's own scheme (UUIDs, prefixes)
# while keeping 100,000 remembered ids within a few tens of megabytes.
MAX_RESPONSE_ID_CHARS = 256
_ID_CHARS = re.compile(r"[A-Za-z0-9_.:-]+")


def valid_response_id(value: object) -> bool:
    """Whether `value` is an id the gateway accepts and remembers (see the module rules)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_RESPONSE_ID_CHARS
        and _ID_CHARS.fullmatch(value) is not None
    )


@record
class Holder:
    """Where one stored response lives, and whose it is."""

    tenant: str
    pool: str
    worker: WorkerId
    used_s: float


class ResponseAffinity:
    """Response id → `Holder`. Invariants: at most `max_entries` ids; each tenant's ids are kept
    least recently used first, and `_all` holds every id in the order of its last use; `_over`
    holds exactly the tenants holding more than `reserve`."""

    def __init__(self, max_entries: int, ttl_s: float, tenants: int = 1) -> None:
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
        fresh = Holder(held.tenant, held.pool, held.worker, now_s)
        self._items[response_id] = fresh
        self._lru[tenant].move_to_end(response_id)
        self._all.move_to_end(response_id)
        return fresh

    def taken_by_another(self, response_id: str, tenant: str, now_s: float) -> bool:
        """Whether `response_id` is another tenant's live id (nothing is refreshed)."""
        held = self._items.get(response_id)
        return held is not None and held.tenant != tenant and now_s - held.used_s <= self.ttl_s

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
    """vLLM's answer for a response it does not hold, byte for byte (also the gateway's, for
    another tenant's id: the two must read the same)."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", None, "response_id"
    )


def check_request_id(affinity: ResponseAffinity, body: Mapping[str, Any], tenant: str, now_s: float) -> None:
    """A client's `request_id` names the response vLLM creates: 400 unless it is an id the
    gateway accepts that is not another tenant's live response."""
    if "request_id" not in body or body["request_id"] is None:
        return
    own_id = body["request_id"]
    if isinstance(own_id, str) and len(own_id) > MAX_RESPONSE_ID_CHARS:
        message = (
            f"Invalid 'request_id': string too long. Expected a string with maximum length "
            f"{MAX_RESPONSE_ID_CHARS}, but got a string with length {len(own_id)} instead."
        )
        raise ApiError(400, message, "invalid_request_error", "string_above_max_length", "request_id")
    if not valid_response_id(own_id):
        raise bad_request(
            "'request_id' must be a non-empty string of letters, digits, '_', '-', '.' and ':'",
            "request_id",
        )
    if affinity.taken_by_another(own_id, tenant, now_s):
        raise bad_request("'request_id' is already in use", "request_id")


def pin(
    affinity: ResponseAffinity, body: Mapping[str, Any], tenant: str, pool: Pool, now_s: float
) -> WorkerId | None:
    """The worker a Responses follow-up must reach (None: the policy chooses), or vLLM's 404 when
    its `previous_response_id` is another tenant's or its holder left the pool."""
    previous = body.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        return None
    held = affinity.holder(previous, tenant, now_s)
    if held is None:
        if affinity.taken_by_another(previous, tenant, now_s):
            raise not_found(previous)
        return None
    if held.pool != pool.name or held.worker not in pool.workers:
        raise not_found(previous)
    return held.worker


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
    """Learn the worker of a response the worker just created (unless the request asked it not to
    store it: then there is nothing to find later)."""
    if isinstance(answer_id, str) and answer_id and body.get("store") is not False:
        affinity.learn(answer_id, tenant, pool, worker, now_s)
