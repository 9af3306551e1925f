"""The process's budget for worker answers held whole in memory.

A non-streamed answer is read into memory before it is relayed, each bounded by
`upstream_conn.MAX_ANSWER_BYTES`. That bound is per answer: N whole answers in flight could
hold N times it. The budget bounds their sum. Every byte of a whole answer is reserved as it
arrives and released once, when the answer has been read and joined, or its read ends any
other way (error, timeout, the client leaving); a read that would take the total past
`capacity_bytes` ends at once (`AnswerBudgetExceeded`), and the client gets 503
`gateway_overloaded` with `Retry-After` (`failure.failure_of`). That is the gateway's own
limit, so the worker's breaker is not told.

Reserving never waits: an answer that waited for budget would keep its worker's connection
and the client's request open while the answers ahead of it, which may be as slow as their
worker's total timeout, finish; failing fast bounds both the memory and the wait.
"""

from __future__ import annotations

from gateway.metrics.families import CounterChild


class AnswerBudget:
    """Bytes of whole answers being read, across the process. Invariant:
    `0 <= held_bytes <= capacity_bytes`; each reader releases exactly what it reserved."""

    __slots__ = ("capacity_bytes", "held_bytes", "refusals")

    def __init__(self, capacity_bytes: int, refusals: CounterChild | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        # `kvgate_answer_budget_refusals_total`; a budget made without metrics counts for itself.
        self.refusals = refusals if refusals is not None else CounterChild()

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
