"""Per-pool state shared by the prefix-aware policies: the index, the cost model, worker capacities;
and what a policy that keeps state per worker is told of the workers' comings and goings.

A worker's state here says what the process at its URL holds, so it must not outlive that process:
- a worker that leaves the pool (discovery removed it) is forgotten, and nothing more is recorded
  of it until it joins again (a request that was still running there, a KV event in flight);
- a worker that joins forgets whatever was known of its URL before (a late record, a past
  process at the same address): a pod given a departed pod's IP, a pod that turned ready again;
- a worker that may have restarted in place (health checks took it down, or saw it back after
  being down: the usual way a static URL restarts) has its holdings cleared, and keeps its
  capacity (a restarted engine reporting another cache size is picked up as any change is).
The gateway says which (`gateway.fleet`); the simulator's workers never come or go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class FollowsWorkers(Protocol):
    """A policy that keeps state per worker and is told when it stops describing the process at
    the worker's URL (module docstring). `pool` is the pool's name, as in `RouteRequest.pool`."""

    def worker_joined(self, pool: str, worker: WorkerId) -> None:
        """Discovery added `worker` to `pool`."""
        ...

    def worker_left(self, pool: str, worker: WorkerId) -> None:
        """Discovery removed `worker` from `pool`."""
        ...

    def worker_reset(self, pool: str, worker: WorkerId) -> None:
        """`worker` in `pool` may be a new process with an empty cache (health went down, or came
        back after being down)."""
        ...


@runtime_checkable
class CarriesLearning(Protocol):
    """A policy that can take over, on a policy reload, what the policy it replaces learned of the
    workers (`carry_over`), instead of starting from nothing."""

    def carry_over(self, previous: object, pools: Collection[str]) -> list[str]:
        """Take over from `previous` what it learned of the pools in `pools` (those whose prompts
        are keyed as before); returns the pools whose prefix index was taken over."""
        ...

    def retire(self) -> None:
        """Let go of what this policy learned, once another has replaced it (and taken over what
        it carries): anything still holding the old policy (a request dispatched before the swap,
        the process's start-up frames, the objects `gc.freeze` made permanent) must not keep its
        index alive. The policy stays usable, as a new one would be."""
        ...


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
        *,
        index: PrefixIndex | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.block_size_tokens = block_size_tokens
        if index is None:
            index = PrefixIndex(settings.index, block_size_tokens, namespace_share)
        elif namespace_share is not None:
            index.share_by(namespace_share)
        self.index = index
        self.cost = CostModel(settings.cost) if cost is None else cost
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

    def worker_joined(self, worker: WorkerId) -> None:
        """See the module docstring: nothing known of the URL before counts."""
        self.index.admit_worker(worker)
        self._capacity_seen.pop(worker, None)  # its capacity is set again when next observed

    def worker_left(self, worker: WorkerId) -> None:
        """See the module docstring: forgotten, and ignored until it joins again."""
        self.index.retire_worker(worker)
        self._capacity_seen.pop(worker, None)

    def worker_reset(self, worker: WorkerId) -> None:
        """See the module docstring: holdings cleared, capacity kept."""
        self.index.clear_worker(worker)


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

    def carry(self, previous: PoolSet, names: Collection[str]) -> list[str]:
        """Take over from `previous` (the pools of the policy this one replaces on a reload) the
        pools named in `names` (those whose prompts are keyed as before) whose index is sized as
        before: their index, with what every worker holds, and, with the same cost constants,
        their calibrated cost model. Capacities are set again from this policy's settings as the
        workers are next seen. Returns the names of the pools taken over, in their order."""
        kept: list[str] = []
        for name, old in previous._pools.items():
            settings = self._settings.get(name, self._default)
            if name not in names or settings.index != old.index.config:
                continue
            cost = old.cost if settings.cost == old.settings.cost else None
            self._pools[name] = PoolState(
                name, settings, old.block_size_tokens, self._share, index=old.index, cost=cost
            )
            kept.append(name)
        for worker, name in previous._pool_of_worker.items():
            if name in kept:
                self._pool_of_worker[worker] = name
        return kept

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

    def workers_of(self, pool: str) -> list[WorkerId]:
        """The workers last seen in `pool` (a scan of every worker seen: for rare events only)."""
        return [worker for worker, name in self._pool_of_worker.items() if name == pool]

    def pool_of(self, worker: WorkerId) -> PoolState | None:
        name = self._pool_of_worker.get(worker)
        if name is None:
            return None
        return self._pools.get(name)

    def items(self) -> list[tuple[str, PoolState]]:
        return list(self._pools.items())
