"""Everything one gateway process shares between requests, built once from the config."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from gateway.auth import KeyRing, Tenant
from gateway.config import GatewayConfig, read_worker_key
from gateway.decision_log import DecisionLog
from gateway.disconnect import DisconnectWatch
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.queueing import PoolQueue, build_queues
from gateway.quotas import TenantLimiter
from gateway.registry import Pool, Registry
from gateway.responses_affinity import ResponseAffinity
from gateway.tracing import RequestTracer
from gateway.upstream import UpstreamPool
from gateway.upstream_headers import WorkerAuth
from policies.base import RoutingPolicy
from policies.identity import derive_secret, key_identities, served_identity
from prompt_normalizer.normalizer import Normalizer, NormalizerConfig
from prompt_normalizer.types import PUBLIC_NAMESPACE, KeyIdentity

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.policy_watch import LoadedPolicy
    from gateway.streaming import ProxyStream
    from gateway.sync.service import SyncService


@dataclass(slots=True)
class GatewayState:
    """Process-wide state. The upstream session exists between lifespan startup and shutdown."""

    config: GatewayConfig
    keyring: KeyRing
    registry: Registry
    policy: RoutingPolicy
    normalizers: dict[str, Normalizer]
    secret: bytes
    metrics: GatewayMetrics
    limiters: dict[str, TenantLimiter]
    access_log: AccessLog = field(default_factory=lambda: AccessLog(enabled=False))
    tracer: RequestTracer | None = None
    decision_log: DecisionLog | None = None  # config `decision_log.path`; None: off
    # Which worker holds each stored Responses response (affinity for previous_response_id).
    responses: ResponseAffinity = field(default_factory=lambda: ResponseAffinity(100_000, 86_400.0))
    queues: dict[str, PoolQueue] = field(default_factory=dict)  # pool name -> its waiting room
    created_s: int = 0
    session: aiohttp.ClientSession | None = None
    # Non-streamed POSTs to plain-HTTP workers (gateway/upstream.py); None: aiohttp for everything.
    lean: UpstreamPool | None = None
    fleet: Fleet | None = None  # discovery, scraping and KV events, while the lifespan runs
    sync: SyncService | None = None  # replica sync (config `sync.url`), while the lifespan runs
    draining: bool = False
    ready: bool = False
    in_flight_requests: int = 0  # completions between arrival and their last byte
    disconnects: DisconnectWatch = field(default_factory=DisconnectWatch)
    active_streams: set[ProxyStream] = field(default_factory=set)
    streams_idle: asyncio.Event = field(default_factory=asyncio.Event)

    def stream_started(self, stream: ProxyStream) -> None:
        self.active_streams.add(stream)
        self.streams_idle.clear()

    def stream_ended(self, stream: ProxyStream) -> None:
        self.active_streams.discard(stream)
        if not self.active_streams:
            self.streams_idle.set()

    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "name", type(self.policy).__name__)

    _identities: dict[tuple[str, str], tuple[KeyIdentity, KeyIdentity | None]] = field(default_factory=dict)
    _executor: concurrent.futures.ThreadPoolExecutor | None = None

    def normalizer(self, pool: Pool) -> Normalizer:
        return self.normalizers[pool.name]

    def identities(self, pool: Pool, model: str, tenant: Tenant) -> tuple[KeyIdentity, KeyIdentity | None]:
        """The key identity of a (model, tenant) and, unless the tenant is strict, its public twin
        (`policies.identity.key_identities`)."""
        cached = self._identities.get((model, tenant.name))
        if cached is not None:
            return cached
        found = key_identities(self.base_identity(pool, model), tenant)
        self._identities[(model, tenant.name)] = found
        return found

    def base_identity(self, pool: Pool, model: str) -> KeyIdentity:
        """The identity of served model id `model` (with its LoRA adapter, if it names one) in the
        public namespace (`policies.identity.served_identity`)."""
        return served_identity(self.deployment_identity(pool), model, pool.config.adapters.get(model, ""))

    def deployment_identity(self, pool: Pool) -> KeyIdentity:
        """The pool's base model with every field of the pool's `identity` section, which are all
        bound into the keys; what a KV event without `lora_name` was computed under."""
        ident = pool.config.identity
        normalizer = self.normalizers[pool.name]
        return KeyIdentity(
            model_id=base_model(pool),
            weights_version=ident.weights_version,
            tokenizer_version=ident.tokenizer_version or (normalizer.render_fingerprint or ""),
            template_version=ident.template_version,
            block_size_tokens=pool.config.block_size_tokens,
            kv_dtype=ident.kv_dtype,
            namespace=PUBLIC_NAMESPACE,
            epoch=ident.epoch,
        )

    def set_policy(self, policy: RoutingPolicy, normalizer: NormalizerConfig) -> None:
        """Swap in a reloaded policy and rebuild the normalizers that follow the policy file."""
        self.policy = policy
        self.normalizers = build_normalizers(self.config, normalizer, self.secret, self.normalizers)
        self._identities.clear()

    def normalizer_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread for tokenizer-mode canonicalization (made on first use, shut at lifespan end)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvgate-normalizer")
        return self._executor

    def close_executor(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def limiter(self, tenant: Tenant) -> TenantLimiter:
        return self.limiters[tenant.name]

    def upstream(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("upstream session used outside the app lifespan")
        return self.session


def base_model(pool: Pool) -> str:
    """The pool's first model id that is not a LoRA adapter."""
    adapters = pool.config.adapters
    return next((m for m in pool.config.models if m not in adapters), pool.config.models[0])


