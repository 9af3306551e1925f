"""A tenant's rate buckets (`TokenBucket`: a minute's budget, refilled continuously, and how a
peer's late charges are taken, `late_weight`) and how an answer tells where they stand
(`Standing`, OpenAI's `x-ratelimit-*` headers). The limits that use them are
`gateway.quotas.TenantLimiter`'s."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Unit = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class Standing:
    """Where one of a tenant's buckets stands, what an answer's rate-limit headers say of it:
    `unit` names the bucket (`requests`: the rpm, `tokens`: the tpm), `limit` is its capacity,
    `remaining` the whole units left (never below 0, though the bucket may be), `full_in_s` the
    seconds until it is full again. Each API writes it in its own headers: OpenAI's
    `x-ratelimit-*` (`openai_rate_headers`), Anthropic's `anthropic-ratelimit-*`
    (`anthropic.rate_headers`)."""

    unit: Unit
    limit: int
    remaining: int
    full_in_s: float


# The time a bucket takes to refill from empty: its capacity is a minute's budget.
BUCKET_WINDOW_S = 60.0


def late_weight(late_s: float) -> float:
    """The most a peer's charge that reaches this gateway `late_s` seconds after it was told
    counts for, as a share of its amount: 1 on time, falling evenly to 0 a bucket's window late.

    Taken on time, the charge would have been refilled since at the bucket's rate while the
    bucket was full without it: of a bucket full all along, a charge of its whole capacity is
    gone a window later, and a smaller one sooner; of a bucket spent all along, all of it would
    still be missing. Where this gateway cannot tell which (`TokenBucket.take_late` can, when
    its bucket has been full since), the weight lies between the two: a backlog of real charges
    that a slow broker delivers together still counts the share of each a shared bucket could
    still miss, and the batches of a sender's last ten minutes replayed at once (each a sum of
    charges since its previous one) count less than the last minute of them did."""
    if late_s <= 0.0:
        return 1.0
    return max(0.0, 1.0 - late_s / BUCKET_WINDOW_S)


class TokenBucket:
    """`capacity` units, refilled at `capacity / BUCKET_WINDOW_S` per second.

    Invariant: `_full_since_s` is finite or -inf exactly while the bucket is full (its level is
    the capacity), and then says since when; +inf while it is not full. A new bucket is full
    since ever: a gateway that has just started takes its tenants' buckets for full, and so
    everything charged before it. One started `refilling_for_s` (a process restarted in place of
    one gone that long, whose buckets went with it) holds what an empty bucket refills in that
    time: the most the tenant's bucket can hold now had it spent all of it as the process died,
    so a restart grants no tenant a bucket more, and one gone a whole window starts full. While
    it is full, `_refilled_to_s` is how far its refill has
    gone into taking back the late charges it was handed (`take_late`)."""

    __slots__ = ("_full_since_s", "_level", "_rate_per_s", "_refilled_to_s", "_stamp_s", "capacity")

    def __init__(self, capacity: int, now_s: float, *, refilling_for_s: float | None = None) -> None:
        self.capacity = float(capacity)
        self._rate_per_s = capacity / BUCKET_WINDOW_S
        self._level = self.capacity
        if refilling_for_s is not None:
            self._level = min(self.capacity, max(0.0, refilling_for_s) * self._rate_per_s)
        self._stamp_s = now_s
        self._full_since_s = math.inf if self._level < self.capacity else -math.inf
        self._refilled_to_s = -math.inf

    def _refill(self, now_s: float) -> None:
        elapsed = max(0.0, now_s - self._stamp_s)
        level = self._level + elapsed * self._rate_per_s
        if level >= self.capacity:
            if self._level < self.capacity:  # it filled up meanwhile
                self._full_since_s = self._stamp_s + (self.capacity - self._level) / self._rate_per_s
            level = self.capacity
        self._level = level
        self._stamp_s = now_s

    def _set(self, level: float, now_s: float) -> None:
        """Make the level `level` (at most the capacity) at `now_s`, after `_refill(now_s)`."""
        if level < self.capacity:
            self._full_since_s = math.inf
        elif self._level < self.capacity:
            self._full_since_s = now_s
        self._level = level

    def level(self, now_s: float) -> float:
        """What the bucket holds now."""
        self._refill(now_s)
        return self._level

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
        self._set(min(self.capacity, self._level - amount), now_s)

    def standing(self, unit: Unit, now_s: float) -> Standing:
        """This bucket now, as its rate-limit headers tell it (`Standing`)."""
        self._refill(now_s)
        full_in_s = (self.capacity - self._level) / self._rate_per_s
        return Standing(unit, int(self.capacity), max(0, math.floor(self._level)), full_in_s)

    def take_from_peer(self, amount: float, now_s: float) -> None:
        """Spend what a peer charged (`TenantLimiter.peer_usage`): at most the capacity at once,
        and never below minus the capacity, nor up from below it. A lump, late or made up by
        whoever can publish on the bus, costs the tenant two minutes of budget at most; this
        gateway's own end-of-request charges may take the bucket lower, as without peers."""
        self._refill(now_s)
        self._set(max(min(self._level, -self.capacity), self._level - min(amount, self.capacity)), now_s)

    def take_late(self, amount: float, late_s: float, now_s: float) -> None:
        """Spend what a peer charged, told `late_s` before `now_s` (`take_from_peer`): at most
        its `late_weight` share, and while this bucket is full, no more than on time it would
        have left unrefilled. A gateway that has just started takes everything before it for
        full, as its buckets started so.

        On time, a full bucket would have refilled the late charges it is handed in turn, each
        from when it was told or the one before was refilled, whichever is later, at its rate:
        each is charged what of it that refill has not reached by now, so that a stream of
        small late charges is not refilled many times over."""
        self._refill(now_s)
        charge = amount * late_weight(late_s)
        if late_s > 0.0 and self._full_since_s < math.inf:
            start_s = max(now_s - late_s, self._full_since_s, self._refilled_to_s)
            refilled_s = start_s + amount / self._rate_per_s
            self._refilled_to_s = min(refilled_s, now_s)
            charge = min(charge, (refilled_s - now_s) * self._rate_per_s)
        if charge > 0.0:
            self.take_from_peer(charge, now_s)

    def check_invariants(self) -> None:
        """`_full_since_s` is +inf exactly while the bucket is below its capacity."""
        full = self._level >= self.capacity
        assert self._level <= self.capacity
        assert full == (self._full_since_s < math.inf), "full since, yet not full (or the other way)"

    @property
    def rate_per_s(self) -> float:
        return self._rate_per_s


def openai_rate_headers(standings: Iterable[Standing]) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-<unit>` for each bucket: its capacity, what
    is left of it, and how long until it is full again (`go_duration`)."""
    out: list[tuple[bytes, bytes]] = []
    for s in standings:
        unit = s.unit.encode()
        out += [
            (b"x-ratelimit-limit-" + unit, b"%d" % s.limit),
            (b"x-ratelimit-remaining-" + unit, b"%d" % s.remaining),
            (b"x-ratelimit-reset-" + unit, go_duration(s.full_in_s).encode()),
        ]
    return out


def go_duration(seconds: float) -> str:
    """`seconds` as OpenAI writes its rate limits' reset times (Go's duration format): "0s",
    "120ms", "1.5s", "6m0s", "1h2m3s"; at most millisecond precision."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
