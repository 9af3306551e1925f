"""What a KV-event subscription (`gateway.kv_events`) is given and reports: where a worker
publishes, the bounds on what a stream may hold or wait for, its counters, and the batches lost
for good."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from policies.base import WorkerId


@dataclass(frozen=True, slots=True)
class KvEventEndpoint:
    """Where one worker publishes: its PUB endpoint, optional ROUTER replay endpoint and topic prefix."""

    worker: WorkerId
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class SequenceGap:
    """Batches `first_missing_seq .. next_seq - 1` were lost for good (or the publisher restarted)."""

    worker: WorkerId
    first_missing_seq: int
    next_seq: int
    publisher_restarted: bool = False

    @property
    def missing_batches(self) -> int:
        return max(0, self.next_seq - self.first_missing_seq)


GapCallback = Callable[[SequenceGap], None]


# The largest a counter of `SubscriptionStats` is taken to (JSON's exact integers): a publisher's
# sequence numbers are u64, and one that jumps across the range could otherwise count a gap
# beyond what a reader of the admin API can parse.
MAX_COUNT = 2**53 - 1


@dataclass(slots=True)
class SubscriptionStats:
    """Counters of one worker's subscription, for /metrics and the admin API."""

    batches: int = 0
    ignored_batches: int = 0  # dropped undecoded: nothing would use their events
    events: int = 0
    skipped_events: int = 0
    decode_errors: int = 0
    callback_errors: int = 0
    gaps: int = 0
    lost_batches: int = 0  # at most `MAX_COUNT`
    disconnects: int = 0  # connections to the publisher that ended for good and were made again
    replayed_batches: int = 0
    replay_failures: int = 0
    restarts: int = 0
    last_seq: int | None = None
    last_batch_monotonic_s: float | None = None
    last_batch_lag_s: float | None = None  # receipt (wall clock) minus the batch's `ts` (the worker's)
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class KvEventLimits:
    """Bounds on what one subscription may hold or wait for.

    A real batch is one engine step's events: its new full blocks (token ids of at most the
    step's `max_num_batched_tokens`, a few bytes each, plus 9 bytes a block hash) and evictions,
    tens of KiB, under 1 MiB for a 128k-token step. A message over `max_message_bytes` makes ZMQ
    end the connection for good (a protocol error: it does not reconnect); the subscriber then
    opens a new one and the gap is handled like any other. The queue holds at most `receive_hwm`
    messages, so one worker's stream holds at most their product (256 MiB)."""

    max_message_bytes: int = 2 * 1024 * 1024
    receive_hwm: int = 128
    replay_timeout_s: float = 2.0
    max_replay_batches: int = 10_000
    reconnect_ivl_s: float = 0.1
    # On the first live batch of a worker already running, replay its buffered history first.
    replay_on_join: bool = True


def endpoint_for_worker(template: str, worker_url: str) -> str:
    """Fill `{host}` in an endpoint template from a worker URL: `tcp://{host}:5557`, `http://10.0.0.7:8000`.
    Plain substitution, never `str.format` (`{host}` is the only placeholder, `PoolConfig` checks)."""
    host = urlsplit(worker_url).hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return template.replace("{host}", host)
