"""Where a pool's workers are: a static URL list, or a DNS name re-resolved periodically.

A Kubernetes headless Service resolves to one A/AAAA record per ready pod, so re-resolving its name
every few seconds follows scale-ups, restarts and rollouts without talking to the API server. Each
address becomes `scheme://IP:port`. Resolution goes through the event loop's `getaddrinfo` (a
thread, never blocking the loop) and can be replaced by any async resolver for tests.

A failed resolution keeps the last known set: a DNS hiccup must not empty a pool. A successful
answer with no addresses (every pod gone) does empty it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("kvgate.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class WorkerSetChange:
    """The difference between two successive views of a pool: URLs added and removed."""

    added: frozenset[str]
    removed: frozenset[str]
    current: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def diff_workers(old: frozenset[str], new: frozenset[str]) -> WorkerSetChange:
    return WorkerSetChange(added=new - old, removed=old - new, current=new)


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
    """Something that can say which worker URLs a pool has right now."""

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
        async with asyncio.timeout(self._timeout_s):
            addresses = await self._resolver(self.host, self.port)
        urls = sorted({worker_url(self.scheme, a, self.port) for a in addresses})
        if len(urls) > self._max_workers:
            log.warning("%s resolved to %d addresses; keeping %d", self.host, len(urls), self._max_workers)
            urls = urls[: self._max_workers]
        return frozenset(urls)


@dataclass(frozen=True, slots=True)
class DiscoveryStatus:
    """What the admin API shows for one pool's discovery."""

    workers: frozenset[str]
    resolutions: int
    failures: int
    last_error: str | None


class Discovery:
    """Keeps a pool's worker set current and reports each change.

    Use `watch()` as an async iterator, or `start(on_change)` / `stop()` from the app lifespan. The
    first change reported is the initial set (everything `added`).
    """

    def __init__(self, source: WorkerSource, interval_s: float = 5.0) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._source = source
        self._interval_s = interval_s
        self._current: frozenset[str] = frozenset()
        self._resolutions = 0
        self._failures = 0
        self._last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def current(self) -> frozenset[str]:
        return self._current

    def status(self) -> DiscoveryStatus:
        return DiscoveryStatus(self._current, self._resolutions, self._failures, self._last_error)

    async def refresh(self) -> WorkerSetChange:
        """Resolve once; on failure keep the last set and return an empty change."""
        try:
            new = await self._source.resolve()
        except (OSError, TimeoutError, ValueError) as exc:
            self._failures += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "worker discovery failed, keeping %d workers: %s", len(self._current), self._last_error
            )
            return diff_workers(self._current, self._current)
        self._resolutions += 1
        self._last_error = None
        change = diff_workers(self._current, new)
        self._current = new
        if change:
            log.info("workers changed: +%d -%d = %d", len(change.added), len(change.removed), len(new))
        return change

    async def watch(self) -> AsyncIterator[WorkerSetChange]:
        """Yield every non-empty change, forever for periodic sources, once for static ones."""
        while True:
            change = await self.refresh()
            if change:
                yield change
            if not self._source.periodic:
                return
            await asyncio.sleep(self._interval_s)

    async def start(self, on_change: Callable[[WorkerSetChange], None]) -> WorkerSetChange:
        """Resolve now (so the pool starts populated), then keep watching in a background task."""
        first = await self.refresh()
        on_change(first)
        if self._source.periodic:
            self._task = asyncio.create_task(self._follow(on_change), name="discovery")
        return first

    async def _follow(self, on_change: Callable[[WorkerSetChange], None]) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            change = await self.refresh()
            if change:
                try:
                    on_change(change)
                except Exception:
                    log.exception("worker-set change handler failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
