"""Responses state: which worker holds each stored response, and whose it is.

vLLM keeps stored responses in the serving process only, so a request with
`previous_response_id` (and `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`) must reach
the worker that answered the original request. The gateway learns that worker from the answer's
`id` (a whole answer's, or a stream's `response.created` event) and pins follow-ups to it.

Rules, all checked here:
- An id belongs to the tenant whose request created it. Another tenant's id is never routed by
  affinity: the gateway answers 404 itself, exactly as for an id it never saw routed, so a tenant
  learns nothing about another tenant's ids. A request may not name another tenant's response as
  its own `request_id` (vLLM makes it the new response's id): 400.
- The pinned worker is the only one tried (another worker cannot continue the conversation, so a
  retry elsewhere would silently lose its state). Unroutable now (down, breaker open, at its
  cap): 503 with Retry-After. Gone from the pool (discovery removed it): 404, the response is gone
  with it. A worker that restarted answers its own 404, passed through.
- An id the gateway does not know (evicted, expired, or from before a restart) is routed by the
  policy like any request; the worker that lacks it answers 404.

The map is bounded: at most `max_entries` ids (least recently used dropped first), each forgotten
`ttl_s` after its last use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.errors import ApiError, bad_request
from gateway.registry import Pool
from policies.base import RouteDecision, WorkerId, WorkerView
from policies.records import record

PINNED_REASON = "response_affinity"


@record
class Holder:
    """Where one stored response lives, and whose it is."""

    tenant: str
    pool: str
    worker: WorkerId
    used_s: float


class ResponseAffinity:
    """Response id → `Holder`, least recently used first. Invariant: at most `max_entries` ids."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, Holder] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def learn(self, response_id: str, tenant: str, pool: str, worker: WorkerId, now_s: float) -> None:
        """Remember that `worker` holds `response_id`, created by `tenant`. An id that is already
        another tenant's keeps its owner."""
        held = self._items.get(response_id)
        if held is not None and held.tenant != tenant and now_s - held.used_s <= self.ttl_s:
            return
        self._items[response_id] = Holder(tenant, pool, worker, now_s)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def holder(self, response_id: str, now_s: float) -> Holder | None:
        """The holder of `response_id` (its use refreshed), or None when unknown or expired."""
        held = self._items.get(response_id)
        if held is None:
            return None
        if now_s - held.used_s > self.ttl_s:
            del self._items[response_id]
            return None
        fresh = Holder(held.tenant, held.pool, held.worker, now_s)
        self._items[response_id] = fresh
        self._items.move_to_end(response_id)
        return fresh

    def check_invariants(self) -> None:
        assert len(self._items) <= self.max_entries
        times = [h.used_s for h in self._items.values()]
        assert times == sorted(times), "least recently used first"


def not_found(response_id: str, param: str) -> ApiError:
    """vLLM's answer for a response it does not hold (also the gateway's, for another tenant's)."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", None, param)


def pin(
    affinity: ResponseAffinity, body: Mapping[str, Any], tenant: str, pool: Pool, now_s: float
) -> WorkerId | None:
    """The worker a Responses request must reach (None: the policy chooses); 404 / 400 per the
    rules above."""
    own_id = body.get("request_id")
    if isinstance(own_id, str) and own_id:
        held = affinity.holder(own_id, now_s)
        if held is not None and held.tenant != tenant:
            raise bad_request("'request_id' names a response that is not yours", "request_id")
    previous = body.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        return None
    held = affinity.holder(previous, now_s)
    if held is None:
        return None
    if held.tenant != tenant or held.pool != pool.name or held.worker not in pool.workers:
        raise not_found(previous, "previous_response_id")
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
