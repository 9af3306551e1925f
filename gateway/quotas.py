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

Buckets hold one minute of budget (`BUCKET_WINDOW_S`) and refill continuously. The end-of-request
charges may take a bucket below zero, which delays the tenant's next requests instead of failing
this one.

Gateways that share a sync broker (the processes of `kvgate serve --processes N`, replicas with a
`sync.url`) share their tenants' quotas through it (`gateway.sync`): each limiter keeps what it
charged since its peers were last told (`unshared`), and charges its own buckets with what each
peer charged (`peer_usage`), so that every gateway's bucket is the one bucket of the whole fleet,
a batch interval and a broker's delivery late; its concurrency limit counts the peers' requests
in flight too, as each peer last said, until that peer is silent for the sync's `peer_timeout_s`.
What a peer says can only spend: a peer's charge takes a bucket down to minus its capacity at
most (a made-up or late lump costs a tenant two minutes of budget at most, and never lifts a bucket
this gateway's own charges took lower), tokens given back by a reconciled prompt count stay with
the gateway that charged them, and a peer counts at most the limit in flight. Charges that wait
to be told longer than `told_gap_s` (a broker outage) drain at the buckets' refill rate meanwhile,
as the shared bucket would have refilled. Likewise a peer's charges that reach this gateway late
(a slow broker, or captured batches replayed to a gateway that never heard their sender: one that
just started) count no more than on time they would still weigh: less the later they come,
nothing a bucket's window late (`late_weight`), and of a bucket full since they were told, only
what it would not have refilled of them (`TokenBucket.take_late`). A peer's requests in flight
count from when it said them, not from when they arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from gateway.config import QuotaConfig


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was not admitted. `retryable` is False when waiting cannot help."""

    message: str
    retry_after_s: float
    retryable: bool
    code: str


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
    everything charged before it. While it is full, `_refilled_to_s` is how far its refill has
    gone into taking back the late charges it was handed (`take_late`)."""

    __slots__ = ("_full_since_s", "_level", "_rate_per_s", "_refilled_to_s", "_stamp_s", "capacity")

    def __init__(self, capacity: int, now_s: float) -> None:
        self.capacity = float(capacity)
        self._rate_per_s = capacity / BUCKET_WINDOW_S
        self._level = float(capacity)
        self._stamp_s = now_s
        self._full_since_s = -math.inf
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


# How long charges may wait to be told before they drain at the buckets' refill rate (a broker
# outage: `TenantLimiter.unshared`), unless the sync's batches are further apart (`told_gap_s`).
TOLD_GAP_S = 1.0

# Peers whose requests in flight a limiter counts, at most (each forgotten when silent): far more
# gateways than a fleet has; beyond it, made-up senders count nothing.
MAX_PEERS = 1024


@dataclass(frozen=True, slots=True)
class Usage:
    """What a gateway tells its peers of one tenant: the requests (rpm units) and tokens (tpm) it
    charged since it last told them, and the tenant's requests in flight there now."""

    requests: int
    tokens: int
    in_flight: int


class TenantLimiter:
    """The quota state of one tenant. `notify`, when set (by the sync service), is called after
    every charge and every change of `in_flight`, so that the peers hear of it soon."""

    def __init__(self, quotas: QuotaConfig, now_s: float) -> None:
        self._max_concurrent = quotas.max_concurrent
        self._rpm = TokenBucket(quotas.rpm, now_s) if quotas.rpm else None
        self._tpm = TokenBucket(quotas.tpm, now_s) if quotas.tpm else None
        self.in_flight = 0
        self.limited = quotas.max_concurrent is not None or self._rpm is not None or self._tpm is not None
        self.notify: Callable[[], None] | None = None
        self._unshared_requests = 0.0
        self._unshared_tokens = 0.0  # negative while tokens given back outweigh those charged
        self._shared_in_flight = 0  # `in_flight` as the peers were last told (-1: tell it again)
        self._drain_from_s: float | None = None  # when what waits to be told starts to drain
        self.told_gap_s = TOLD_GAP_S
        self._peers: dict[str, tuple[int, float]] = {}  # peer -> (its in flight, when it said so)
        self._peers_in_flight = 0

    def _charged(self, requests: int, tokens: int, now_s: float) -> None:
        if requests or tokens:
            self._wait_to_tell(requests, tokens, now_s)
        if self.notify is not None:
            self.notify()

    def _wait_to_tell(self, requests: float, tokens: float, now_s: float) -> None:
        self._drain(now_s)
        if self._drain_from_s is None:
            self._drain_from_s = now_s + self.told_gap_s
        self._unshared_requests += requests
        self._unshared_tokens += tokens

    def _drain(self, now_s: float) -> None:
        """What waited to be told beyond `told_gap_s` drains at the buckets' refill rate."""
        start_s = self._drain_from_s
        if start_s is None or now_s <= start_s:
            return
        self._drain_from_s = now_s
        waited_s = now_s - start_s
        if self._rpm is not None and self._unshared_requests > 0:
            self._unshared_requests = max(0.0, self._unshared_requests - self._rpm.rate_per_s * waited_s)
        if self._tpm is not None and self._unshared_tokens > 0:
            self._unshared_tokens = max(0.0, self._unshared_tokens - self._tpm.rate_per_s * waited_s)

    def unshared(self, full: bool, now_s: float) -> Usage | None:
        """What the peers have not been told yet, now counted as told; with `full` (a whole
        load snapshot) the requests in flight as well, even unchanged. None when there is
        nothing to tell. Tokens given back stay here (they offset the next ones charged), and
        what waited longer than `told_gap_s` (the broker was away) has drained at the buckets'
        refill rate meanwhile, as the shared bucket would have refilled."""
        if not self.limited:
            return None
        self._drain(now_s)
        requests = round(self._unshared_requests)
        tokens = round(self._unshared_tokens) if self._unshared_tokens > 0 else 0
        in_flight = self.in_flight
        self._unshared_requests = 0.0
        self._unshared_tokens = min(0.0, self._unshared_tokens)  # what was given back, kept
        self._drain_from_s = None
        if not requests and not tokens and in_flight == self._shared_in_flight and not (full and in_flight):
            return None
        self._shared_in_flight = in_flight
        return Usage(requests, tokens, in_flight)

    def unsend(self, usage: Usage, now_s: float) -> None:
        """`usage` never reached the peers (the batch was not published): tell it again."""
        self._wait_to_tell(usage.requests, usage.tokens, now_s)
        self._shared_in_flight = -1

    def peer_usage(self, peer: str, usage: Usage, now_s: float, late_s: float = 0.0) -> None:
        """Charge what `peer` charged for this tenant to this gateway's buckets, less the later it
        arrives (`late_s` after the peer told it: `TokenBucket.take_late`) and bounded
        (`TokenBucket.take_from_peer`), and count its requests in flight (at most the limit)
        against the concurrency limit, as said `late_s` before `now_s` (`forget_peers`)."""
        if self._rpm is not None and usage.requests > 0:
            self._rpm.take_late(usage.requests, late_s, now_s)
        if self._tpm is not None and usage.tokens > 0:
            self._tpm.take_late(usage.tokens, late_s, now_s)
        limit = self._max_concurrent
        if limit is None:
            return
        before = self._peers.pop(peer, (0, 0.0))[0]
        in_flight = min(usage.in_flight, limit)
        if in_flight and len(self._peers) < MAX_PEERS:
            self._peers[peer] = (in_flight, now_s - max(0.0, late_s))
            self._peers_in_flight += in_flight - before
        else:
            self._peers_in_flight -= before

    @property
    def has_peers(self) -> bool:
        """Whether requests in flight at peers are counted now (`forget_peers` has work)."""
        return bool(self._peers)

    def forget_peers(self, silent_since_s: float) -> None:
        """Stop counting the requests in flight of peers that said nothing since `silent_since_s`
        (a peer that stopped, or that lost the broker: its load is forgotten likewise)."""
        for peer in [p for p, (_, said_s) in self._peers.items() if said_s < silent_since_s]:
            self._peers_in_flight -= self._peers.pop(peer)[0]

    @property
    def peers_in_flight(self) -> int:
        return self._peers_in_flight

    def remaining(self, now_s: float) -> dict[str, float]:
        """What is left of each of the tenant's quotas now, by name: `requests` and `tokens` (the
        rpm and tpm buckets, below 0 while end-of-request charges are being paid off) and
        `concurrent` (the limit less the requests in flight here and at the peers)."""
        out: dict[str, float] = {}
        if self._rpm is not None:
            out["requests"] = self._rpm.level(now_s)
        if self._tpm is not None:
            out["tokens"] = self._tpm.level(now_s)
        if self._max_concurrent is not None:
            out["concurrent"] = self._max_concurrent - self.in_flight - self._peers_in_flight
        return out

    def standings(self, now_s: float) -> tuple[Standing, ...]:
        """Where the tenant's rpm (`requests`) and tpm (`tokens`) buckets stand now, as the rate-limit
        headers of every answer tell it; empty for a tenant without either."""
        rpm = (self._rpm.standing("requests", now_s),) if self._rpm is not None else ()
        tpm = (self._tpm.standing("tokens", now_s),) if self._tpm is not None else ()
        return rpm + tpm

    def rate_headers(self, now_s: float) -> list[tuple[bytes, bytes]]:
        """The `x-ratelimit-*` headers of the tenant's rpm (`-requests`) and tpm (`-tokens`), as
        OpenAI's API sends them with every answer; none for a tenant without either."""
        return openai_rate_headers(self.standings(now_s))

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
        if (
            self._max_concurrent is not None
            and self.in_flight + self._peers_in_flight >= self._max_concurrent
        ):
            return self._too_many()
        if self._rpm is not None:
            wait = self._rpm.wait_s(1, now_s)
            if wait > 0:
                return _spent("requests per minute", wait)
            self._rpm.take(1, now_s)
        self.in_flight += 1
        self._charged(1 if self._rpm is not None else 0, 0, now_s)
        return None

    def leave(self) -> None:
        """Give back the slot of a request that was refused or abandoned before admission."""
        self.in_flight -= 1
        if self.notify is not None:
            self.notify()

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
            self._charged(0, prompt_tokens, now_s)
        return None

    def reconcile(self, estimated_tokens: int, prompt_tokens: int | None, now_s: float) -> None:
        """Correct a finished request's prompt charge from the estimate taken at admission to the
        worker's count (`usage.prompt_tokens`); without a count (None, or below zero: a faulty
        worker's, which would give the tenant back more than it was charged) the estimate stands."""
        if (
            self._tpm is not None
            and prompt_tokens is not None
            and prompt_tokens >= 0
            and prompt_tokens != estimated_tokens
        ):
            self._tpm.take(prompt_tokens - estimated_tokens, now_s)
            self._charged(0, prompt_tokens - estimated_tokens, now_s)

    def release(self, completion_tokens: int, now_s: float) -> None:
        """The end of an admitted request: its slot comes back, its completion tokens are charged."""
        self.in_flight -= 1
        charged = 0
        if self._tpm is not None and completion_tokens > 0:
            self._tpm.take(completion_tokens, now_s)
            charged = completion_tokens
        self._charged(0, charged, now_s)


def _spent(what: str, wait_s: float) -> Rejection:
    # A quota that refills within the SDK's retry window (60 s) is worth retrying; beyond it the
    # SDK would ignore Retry-After anyway, so we tell it not to retry at all.
    retryable = wait_s <= 60.0
    code = "rate_limit_exceeded" if retryable else "insufficient_quota"
    return Rejection(f"{what} quota spent; retry in {math.ceil(wait_s)} s", wait_s, retryable, code)
