"""Per-pool state shared by the prefix-aware policies: the index, the cost model, worker capacities."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.base import WorkerId, WorkerView, reported_load
from policies.cost_model import CostModel
from policies.cost_params import CostModelParams
from policies.index import IndexConfig, PrefixIndex


def available(workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Healthy workers below their in-flight limit, in the order given."""
    return [
        w
        for w in workers
        if w.healthy and (w.max_in_flight is None or w.in_flight_requests < w.max_in_flight)
    ]


def load_of(view: WorkerView) -> int:
    """In-flight requests, raised to what the worker itself reports when it reports more."""
    scraped = reported_load(view)
    return view.in_flight_requests if scraped is None else max(view.in_flight_requests, sum(scraped))


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """One pool's settings: index sizing, cost constants, and static per-worker capacities."""

    index: IndexConfig = field(default_factory=IndexConfig)
    cost: CostModelParams = field(default_factory=CostModelParams)
    capacity_fraction: float = 0.9
    worker_capacity_tokens: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.capacity_fraction <= 1.0:
            raise ValueError("capacity_fraction must be in (0, 1]")


class PoolState:
    """Everything a policy keeps for one pool."""

    def __init__(
        self,
        name: str,
        settings: PoolSettings,
        block_size_tokens: int,
        namespace_share: Callable[[str], float] | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.block_size_tokens = block_size_tokens
        self.index = PrefixIndex(settings.index, block_size_tokens, namespace_share)
        self.cost = CostModel(settings.cost)
        self._capacity_seen: dict[WorkerId, tuple[int | None, int | None]] = {}

    def capacity_tokens(self, view: WorkerView) -> int:
        """The worker's prefix-cache size in tokens: reported blocks, else configured, else default."""
        static = self.settings.worker_capacity_tokens.get(view.worker_id)
        if static is not None:
            return static
        if view.num_gpu_blocks is not None:
            block = view.engine_block_size or self.block_size_tokens
            return int(view.num_gpu_blocks * block * self.settings.capacity_fraction)
        return self.settings.index.default_capacity_tokens

    def observe_workers(self, workers: Sequence[WorkerView]) -> None:
        seen = self._capacity_seen
        for view in workers:
            reported = (view.num_gpu_blocks, view.engine_block_size)
            if seen.get(view.worker_id) != reported:
                seen[view.worker_id] = reported
                self.index.set_capacity(view.worker_id, self.capacity_tokens(view))
        if len(seen) > 4 * self.settings.index.max_workers:
            seen.clear()


class PoolSet:
    """Pools created on first use, keyed by name; bounded so a flood of pool names cannot grow it."""

    MAX_POOLS = 256

    def __init__(
        self,
        settings: Mapping[str, PoolSettings],
        default: PoolSettings,
        namespace_share: Callable[[str], float] | None = None,
    ) -> None:
        self._settings = dict(settings)
        self._default = default
        self._share = namespace_share
        self._pools: OrderedDict[str, PoolState] = OrderedDict()
        self._pool_of_worker: OrderedDict[WorkerId, str] = OrderedDict()

    def get(self, name: str, block_size_tokens: int) -> PoolState:
        pool = self._pools.get(name)
        if pool is None or pool.block_size_tokens != block_size_tokens:
            # A new block size means new keys: start that pool's index afresh.
            pool = PoolState(name, self._settings.get(name, self._default), block_size_tokens, self._share)
            self._pools[name] = pool
            if len(self._pools) > self.MAX_POOLS:
                self._pools.popitem(last=False)
        return pool

    def existing(self, name: str) -> PoolState | None:
        """The pool named `name` if one was made (never makes one)."""
        return self._pools.get(name)

    def note_workers(self, pool: str, workers: Sequence[WorkerView]) -> None:
        owner = self._pool_of_worker
        for view in workers:
            if owner.get(view.worker_id) != pool:
                owner[view.worker_id] = pool
                if len(owner) > 65_536:
                    owner.popitem(last=False)

    def pool_of(self, worker: WorkerId) -> PoolState | None:
        name = self._pool_of_worker.get(worker)
        if name is None:
            return None
        return self._pools.get(name)

    def items(self) -> list[tuple[str, PoolState]]:
        return list(self._pools.items())
