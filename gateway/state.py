"""Everything one gateway process shares between requests, built once from the config."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from gateway.auth import KeyRing, Tenant, derive_secret
from gateway.config import GatewayConfig
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.quotas import TenantLimiter
from gateway.registry import Registry
from policies.base import RoutingPolicy
from prompt_normalizer.normalizer import Normalizer

if TYPE_CHECKING:
    from gateway.streaming import ProxyStream


@dataclass(slots=True)
class GatewayState:
    """Process-wide state. The upstream session exists between lifespan startup and shutdown."""

    config: GatewayConfig
    keyring: KeyRing
    registry: Registry
    policy: RoutingPolicy
    normalizers: dict[str, Normalizer]
    metrics: GatewayMetrics
    limiters: dict[str, TenantLimiter]
    access_log: AccessLog = field(default_factory=lambda: AccessLog(enabled=False))
    created_s: int = 0
    session: aiohttp.ClientSession | None = None
    draining: bool = False
    ready: bool = False
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

    def limiter(self, tenant: Tenant) -> TenantLimiter:
        return self.limiters[tenant.name]

    def upstream(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("upstream session used outside the app lifespan")
        return self.session


def build_state(config: GatewayConfig, secret: bytes, policy: RoutingPolicy) -> GatewayState:
    now_s = time.monotonic()
    normalizer_secret = derive_secret(secret, "prefix_keys")
    return GatewayState(
        config=config,
        keyring=KeyRing(config.tenants, secret),
        registry=Registry(config.pools),
        policy=policy,
        normalizers={p.name: Normalizer(p.normalizer, normalizer_secret) for p in config.pools},
        metrics=GatewayMetrics(),
        limiters={t.name: TenantLimiter(t.quotas, now_s) for t in config.tenants},
        access_log=AccessLog(enabled=logging.getLogger("kvgate.access").isEnabledFor(logging.INFO)),
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
