"""What the simulator's loop keeps per dispatched request and per engine, and the KV events an
engine step yields as the gateway would decode them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from loadtest.simulator.gateways import SimGateway
from loadtest.simulator.keys import KeyedPrompt, KeyPath
from loadtest.simulator.pd import PrefillLeg
from loadtest.simulator.port import KvChanges, SimEngine, StatsLike, StepLike
from loadtest.workloads.records import WorkloadRequest
from policies.base import KvEvent, KvEventKind, RouteDecision, RouteRequest, WorkerId


class Flight:
    """A dispatched request the loop is waiting on (mutable)."""

    __slots__ = (
        "context", "decided_s", "decision", "first_token_s", "gateway", "hashes", "keyed", "leg",
        "max_out", "pairs", "req", "route", "salt", "visible_cached",
    )  # fmt: skip

    def __init__(
        self,
        req: WorkloadRequest,
        route: RouteRequest,
        decision: RouteDecision,
        keyed: KeyedPrompt | None = None,
        salt: str | None = None,
        gateway: SimGateway | None = None,
    ) -> None:
        self.gateway = gateway
        self.req = req
        self.route = route
        self.decision = decision
        self.keyed = keyed
        self.salt = salt
        self.first_token_s: float | None = None
        self.pairs = 0  # its prefill's attention, as its gateway counts it (`prefill_pairs`)
        # When its gateway decided it: its arrival, or later for a request the gateway held. The
        # policy's TTFT sample runs from there, as the gateway's does from its dispatch.
        self.decided_s = req.arrival_s
        self.max_out = req.max_output_tokens  # the engine request's (1 for a prefill leg)
        self.hashes: Sequence[int] = ()
        self.leg: PrefillLeg | None = None  # P/D: set while the request's prefill leg runs
        self.visible_cached: int | None = None  # P/D: the cached tokens the client is told
        self.context = 0  # what its first token added to its gateway's decode context count


class SimWorker:
    """An engine as the loop drives it: its pending step, last scrape and counters (mutable)."""

    __slots__ = (
        "busy",
        "busy_s",
        "cached_tokens",
        "engine",
        "id",
        "n_requests",
        "n_steps",
        "output_tokens",
        "pending",
        "prefill_tokens",
        "prompt_tokens",
        "scrape",
        "scrape_in_flight",
        "scrape_s",
    )

    def __init__(self, worker_id: str, engine: SimEngine) -> None:
        self.id = WorkerId(worker_id)
        self.engine = engine
        self.busy = False
        self.pending: StepLike | None = None
        self.scrape: StatsLike = engine.stats()
        self.scrape_s = -math.inf
        self.scrape_in_flight: list[int] = []
        self.n_requests = self.prompt_tokens = self.cached_tokens = self.prefill_tokens = 0
        self.output_tokens = self.n_steps = 0
        self.busy_s = 0.0


def kv_events(
    out: KvChanges, block_size: int, flights: Mapping[str, Flight], keys: KeyPath
) -> Iterator[KvEvent]:
    """One engine step's KV changes as the gateway decodes them: token ids of every stored block
    (chat and text prompts; a trace prompt has none), and the namespace its salt resolves to."""
    for st in out.stored:
        tokens: tuple[int, ...] = ()
        namespace = None
        f = flights.get(str(st.request_id))
        if f is not None and f.keyed is not None:
            namespace = keys.namespace_of_salt(f.salt)
            if f.keyed.tokens is not None:
                start = st.first_block_index * block_size
                tokens = tuple(f.keyed.tokens[start : start + len(st.block_hashes) * block_size])
        yield KvEvent(
            KvEventKind.BLOCK_STORED,
            tuple(st.block_hashes),
            st.parent_block_hash,
            token_ids=tokens,
            block_size=block_size,
            namespace=namespace,
        )
    if out.removed:
        yield KvEvent(KvEventKind.BLOCK_REMOVED, tuple(out.removed))
