"""The policy seam: the records the gateway and the simulator exchange with a routing policy.

Time always comes in as `now_s` (monotonic seconds, or virtual seconds in the simulator); a policy
never reads a clock and never does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar, NewType, Protocol

from policies.records import record
from prompt_normalizer.types import BlockKey

WorkerId = NewType("WorkerId", str)
# vLLM publishes block hashes as ints (older builds) or bytes (sha256-based hashing).
EngineBlockHash = int | bytes


class Isolation(enum.StrEnum):
    """How far a tenant's prefixes may be shared.

    strict: own namespace, and the worker gets a per-tenant `cache_salt`, so KV is never shared.
    shared_public: own namespace, but immutable-zone chains may be promoted to the public namespace.
    public: everything is looked up in the public namespace.
    """

    STRICT = "strict"
    SHARED_PUBLIC = "shared_public"
    PUBLIC = "public"


@record
class RouteRequest:
    """One request as a policy sees it: identity, keys and size, never content.

    `queued_requests` is the demand the workers' counters do not show yet: how many requests of
    the pool were waiting in the gateway's queue for a free worker slot when this one was routed
    (0 unless every worker was at its cap)."""

    request_id: str
    pool: str
    tenant: str
    namespace: str
    block_keys: tuple[BlockKey, ...]
    n_prompt_tokens: int
    block_size_tokens: int
    isolation: Isolation = Isolation.STRICT
    public_block_keys: tuple[BlockKey, ...] = ()
    immutable_blocks: int = 0
    max_output_tokens: int | None = None
    session_key: str | None = None
    adapter: str | None = None
    queued_requests: int = 0


class Role(enum.StrEnum):
    """What a worker does in a pool: everything (mixed, the default), or one half of a
    prefill/decode split (policies/pd.py)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @classmethod
    def of(cls, label: str | None) -> Role:
        """A role from a configured or discovered label: `prefill` and `decode` name the halves;
        anything else (none, `mixed`, llm-d's `both`) serves whole requests."""
        if label == "prefill":
            return cls.PREFILL
        if label == "decode":
            return cls.DECODE
        return cls.MIXED


@record
class WorkerView:
    """A candidate worker: the gateway's own accounting plus what the worker last reported.

    Scraped fields are None when the worker exposes no metrics (or they are stale).
    """

    worker_id: WorkerId
    healthy: bool = True
    in_flight_requests: int = 0
    in_flight_prefill_tokens: int = 0
    in_flight_decode_tokens: int = 0
    max_in_flight: int | None = None
    num_requests_waiting: int | None = None
    num_requests_running: int | None = None
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None
    engine_block_size: int | None = None
    loaded_adapters: frozenset[str] | None = None
    warming: bool = False
    role: Role = Role.MIXED
    # The gateway's own in-flight requests on the worker when `num_requests_*` were scraped (None:
    # not known). Only what the scrape reports beyond them is load the gateway did not send; what
    # it sent or finished since is already in `in_flight_requests` (see `reported_load`).
    in_flight_at_scrape: int | None = None
    # KV tokens the worker's decode batch reads per step, as the gateway counts it: the prompt
    # tokens of its in-flight requests past their first token, plus half their maximum output (the
    # mean generated length if they run to it). `in_flight_decode_tokens` counts output still to
    # come, not context.
    decode_context_tokens: int = 0
    # When the work on `in_flight_prefill_tokens` last (re)started, on the policy's clock: the
    # backlog's first dispatch after it was empty, or its last first token (under FCFS the oldest
    # prompt still pending started no earlier). None: not known, or no backlog. Only the elapsed
    # time since then may count as prefill done (`CostModel.prefill_remaining`).
    prefill_started_s: float | None = None
    # The causal attention of the prompts in `in_flight_prefill_tokens`: the sum over them of
    # `prefill_pairs(prompt, matched)` with the match their decision predicted (request tokens²).
    # Attention grows with a prompt's square, so a backlog holding one long miss takes longer to
    # compute than the same tokens in many short prompts (`CostModel.queue_s`).
    in_flight_prefill_pairs: int = 0