def build_normalizers(
    config: GatewayConfig, policy_normalizer: NormalizerConfig, secret: bytes, current: dict[str, Normalizer]
) -> dict[str, Normalizer]:
    """One normalizer per pool: the pool's own settings, else the policy file's. An unchanged
    config keeps its normalizer (and its drift memory)."""
    normalizer_secret = derive_secret(secret, "prefix_keys")
    out: dict[str, Normalizer] = {}
    for pool in config.pools:
        wanted = pool.normalizer if pool.normalizer is not None else policy_normalizer
        existing = current.get(pool.name)
        out[pool.name] = (
            existing
            if existing is not None and existing.config == wanted
            else Normalizer(wanted, normalizer_secret)
        )
    return out


def build_state(
    config: GatewayConfig,
    secret: bytes,
    policy: RoutingPolicy,
    policy_normalizer: NormalizerConfig,
    environ: Mapping[str, str] | None = None,
) -> GatewayState:
    """The process state; the pools' worker API keys are read here (from `environ`, by default
    the process's environment), so a missing one is a `ConfigError` before anything runs."""
    now_s = time.monotonic()
    env = os.environ if environ is None else environ
    auth = {pool.name: WorkerAuth(read_worker_key(pool, env)) for pool in config.pools}
    registry = Registry(config.pools, auth)
    metrics = GatewayMetrics()
    weights = {t.name: t.weight for t in config.tenants}
    return GatewayState(
        config=config,
        keyring=KeyRing(config.tenants, secret),
        registry=registry,
        policy=policy,
        normalizers=build_normalizers(config, policy_normalizer, secret, {}),
        secret=secret,
        metrics=metrics,
        queues=build_queues(registry.pools, weights, metrics),
        limiters={t.name: TenantLimiter(t.quotas, now_s) for t in config.tenants},
        access_log=AccessLog(enabled=logging.getLogger("kvgate.access").isEnabledFor(logging.INFO)),
        tracer=RequestTracer.from_config(config.tracing) if config.tracing.enabled else None,
        decision_log=(
            DecisionLog(config.decision_log.path, config.decision_log.max_records)
            if config.decision_log.path
            else None
        ),
        responses=ResponseAffinity(config.responses.affinity_max_entries, config.responses.affinity_ttl_s),
        created_s=int(time.time()),
    )


def make_session(config: GatewayConfig) -> aiohttp.ClientSession:
    """The one upstream client of the process: bounded connection pool, keep-alive, no cookies."""
    connector = aiohttp.TCPConnector(
        limit=config.upstream.max_connections,
        limit_per_host=config.upstream.max_connections_per_worker,
        keepalive_timeout=config.upstream.keepalive_timeout_s,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=120.0),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


class PolicySwap:
    """The policy watcher's swap callback, bound to the gateway state once it exists."""

    def __init__(self) -> None:
        self.state: GatewayState | None = None
        # Run after each swap, e.g. to give the new policy the precise-mode token hasher.
        self.after_swap: list[Callable[[GatewayState, RoutingPolicy], object]] = []

    def __call__(self, loaded: LoadedPolicy) -> None:
        if self.state is None:
            raise RuntimeError("policy reloaded before the gateway state exists")
        self.state.set_policy(loaded.policy, loaded.config.normalizer)
        for hook in self.after_swap:
            hook(self.state, loaded.policy)
