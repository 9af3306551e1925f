"""The process's budget for worker answers held whole in memory, and each tenant's share of it.

A non-streamed answer is read into memory before it is relayed, each bounded by
`upstream_conn.MAX_ANSWER_BYTES`. That bound is per answer: N whole answers in flight could
hold N times it. The budget bounds their sum. Every byte of a whole answer is reserved as it
arrives, in the answer's `Reservation`, and released once: when an answer passed on as it came
has been written to its client (`answer_write.HeldResponse`), or the request ends any other way
(an error, a timeout, the client leaving, the gateway's drain). Answers the gateway reads for
itself or passes on in another form (render, a P/D pool's prefill and whole decode answers, a
stored response) are released when they have been read. A read that would take the total past
`capacity_bytes` ends at once (`AnswerBudgetExceeded`), and the client gets 503
`gateway_overloaded` with `Retry-After` (`failure.failure_of`). That is the gateway's own limit,
so the worker's breaker is not told.

A request's answer is reserved through its tenant's `TenantShare`: a tenant holds at most
`capacity × its weight / the sum of all tenants' weights` (the `weight` that also orders the
pools' queues), and never less than one answer at the per-answer cap (`min_share_bytes`), so a
small tenant can still be sent the largest answer the gateway reads. Past its share, its next
answer gets the same 503, naming the share, while the other tenants' answers are served: one
tenant sending many large answers (float embeddings of big batches) fills only its own share
(DESIGN.md, "Untrusted clients"). Shares are fixed, not lent out while other tenants are idle: a
reservation cannot be taken back, so bytes lent to one tenant would not be there when another
arrives. With one tenant (or a budget made without weights) the share is the whole budget.

Reserving never waits: an answer that waited for budget would keep its worker's connection
and the client's request open while the answers ahead of it, which may be as slow as their
worker's total timeout, finish; failing fast bounds both the memory and the wait.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway.metrics.families import CounterChild


class AnswerBudget:
    """Bytes of whole answers held (read, or being read, and not yet written), across the
    process. Invariant:
    `0 <= held_bytes <= capacity_bytes`; each reader releases exactly what it reserved.
    Reading through `share(tenant)` also bounds the tenant's own sum."""

    __slots__ = (
        "_min_share",
        "_share_refusals",
        "_shares",
        "_total_weight",
        "_weights",
        "capacity_bytes",
        "held_bytes",
        "refusals",
    )

    def __init__(
        self,
        capacity_bytes: int,
        refusals: CounterChild | None = None,
        weights: Mapping[str, float] | None = None,
        min_share_bytes: int = 0,
        share_refusals: Callable[[str], CounterChild] | None = None,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        # `kvgate_answer_budget_refusals_total`; a budget made without metrics counts for itself.
        self.refusals = refusals if refusals is not None else CounterChild()
        self._weights = dict(weights or {})
        self._total_weight = sum(self._weights.values())
        self._min_share = min_share_bytes
        # `kvgate_answer_share_refusals_total{tenant}`: refusals at a share, apart from the budget's.
        self._share_refusals = share_refusals
        # One per tenant that has read an answer: tenants come from the config, so this is bounded.
        self._shares: dict[str, TenantShare] = {}

    def reserve(self, size: int) -> bool:
        """Take `size` more bytes; False (and nothing taken) when they would pass the budget."""
        held = self.held_bytes + size
        if held > self.capacity_bytes:
            self.refusals.inc()
            return False
        self.held_bytes = held
        return True

    def release(self, size: int) -> None:
        """Give back `size` bytes a reader had reserved."""
        self.held_bytes -= size
        assert self.held_bytes >= 0, "an answer budget released more than it reserved"

    def share(self, tenant: str) -> TenantShare:
        """The tenant's share, to reserve its answers through (one dict lookup)."""
        found = self._shares.get(tenant)
        if found is None:
            refusals = self._share_refusals(tenant) if self._share_refusals is not None else CounterChild()
            found = self._shares[tenant] = TenantShare(self, self.share_bytes(tenant), refusals)
        return found

    def share_bytes(self, tenant: str) -> int:
        """The most the tenant may hold: its weight's part of the capacity, at least
        `min_share_bytes`, at most the capacity (a tenant missing from the weights weighs 1)."""
        if not self._weights:
            return self.capacity_bytes
        weight = self._weights.get(tenant, 1.0)
        total = self._total_weight if tenant in self._weights else self._total_weight + weight
        part = int(self.capacity_bytes * weight / total)
        return min(self.capacity_bytes, max(part, self._min_share))

    def held_by(self, tenant: str) -> int:
        """Bytes the tenant's answers hold now (0 for a tenant that never read one)."""
        found = self._shares.get(tenant)
        return found.held_bytes if found is not None else 0


class TenantShare:
    """One tenant's part of an `AnswerBudget`, reserved and released like the budget itself.
    Invariant: `0 <= held_bytes <= share_bytes`, and every byte held here is held in the budget."""

    __slots__ = ("budget", "held_bytes", "refusals", "share_bytes")

    def __init__(self, budget: AnswerBudget, share_bytes: int, refusals: CounterChild | None = None) -> None:
        self.budget = budget
        self.share_bytes = share_bytes
        self.held_bytes = 0
        self.refusals = refusals if refusals is not None else CounterChild()

    def reserve(self, size: int) -> bool:
        """Take `size` more bytes from the share and the budget; False (nothing taken) when
        either would be passed."""
        held = self.held_bytes + size
        if self.full_for(size):
            self.refusals.inc()  # the tenant's limit, counted apart from the process's
            return False
        if not self.budget.reserve(size):
            return False
        self.held_bytes = held
        return True

    def release(self, size: int) -> None:
        self.held_bytes -= size
        assert self.held_bytes >= 0, "a tenant's answer share released more than it reserved"
        self.budget.release(size)

    def full_for(self, size: int) -> bool:
        """Whether `size` more bytes would pass the share itself, a share smaller than the budget
        (a share of the whole budget is the budget's own limit)."""
        return self.held_bytes + size > self.share_bytes and self.share_bytes < self.budget.capacity_bytes


class Reservation:
    """One answer's bytes, reserved from `hold` while it is read and kept until its owner
    releases them. Ownership passes along with the answer (connection, reply, response); whoever
    holds it last calls `release`, which gives the bytes back once (later calls do nothing), so
    every path that ends a request may call it without counting twice."""

    __slots__ = ("hold", "size")

    def __init__(self, hold: AnswerHold) -> None:
        self.hold = hold
        self.size = 0

    def take(self, size: int) -> bool:
        """Reserve `size` more bytes; False (nothing taken) past the budget or the share."""
        if not self.hold.reserve(size):
            return False
        self.size += size
        return True

    def release(self) -> None:
        if self.size:
            self.hold.release(self.size)
            self.size = 0


# What a whole answer's bytes are reserved from: a request's tenant share, or the process's
# budget alone for reads on no tenant's behalf.
AnswerHold = AnswerBudget | TenantShare