def prefill_pairs(prompt_tokens: int, matched_tokens: int) -> int:
    """The query-key pairs of causal attention a prefill of `prompt_tokens` computes when
    `matched_tokens` of them are cached: each of the `new` tokens attends to the cached ones and to
    the new ones before it, `new · (matched + new / 2)`."""
    matched = min(max(matched_tokens, 0), prompt_tokens)
    new = prompt_tokens - matched
    return new * (2 * matched + new) // 2 if new > 0 else 0


def decode_context_of(prompt_tokens: int, max_output_tokens: int) -> int:
    """The KV tokens one decoding request adds to its worker's decode steps, as the gateway can
    count them without reading the stream: its prompt plus half its maximum output (its mean
    generated length over the decode, if it runs to the limit; 0 when the client set none)."""
    return prompt_tokens + max_output_tokens // 2


def reported_load(view: WorkerView) -> tuple[int, int] | None:
    """The worker's scraped (waiting, running) brought up to now, None without a scrape.

    A scrape is up to its interval old: counted as is against the gateway's current in-flight
    requests, requests that have finished since would still weigh on the worker. So the requests
    the gateway had in flight at the scrape are taken out and its current ones put in: the
    scrape's excess over them (other gateways' or clients' load) is kept, waiting first."""
    waiting = view.num_requests_waiting
    if waiting is None:
        return None
    running = view.num_requests_running or 0
    at = view.in_flight_at_scrape
    if at is None:
        return waiting, running
    others = waiting + running - at
    if others <= 0:
        return 0, view.in_flight_requests
    waiting = min(waiting, others)
    return waiting, view.in_flight_requests + others - waiting


@record
class RouteDecision:
    """The chosen worker, its score in seconds (higher is better) and a short metrics-safe reason.

    `shared_prefix_blocks` > 0 means the request's leading immutable blocks were routed as a
    promoted public prefix (the gateway may then let the worker share that KV across tenants
    whose isolation allows it).
    """

    worker: WorkerId
    score_s: float
    reason: str
    matched_tokens: int = 0
    shared_prefix_blocks: int = 0


class Outcome(enum.StrEnum):
    """How a dispatched request ended, as far as the worker's KV cache is concerned.

    Only SERVED means the worker prefilled the whole prompt; a policy must not learn cache
    contents from any other outcome.
    """

    SERVED = "served"
    REJECTED = "rejected"  # the worker refused the request (4xx), up front or mid-stream
    ABORTED = "aborted"  # the client left or the gateway gave up before the request finished
    WORKER_FAILED = "worker_failed"  # connect error, 5xx, or the worker died mid-request


@record
class Observation:
    """What the gateway (or simulator) saw when a dispatched request finished or failed."""

    request: RouteRequest
    worker: WorkerId
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    outcome: Outcome = Outcome.SERVED

    @property
    def failed(self) -> bool:
        return self.outcome is not Outcome.SERVED


class KvEventKind(enum.StrEnum):
    BLOCK_STORED = "block_stored"
    BLOCK_REMOVED = "block_removed"
    ALL_BLOCKS_CLEARED = "all_blocks_cleared"


@record
class KvEvent:
    """One decoded KV-cache event from a worker: vLLM's BlockStored, BlockRemoved or AllBlocksCleared.

    `namespace` is the key namespace of a stored chain, resolved by the gateway from the block's
    `cache_salt` (vLLM's `extra_keys`): the tenant whose salt it is, or None for an unsalted chain.
    The policy never sees the salt itself.
    """

    kind: KvEventKind
    block_hashes: tuple[EngineBlockHash, ...] = ()
    parent_block_hash: EngineBlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_name: str | None = None
    namespace: str | None = None


class RoutingPolicy(Protocol):
    """What the gateway and the simulator drive. Implementations are registered by name."""

    name: ClassVar[str]

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        """Pick a worker among `workers` (all candidates, healthy or not); None if none can serve."""
        ...

    def on_dispatch(self, req: RouteRequest, decision: RouteDecision, now_s: float) -> None: ...

    def on_complete(self, obs: Observation, now_s: float) -> None: ...

    def on_kv_event(self, worker: WorkerId, event: KvEvent, now_s: float) -> None: ...
