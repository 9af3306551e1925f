"""Per-tenant admission control: concurrency caps and rpm / tpm token buckets.

A request's life in its tenant's limiter: `enter` takes a concurrency slot and one request of the
rpm bucket from the headers alone (before the body is read, so a tenant's slow bodies hold only
its own slots), `admit` charges the prompt estimate once the body is parsed, `leave` gives the
slot back when the request is refused before that; at the end `reconcile` corrects the prompt
charge to the worker's own count and `release` gives the slot back and charges the completion
tokens.

A request counts against rpm whatever becomes of it: one the gateway refuses after reading and
parsing its body (a 400, a 404, a 429 for tokens) cost that work all the same. Charged only on
admission, such requests were free: a tenant at `rpm: 60` could send hundreds a second of 256 KiB
bodies that fail at their last message, each parsed and keyed on the event loop.

Buckets hold one minute of budget and refill continuously. The end-of-request charges may take a
bucket below zero, which delays the tenant's next requests instead of failing this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import QuotaConfig


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was not admitted. `retryable` is False when waiting cannot help."""

    message: str
    retry_after_s: float
    retryable: bool
    code: str


class TokenBucket:
    """`capacity` units, refilled at `capacity / 60` per second."""

    __slots__ = ("_level", "_rate_per_s", "_stamp_s", "capacity")

    def __init__(self, capacity: int, now_s: float) -> None:
        self.capacity = float(capacity)
        self._rate_per_s = capacity / 60.0
        self._level = float(capacity)
        self._stamp_s = now_s

    def _refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self._stamp_s)
        self._level = min(self.capacity, self._level + elapsed * self._rate_per_s)
        self._stamp_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until `amount` is available (0 if it is now; inf if it never fits)."""
        self._refill(now_s)
        if amount > self.capacity:
            return math.inf
        missing = amount - self._level
        return 0.0 if missing <= 0 else missing / self._rate_per_s

    def take(self, amount: float, now_s: float) -> None:
        """Spend `amount` (a negative amount gives back, up to the capacity)."""
        self._refill(now_s)
        self._level = min(self.capacity, self._level - amount)


class TenantLimiter:
    """The quota state of one tenant."""

    def __init__(self, quotas: QuotaConfig, now_s: float) -> None:
        self._max_concurrent = quotas.max_concurrent
        self._rpm = TokenBucket(quotas.rpm, now_s) if quotas.rpm else None
        self._tpm = TokenBucket(quotas.tpm, now_s) if quotas.tpm else None
        self.in_flight = 0

    def _too_many(self) -> Rejection:
        return Rejection(
            f"too many concurrent requests (limit {self._max_concurrent})", 1.0, True, "rate_limit_exceeded"
        )

    def enter(self, now_s: float) -> Rejection | None:
        """Take one concurrency slot and one request of the rpm bucket for a request whose body
        is still to be read, or say why not (at the concurrency limit, or no request left in the
        rpm bucket: refused before the gateway reads or parses anything, and charged nothing).
        The caller gives the slot back with `leave` unless the request is admitted, and then with
        `release`; the request stays charged."""
        if self._max_concurrent is not None and self.in_flight >= self._max_concurrent:
            return self._too_many()
        if self._rpm is not None:
            wait = self._rpm.wait_s(1, now_s)
            if wait > 0:
                return _spent("requests per minute", wait)
            self._rpm.take(1, now_s)
        self.in_flight += 1
        return None

    def leave(self) -> None:
        """Give back the slot of a request that was refused or abandoned before admission."""
        self.in_flight -= 1

    def admit(self, prompt_tokens: int, now_s: float) -> Rejection | None:
        """Charge the estimated `prompt_tokens` of a request that holds a slot (`enter`), or say
        why not (the slot stays taken: the caller leaves)."""
        if self._tpm is not None:
            wait = self._tpm.wait_s(prompt_tokens, now_s)
            if math.isinf(wait):
                return Rejection(
                    f"request needs about {prompt_tokens} tokens, more than the tenant's tpm quota "
                    f"({int(self._tpm.capacity)})",
                    60.0,
                    False,
                    "insufficient_quota",
                )
            if wait > 0:
                return _spent("tokens per minute", wait)
            self._tpm.take(prompt_tokens, now_s)
        return None

    def reconcile(self, estimated_tokens: int, prompt_tokens: int | None, now_s: float) -> None:
        """Correct a finished request's prompt charge from the estimate taken at admission to the
        worker's count (`usage.prompt_tokens`); without a count the estimate stands."""
        if self._tpm is not None and prompt_tokens is not None and prompt_tokens != estimated_tokens:
            self._tpm.take(prompt_tokens - estimated_tokens, now_s)

    def release(self, completion_tokens: int, now_s: float) -> None:
        """The end of an admitted request: its slot comes back, its completion tokens are charged."""
        self.in_flight -= 1
        if self._tpm is not None and completion_tokens > 0:
            self._tpm.take(completion_tokens, now_s)


def _spent(what: str, wait_s: float) -> Rejection:
    # A quota that refills within the SDK's retry window (60 s) is worth retrying; beyond it the
    # SDK would ignore Retry-After anyway, so we tell it not to retry at all.
    retryable = wait_s <= 60.0
    code = "rate_limit_exceeded" if retryable else "insufficient_quota"
    return Rejection(f"{what} quota spent; retry in {math.ceil(wait_s)} s", wait_s, retryable, code)
