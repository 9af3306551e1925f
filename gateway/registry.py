"""Worker registry: per-pool workers with active health, a circuit breaker and load accounting.

The registry takes plain URL lists (`Pool.set_urls`), so static config and periodic discovery feed
it the same way; each worker is a `gateway.worker.Worker`. Each change of a worker's health
verdict is reported to the pool's `on_health` listener (the fleet's: a worker that goes down, or
comes back after being down, may be a new process with an empty cache). A worker seen up, or restarted in
place, has its model cards read on the next health round (`model_window.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Mapping

import aiohttp

from gateway.config.pool import PoolConfig
from gateway.health import probe_health
from gateway.model_window import PoolWindows, read_windows
from gateway.pd_suspects import InconclusivePairs
from gateway.upstream_headers import NO_AUTH, WorkerAuth
from gateway.worker import HealthChange, HealthListener, Worker
from policies.base import WorkerId, WorkerView
from policies.pd import SGLANG_ROLES, VLLM_ROLES, PdRouter, PdSettings

log = logging.getLogger("kvgate.registry")


class Pool:
    """The workers of one pool and the config they share. `auth` is the pool's API key for its
    workers, sent on every request to them (`upstream_headers.py`); `forward` the client header
    names (lower-case ASGI bytes) its config lets through, less `withheld` (the trace context
    while the gateway traces: its own CLIENT span's `traceparent` replaces the client's, whose
    context is already the parent of the gateway's SERVER span)."""

    def __init__(
        self, config: PoolConfig, auth: WorkerAuth = NO_AUTH, withheld: frozenset[str] = frozenset()
    ) -> None:
        self.config = config
        self.name = config.name
        self.auth = auth
        self.forward = frozenset(
            name.encode("latin-1") for name in config.forward_headers if name not in withheld
        )
        self.workers: dict[WorkerId, Worker] = {}
        self.metrics_max_age_s = 5.0
        t = config.timeouts
        self.client_timeout = aiohttp.ClientTimeout(
            total=t.total_s, sock_connect=t.connect_s, sock_read=t.read_s
        )
        # Prefill/decode disaggregation: the pair chooser of a pool with a `pd` section.
        self.pd_router = _pd_router(config)
        self.pd_suspects = InconclusivePairs()  # SGLang pairs that failed pointing at neither worker
        self.windows = PoolWindows(config)  # each model's context window, read at admission
        self._static_roles = config.static_roles
        self.on_health: HealthListener | None = None
        self.set_urls(config.static_urls)

    def set_urls(self, urls: Iterable[str], roles: Mapping[str, str | None] | None = None) -> None:
        """Replace the worker set; workers that stay keep their health, breaker and counters.
        `roles` (by URL) comes from discovery; a worker it does not name has the role the config
        gives it (`prefill_workers`, `decode_workers`), else none."""
        wanted = [u.rstrip("/") for u in urls]
        kept = {WorkerId(u): self.workers.get(WorkerId(u)) or Worker(u, self.config) for u in wanted}
        for worker in kept.values():
            found = roles.get(worker.url) if roles else None
            worker.role = found if found is not None else self._static_roles.get(worker.url)
        for gone in self.workers.keys() - kept.keys():
            self.windows.forget(gone)
        self.workers = kept

    async def check(self, session: aiohttp.ClientSession) -> None:
        """One round of health checks of this pool's workers, concurrently; then the model cards
        of the workers seen up or restarted since their last read."""
        workers = list(self.workers.values())
        timeout_s, headers = self.config.health.timeout_s, self.auth.headers
        results = await asyncio.gather(*(probe_health(w.url, timeout_s, session, headers) for w in workers))
        for worker, ok in zip(workers, results, strict=True):
            change = worker.record_health(ok, self.config)
            if change is HealthChange.DOWN:
                self.windows.forget(worker.worker_id)
            # A worker that left the pool while it was checked is no longer this pool's to report.
            if (
                change is not None
                and self.on_health is not None
                and self.workers.get(worker.worker_id) is worker
            ):
                self.on_health(worker.worker_id, change)
        due = [w for w in self.workers.values() if w.window_due and w.healthy]
        for worker in due:
            worker.window_due = False
        reads = await asyncio.gather(*(read_windows(w.url, timeout_s, session, headers) for w in due))
        for worker, read in zip(due, reads, strict=True):
            if self.workers.get(worker.worker_id) is worker and worker.healthy:
                self.windows.note(worker.worker_id, read)

    def views(self, now_s: float, exclude: frozenset[WorkerId] = frozenset()) -> list[WorkerView]:
        views = [w.view(now_s, self.metrics_max_age_s) for w in self.workers.values()]
        if exclude:
            views = [dataclasses.replace(v, healthy=False) if v.worker_id in exclude else v for v in views]
        return views


def _pd_router(config: PoolConfig) -> PdRouter | None:
    pd = config.pd
    if pd is None:
        return None
    settings = PdSettings(
        roles=VLLM_ROLES if pd.protocol == "vllm" else SGLANG_ROLES,
        transfer_setup_s=pd.transfer.setup_s,
        transfer_bytes_per_token=pd.transfer.bytes_per_token,
        transfer_bandwidth_bytes_per_s=pd.transfer.bandwidth_bytes_per_s,
        conditional=pd.conditional,
        interference_weight=pd.interference_weight,
        mode=pd.mode,
        holder_share=pd.holder_share,
    )
    return PdRouter(settings)


class Registry:
    """All pools, the model → pool map, and the health-check loops (owned by the app lifespan)."""

    def __init__(
        self,
        pools: Iterable[PoolConfig],
        auth: Mapping[str, WorkerAuth] | None = None,
        withheld: frozenset[str] = frozenset(),
    ) -> None:
        self.pools: dict[str, Pool] = {}
        self.by_model: dict[str, Pool] = {}
        for cfg in pools:
            pool = Pool(cfg, (auth or {}).get(cfg.name, NO_AUTH), withheld)
            self.pools[cfg.name] = pool
            for model in cfg.models:
                self.by_model[model] = pool
        self._tasks: list[asyncio.Task[None]] = []

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One round of health checks over every pool, concurrently."""
        await asyncio.gather(*(pool.check(session) for pool in self.pools.values()))

    def workers_at(self, worker: WorkerId) -> list[Worker]:
        """Every pool's entry for one worker URL (a worker may serve several pools)."""
        return [p.workers[worker] for p in self.pools.values() if worker in p.workers]

    def start(self, session: aiohttp.ClientSession) -> None:
        for pool in self.pools.values():
            self._tasks.append(asyncio.create_task(self._loop(pool, session), name=f"health:{pool.name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _loop(self, pool: Pool, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(pool.config.health.interval_s)
            try:
                await pool.check(session)
            except Exception:  # a bug in one round must not end health checking
                log.exception("health round failed", extra={"pool": pool.name})
