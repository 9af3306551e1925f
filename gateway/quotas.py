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
nothing a bucket's window late (`rate_buckets.late_weight`), and of a bucket full since they were told, only
what it would not have refilled of them (`rate_buckets.TokenBucket.take_late`). A peer's requests in flight
count from when it said them, not from when they arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.config import QuotaConfig
from gateway.lifecycle import PROCESS_INDEX_ENV
from gateway.rate_buckets import Standing, TokenBucket, openai_rate_headers


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was not admitted. `retryable` is False when waiting cannot help."""

    message: str
    retry_after_s: float
    retryable: bool
    code: str


# How long charges may wait to be told before they drain at the buckets' refill rate (a broker
# outage: `TenantLimiter.unshared`), unless the sync's batches are further apart (`told_gap_s`).
TOLD_GAP_S = 1.0

# Set by `kvgate serve --processes` for a process it restarts in place of one that exited: the
# seconds that one has been gone. Its tenants' buckets start as an empty bucket refilled over that
# time (`TenantLimiter`, `TokenBucket`); a first start's (no such variable) start full. Honoured
# only in a child of that supervisor (which also sets `PROCESS_INDEX_ENV`): a single `kvgate
# serve` started from a shell that happens to have it starts full.
RESTARTED_ENV = "KVGATE_RESTARTED_AFTER_S"


def restarted_after_s_of(environ: Mapping[str, str]) -> float | None:
    """How long this process's predecessor has been gone (`RESTARTED_ENV`); None at a first start,
    or outside a `--processes` group. `inf` (gone for ever) is None too: a bucket refilled that
    long is full. A negative value counts as 0, and one that is not a number (NaN included) as 0
    (buckets start empty): the supervisor never writes either, and a garbled one cannot grant more."""
    value = environ.get(RESTARTED_ENV)
    if value is None or PROCESS_INDEX_ENV not in environ:
        return None
    try:
        gone_s = float(value)
    except ValueError:
        return 0.0
    if gone_s == math.inf:
        return None
    return max(gone_s, 0.0) if math.isfinite(gone_s) else 0.0


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

    def __init__(self, quotas: QuotaConfig, now_s: float, *, restarted_after_s: float | None = None) -> None:
        self._max_concurrent = quotas.max_concurrent
        # A restarted process's buckets start as an empty one refilled since its predecessor died
        # (`restarted_after_s`, `restarted_after_s_of`; `TokenBucket`): full, they granted a tenant
        # a bucket more at each restart, whatever it had spent through the process that died.
        gone_s = restarted_after_s
        self._rpm = TokenBucket(quotas.rpm, now_s, refilling_for_s=gone_s) if quotas.rpm else None
        self._tpm = TokenBucket(quotas.tpm, now_s, refilling_for_s=gone_s) if quotas.tpm else None
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
