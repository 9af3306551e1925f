"""One retry budget per client call, and what an answer tells the client about retrying.

The gateway retries a failed attempt on the next-best worker itself (`proxy.py`). The OpenAI and
Anthropic SDKs retry as well (two more tries by default, on 408, 409, 429, 5xx and connection
errors), so left alone the two multiply: with two failing workers and `retry_attempts: 2`, one SDK
call made six worker POSTs. A client call therefore has one budget, `1 + retry_attempts` worker
attempts, and the gateway spends it:

- The SDKs number their tries (`x-stainless-retry-count`: 0 on the first, 1 on the first retry).
  Every earlier try of the same call made at most one worker attempt (a try that made more said
  not to retry, below), so a try may make `budget - retries_taken` attempts, and always at least one.
- An error answer that follows a worker attempt carries `x-should-retry: false`, which the SDKs
  obey, when the gateway retried or the call's budget is spent. After a single attempt with budget
  left (a pool with one routable worker, a worker's 429) the SDK may retry, and that try counts.
- An answer where no worker was tried (no routable worker, a queue timeout, the gateway's own
  limits) never forbids a retry: retrying it sends nothing twice.
- Nor does a worker's 503 when every attempt of the try got one (`Failure.says_whether_to_retry`):
  the workers asked to be retried later, after their `Retry-After`, having spent nothing on the
  request. An answer too large is never retried.

What the client says here cuts the gateway's attempts, so it must not decide a worker's verdict:
a try cut to one attempt compares a worker's 5xx or read timeout with no other worker, and such a
lone failure counts against no worker (`outcome.HeldVerdicts`), else one tenant's requests that
every worker fails would open the breakers of the pool's workers one after another.

A worker's own `Retry-After` and `retry-after-ms` (an overloaded worker's advice) are forwarded
when they are plain numbers; anything else (a date, garbage) is dropped rather than relayed.
"""

from __future__ import annotations

import re

RETRY_COUNT_HEADER = b"x-stainless-retry-count"
# A retry count above this is not an SDK's; it cannot lower the budget further anyway.
MAX_RETRIES_TAKEN = 100
_SHOULD_NOT_RETRY = (b"x-should-retry", b"false")
_NUMBER = {
    b"retry-after": re.compile(rb"[0-9]{1,7}"),
    b"retry-after-ms": re.compile(rb"[0-9]{1,10}(\.[0-9]{1,3})?"),
}


def retries_taken(value: bytes) -> int:
    """The client's `x-stainless-retry-count` (0 when it is not a small integer)."""
    return min(int(value), MAX_RETRIES_TAKEN) if value.isdigit() and len(value) <= 3 else 0


def attempts_allowed(retry_attempts: int, taken: int) -> int:
    """Worker attempts this try of a client call may make (`retry_attempts` is the pool's)."""
    return max(1, 1 + retry_attempts - taken)


def advice(attempts_made: int, retry_attempts: int, taken: int) -> list[tuple[bytes, bytes]]:
    """The `x-should-retry` header of an error answer after `attempts_made` worker attempts."""
    if attempts_made >= 2 or (attempts_made >= 1 and taken + attempts_made >= 1 + retry_attempts):
        return [_SHOULD_NOT_RETRY]
    return []


def forwardable(hints: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """A worker's `Retry-After` / `retry-after-ms` (lower-case names) that may reach the client."""
    out = []
    for name, value in hints:
        pattern = _NUMBER.get(name)
        stripped = value.strip()
        if pattern is not None and pattern.fullmatch(stripped):
            out.append((name, stripped))
    return out
