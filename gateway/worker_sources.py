"""Where a pool's workers are when asked: a static URL list, or a DNS name re-resolved periodically
(`gateway.discovery` follows either, and sources that push their own updates).

A Kubernetes headless Service resolves to one A/AAAA record per ready pod, so re-resolving its name
every few seconds follows scale-ups, restarts and rollouts without talking to the API server. Each
address becomes `scheme://IP:port`; a dual-stack Service answers both records for each pod, and
only the family of the first address is kept. Resolution goes through the event loop's `getaddrinfo` (a
thread, never blocking the loop) and can be replaced by any async resolver for tests.

Two kinds of unsuccessful lookup are told apart by the `socket.gaierror` that `getaddrinfo` raises:
- a definite answer that the name has no addresses: `EAI_NONAME` (NXDOMAIN, which is what cluster
  DNS answers for a headless Service with no ready pod, or one that was deleted) or `EAI_NODATA`
  (the name exists without an A/AAAA record). It means the same as an empty list of addresses;
- anything else (`EAI_AGAIN`: a timeout or SERVFAIL, `EAI_FAIL`, our own timeout) says nothing about
  the workers. The last known set stays: a DNS hiccup must not empty a pool.
An answer of no addresses empties the pool once it has been given `empty_after` times in a row
(2 by default; answers with addresses reset the count, failed lookups neither count nor reset)
over at least `empty_after_s` from the first of them (10 s in a pool's `dns` config). The time matters as much
as the count: a resolver caches a negative answer (cluster DNS for the SOA's TTL, 5 s in
CoreDNS's `kubernetes` plugin; NodeLocal DNSCache in front of it for its own `denial` TTL), so
lookups closer together than that can be one answer given again.
Keeping the addresses of pods that are gone would route requests to IPs that another pod may be
given next, while a single negative answer can be a flap (one DNS replica whose view of the
Endpoints lags, a negative answer cached while they were rewritten): emptying the pool on it would
fail every request with "no healthy worker" and drop what the policy learned of the workers until
the next lookup. One more refresh interval on the old set costs little, since health checks stop
routing to addresses that no longer answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger("kvgate.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]

# `getaddrinfo`'s errors that answer "this name has no addresses" (NXDOMAIN, or no A/AAAA record),
# as opposed to failing to get an answer (`EAI_AGAIN`, `EAI_FAIL`, ...).
NO_ADDRESS_ERRORS = frozenset({socket.EAI_NONAME, socket.EAI_NODATA})


def worker_url(scheme: str, address: str, port: int) -> str:
    """`http://10.0.0.7:8000`, `http://[fd00::7]:8000`."""
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


async def resolve_with_loop(host: str, port: int) -> list[str]:
    """Every A/AAAA address of `host`, via the running loop's `getaddrinfo` (runs in a thread)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            out.append(str(ipaddress.ip_address(str(sockaddr[0]).split("%")[0])))
    return out


class WorkerSource:
    """Something that can say, when asked, which worker URLs a pool has right now."""

    async def resolve(self) -> frozenset[str]:
        raise NotImplementedError

    @property
    def periodic(self) -> bool:
        """Whether `resolve()` may give a different answer later (static lists never do)."""
        return False


class StaticWorkers(WorkerSource):
    """A fixed list of base URLs from the config."""

    def __init__(self, urls: Iterable[str]) -> None:
        cleaned = frozenset(u.rstrip("/") for u in urls)
        for u in cleaned:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://: {u!r}")
        self._urls = cleaned

    async def resolve(self) -> frozenset[str]:
        return self._urls


class DnsWorkers(WorkerSource):
    """All addresses of a DNS name (e.g. a headless Service `vllm.llm.svc.cluster.local`) at one port."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        scheme: str = "http",
        resolver: Resolver = resolve_with_loop,
        timeout_s: float = 2.0,
        max_workers: int = 1024,
    ) -> None:
        if not host:
            raise ValueError("DNS worker source needs a host name")
        if not 0 < port < 65536:
            raise ValueError(f"port out of range: {port}")
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https: {scheme!r}")
        self.host, self.port, self.scheme = host, port, scheme
        self._resolver = resolver
        self._timeout_s = timeout_s
        self._max_workers = max_workers

    @property
    def periodic(self) -> bool:
        return True

    async def resolve(self) -> frozenset[str]:
        """The workers the name has now; empty when DNS answers that it has none (module docstring).
        Raises `OSError` or `TimeoutError` when the lookup fails without such an answer."""
        try:
            async with asyncio.timeout(self._timeout_s):
                addresses = await self._resolver(self.host, self.port)
        except socket.gaierror as exc:
            if exc.errno not in NO_ADDRESS_ERRORS:
                raise
            addresses = []
        if addresses:
            # A dual-stack headless Service answers an A and an AAAA record for each pod: one
            # family only (the first address's, the system's preference), or each pod is two workers.
            v6 = ":" in addresses[0]
            addresses = [a for a in addresses if (":" in a) == v6]
        urls = sorted({worker_url(self.scheme, a, self.port) for a in addresses})
        if len(urls) > self._max_workers:
            log.warning("%s resolved to %d addresses; keeping %d", self.host, len(urls), self._max_workers)
            urls = urls[: self._max_workers]
        return frozenset(urls)
