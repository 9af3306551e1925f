"""Keeping the registry's view of the workers current: discovery (static, DNS or Kubernetes),
metric scraping and KV-event subscriptions, all started and stopped by the app lifespan.

Discovery reports worker-set changes; each change updates the pool, starts or stops the worker's
scrape loop and KV-event subscription, and triggers an immediate health check so a new worker
becomes routable without waiting a whole health interval.

The pools' discoveries start together, so a slow API server delays the start once, not once per
pool. The start waits only a few seconds for the first snapshots (the kubelet probes nothing until
it is over); `discovering()` names the pools whose first set is still unknown, or whose first
workers' health check has not yet answered, and readiness waits for it to be empty: a gateway with
an empty pool that would be full a moment later must not take traffic.

The policy is told of every worker that joins or leaves a pool, and of every one that health
checks take down or see back after being down (`policies.pools.FollowsWorkers`): what it keeps of a
worker describes the process at that URL, and a new process (a restart in place, a pod given a
departed pod's IP) starts with an empty cache. A down worker cannot be told from a restarting one,
so both verdicts clear its holdings: the first drops what the old process held, the second what
was learned of it while it was down (requests it finished while draining, say). A worker that was
only unreachable loses its holdings too, which costs hits until they are learned again, never a
wrong answer; predicting hits on an empty cache would send continuations where they recompute
everything.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping

import aiohttp

from gateway.config import GatewayConfig
from gateway.config.pool import PoolConfig
from gateway.discovery import Discovery, WatchingSource, WorkerSetChange
from gateway.file_discovery import FileWorkers
from gateway.k8s.source import PodWatcher
from gateway.kv_event_types import KvEventEndpoint, endpoint_for_worker
from gateway.kv_events import KvEventSubscriber
from gateway.metrics.families import HotCounter
from gateway.registry import Pool, Registry
from gateway.routing import Routing
from gateway.scrape import MetricsScraper, ScrapeConfig, ScrapeResult
from gateway.worker import HealthChange
from gateway.worker_sources import DnsWorkers, StaticWorkers, WorkerSource
from policies.base import KvEvent, WorkerId
from policies.pools import FollowsWorkers

log = logging.getLogger("kvgate.fleet")

# How long the start waits for the pools' first snapshots, all pools together: nothing answers the
# kubelet's probes until the start is over, and readiness waits for what comes later.
FIRST_WAIT_S = 5.0


def worker_source(config: PoolConfig) -> WorkerSource | WatchingSource:
    if config.dns is not None:
        d = config.dns
        return DnsWorkers(d.name, d.port, scheme=d.scheme)
    if config.kubernetes is not None:
        return PodWatcher(config.kubernetes)
    if config.workers_file is not None:
        f = config.workers_file
        return FileWorkers(f.path, refresh_s=f.refresh_s, roles=config.takes_roles)
    return StaticWorkers(config.static_urls)


class Fleet:
    """Owns the per-pool discovery loops, the metrics scraper and the KV-event subscriber.
    `session` is the gateway's session for its own checks (`transport.make_probe_session`): the
    scrapes and the first health checks of new workers, never waiting behind client traffic."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        routing: Routing,
        salt_namespaces: Mapping[str, str],
        session: aiohttp.ClientSession,
    ) -> None:
        self._registry = registry
        self._routing = routing  # the policy's one holder: a reload may swap it between two events
        self._session = session
        self._scraper: MetricsScraper | None = None
        if config.scrape.enabled:
            s = config.scrape
            self._scraper = MetricsScraper(
                ScrapeConfig(interval_s=s.interval_s, timeout_s=s.timeout_s, max_age_s=s.max_age_s),
                session=session,
                on_update=self._on_scrape,
            )
            for pool in registry.pools.values():
                pool.metrics_max_age_s = s.max_age_s
        self._kv: KvEventSubscriber | None = None
        if any(p.subscribes_kv_events for p in config.pools):
            # Events carry the chain's cache_salt; resolve it to the namespace the gateway salted it for.
            self._kv = KvEventSubscriber(
                on_event=self._on_kv_event,
                salt_namespaces=salt_namespaces,
                wanted=lambda: routing.kv_events_used,
            )
        self._discoveries: dict[str, Discovery] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._settled: set[str] = set()  # pools past `discovering()` (for good)
        self._first_checks: dict[str, asyncio.Task[None]] = {}  # of pools not yet settled

    async def start(self) -> None:
        if self._scraper is not None:
            await self._scraper.start()
        if self._kv is not None:
            await self._kv.start()
        starts = []
        for pool in self._registry.pools.values():
            pool.on_health = functools.partial(self._health_changed, pool)
            dns = pool.config.dns
            metrics = self._routing.metrics
            discovery = Discovery(
                worker_source(pool.config),
                interval_s=dns.refresh_s if dns is not None else 5.0,
                empty_after=dns.empty_after if dns is not None else 2,
                empty_after_s=dns.empty_after_s if dns is not None else 0.0,
                on_error=functools.partial(_count_error, metrics.discovery_errors, pool.name),
                on_resync=metrics.discovery_resyncs.labels(pool.name).inc,
                first_wait_s=FIRST_WAIT_S,
                name=pool.name,
            )
            self._discoveries[pool.name] = discovery
            # A pool whose first discovery fails (an API server down at start, a Role that may not
            # list pods) reports 0 workers, not nothing, so that an alert on no workers sees it.
            metrics.discovered_workers.labels(pool.name).set(0)
            starts.append(discovery.start(functools.partial(self._apply, pool)))
        # Together: each may wait for its API server (`Discovery.first_wait_s`). Every start runs
        # to its end before a setup error is raised, so that `stop` finds no start half done.
        for result in await asyncio.gather(*starts, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    def discovering(self) -> list[str]:
        """The pools whose first set of workers is not yet known (`Discovery.settled`), or whose
        first workers' health check is still under way: what readiness waits for. A pool leaves
        this list for good."""
        for name, discovery in self._discoveries.items():
            if name in self._settled or not discovery.settled:
                continue
            check = self._first_checks.get(name)
            if check is None or check.done():
                self._settled.add(name)
                self._first_checks.pop(name, None)
        return [name for name in self._discoveries if name not in self._settled]

    async def stop(self) -> None:
        for discovery in self._discoveries.values():
            await discovery.stop()
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._kv is not None:
            await self._kv.stop()
        if self._scraper is not None:
            await self._scraper.stop()

    def _apply(self, pool: Pool, change: WorkerSetChange) -> None:
        roles = {url: change.details_of(url).role for url in change.current}
        pool.set_urls(sorted(change.current), roles)
        self._routing.metrics.discovered_workers.labels(pool.name).set(len(change.current))
        follows = self._follower()
        for url in change.removed:
            worker = WorkerId(url)
            if follows is not None:
                follows.worker_left(pool.name, worker)
            if not self._registry.workers_at(worker):
                if self._scraper is not None:
                    self._scraper.remove(worker)
                if self._kv is not None:
                    self._kv.remove(worker)
        for url in change.added:
            worker = WorkerId(url)
            if follows is not None:
                follows.worker_joined(pool.name, worker)  # before its KV events can arrive
            if self._scraper is not None and self._scraper.state(worker) is None:
                self._scraper.add(worker, url, pool.auth.headers)
            self._subscribe(pool, change, url)
        for url in change.changed:  # a pod's role or KV-event endpoint changed in place
            self._subscribe(pool, change, url)
        if change.added:
            # New workers are unknown (not routable) until checked: check them now.
            task = asyncio.ensure_future(pool.check(self._session))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            if pool.name not in self._settled:
                self._first_checks[pool.name] = task

    def _follower(self) -> FollowsWorkers | None:
        """The current policy, if it keeps state per worker (a reload may have swapped it)."""
        policy = self._routing.policy
        return policy if isinstance(policy, FollowsWorkers) else None

    def _health_changed(self, pool: Pool, worker: WorkerId, change: HealthChange) -> None:
        """A worker that went down, or came back after being down, may be a new process: the
        policy clears what it holds (module docstring). Its first verdict up changes nothing."""
        if change is not HealthChange.UP:
            self._reset(pool.name, worker)

    def _reset(self, pool: str, worker: WorkerId) -> None:
        follows = self._follower()
        if follows is None:
            return
        try:
            follows.worker_reset(pool, worker)
        except Exception:  # a policy's bug must not end the round that reported it
            log.exception("policy failed to reset a worker", extra={"pool": pool, "worker": worker})

    def _subscribe(self, pool: Pool, change: WorkerSetChange, url: str) -> None:
        """Follow the worker's KV events: at the endpoint discovery found for it, else the pool's."""
        cfg = pool.config
        endpoint = change.details_of(url).kv_events_endpoint
        if endpoint is None and cfg.kv_events_endpoint is not None:
            endpoint = endpoint_for_worker(cfg.kv_events_endpoint, url)
        if self._kv is None:
            return
        worker = WorkerId(url)
        subscribed = self._kv.stream_stats(worker)
        if endpoint is None or endpoint not in subscribed:
            if subscribed:
                self._kv.remove(worker)
            if endpoint is None:
                return
        else:
            return  # already following this endpoint
        replay = cfg.kv_events_replay_endpoint
        self._kv.add(
            KvEventEndpoint(
                worker=worker,
                endpoint=endpoint,
                replay_endpoint=endpoint_for_worker(replay, url) if replay else None,
                topic=cfg.kv_events_topic,
            )
        )

    @property
    def scraper(self) -> MetricsScraper | None:
        return self._scraper

    @property
    def kv_events(self) -> KvEventSubscriber | None:
        return self._kv

    def _on_scrape(self, worker: WorkerId, result: ScrapeResult) -> None:
        for pool in self._registry.pools.values():
            entry = pool.workers.get(worker)
            if entry is None:
                continue
            entry.note_metrics(result.metrics, result.scraped_at_s)
            if result.restarted:
                # A new process at the URL, quicker than health checks could see it down: what
                # the policy holds of the old one went with its KV cache.
                log.info("worker restarted in place", extra={"pool": pool.name, "worker": worker})
                self._routing.metrics.worker_restarts.labels(pool.name).inc()
                self._reset(pool.name, worker)

    def _on_kv_event(self, worker: WorkerId, event: KvEvent) -> None:
        self._routing.policy.on_kv_event(worker, event, time.monotonic())


def _count_error(counter: HotCounter, pool: str, reason: str) -> None:
    counter.labels(pool, reason).inc()
