"""The process's upstream clients, which exist while the app lifespan runs, and the bound on the
stored-response requests they carry outside the request cap (`StoredPlaces`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from gateway.config import UpstreamConfig
from gateway.lifecycle import RequestCap, TenantPlaces
from gateway.upstream import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_STREAM_BUFFER_BYTES,
    AnswerBudget,
    StreamBuffers,
    UpstreamPool,
)
from gateway.upstream_conn import MAX_ANSWER_HEAD_BYTES


class StoredPlace:
    """One stored-response request's place at a worker and in the process (`StoredPlaces.take`),
    given back once by `give_back` (later calls do nothing)."""

    __slots__ = ("_owner", "_process", "_worker", "_worker_url")

    def __init__(
        self, owner: StoredPlaces, worker_url: str, process: TenantPlaces, worker: TenantPlaces
    ) -> None:
        self._owner = owner
        self._worker_url = worker_url
        self._process: TenantPlaces | None = process
        self._worker = worker

    def give_back(self) -> None:
        if self._process is None:
            return
        self._process.give_back()
        self._process = None
        self._worker.give_back()
        self._owner.forget_if_idle(self._worker_url, self._worker.cap)


class StoredPlaces:
    """The `GET`s and `cancel`s of stored responses (`/v1/responses/{id}`), and the holder
    search's `GET`s, in flight through the shared session. They are outside
    `limits.max_in_flight_requests` (no body; a streamed retrieve may stay open as long as its
    background response runs), so they are bounded here, as `lifecycle.RequestCap` bounds the
    proxied requests: each worker's at a quarter of `upstream.max_connections_per_worker`
    (`per_worker`, at least 1) and the process's at a quarter of `upstream.max_connections`, and at
    either cap a tenant below its share still gets a place, up to twice the cap in all. So the
    stored-response requests of all tenants hold at most half of a worker's connections, and one
    tenant's alone at most a quarter (below 4 connections per worker the cap of 1 rounds these
    up): one tenant's open streams cannot take a worker's connection pool from every tenant's
    proxied requests. Invariant: `_workers` holds a cap for exactly the
    workers with a place held (so its size is bounded by the places held, never by the workers
    ever asked)."""

    __slots__ = ("_weights", "_workers", "per_worker", "process")

    def __init__(self, config: UpstreamConfig, weights: Mapping[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self.per_worker = max(1, config.max_connections_per_worker // 4)
        self.process = RequestCap(max(1, config.max_connections // 4), self._weights)
        self._workers: dict[str, RequestCap] = {}

    def take(self, worker_url: str, tenant: str) -> StoredPlace | None:
        """A place for one request of `tenant` to the worker at `worker_url`, or None (nothing
        taken) when the process's cap or the worker's refuses it."""
        process = self.process.tenant(tenant)
        if not process.take():
            return None
        cap = self._workers.get(worker_url)
        if cap is None:
            cap = self._workers[worker_url] = RequestCap(self.per_worker, self._weights)
        worker = cap.tenant(tenant)
        if not worker.take():  # a cap that refuses holds a place: it stays in `_workers`
            process.give_back()
            return None
        return StoredPlace(self, worker_url, process, worker)

    def held(self, worker_url: str) -> int:
        """The places held at one worker."""
        cap = self._workers.get(worker_url)
        return cap.held if cap is not None else 0

    def forget_if_idle(self, worker_url: str, cap: RequestCap) -> None:
        if cap.held == 0 and self._workers.get(worker_url) is cap:
            del self._workers[worker_url]

    def check_invariants(self) -> None:
        self.process.check_invariants()
        for cap in self._workers.values():
            cap.check_invariants()
            assert cap.held > 0, "a worker without places held is still kept"
        assert self.process.held == sum(cap.held for cap in self._workers.values())


@dataclass(slots=True)
class Transport:
    """The one aiohttp session of the process for client traffic (streams, https workers,
    stored responses, render), the gateway's own session for its checks of the workers
    (`probes`: health, model cards, load scrapes, canaries), and the lean client for non-streamed
    POSTs to plain-HTTP workers (`gateway/upstream.py`; None: aiohttp carries everything). All are
    made by `open` at lifespan startup and closed by `close` at its end. Both clients read whole
    answers within `answers`, the process's budget for them (`limits.max_buffered_answer_bytes`),
    which outlives them; the lean client's streams count their unread bytes in `streams`
    (`limits.max_buffered_stream_bytes`; aiohttp keeps its own small per-stream buffer).
    `stored` bounds the stored-response requests on the session."""

    session: aiohttp.ClientSession | None = None
    probes: aiohttp.ClientSession | None = None
    lean: UpstreamPool | None = None
    answers: AnswerBudget = field(default_factory=lambda: AnswerBudget(DEFAULT_BUDGET_BYTES))
    streams: StreamBuffers = field(default_factory=lambda: StreamBuffers(DEFAULT_STREAM_BUFFER_BYTES))
    stored: StoredPlaces = field(default_factory=lambda: StoredPlaces(UpstreamConfig()))

    def open(self, config: UpstreamConfig) -> aiohttp.ClientSession:
        self.session = make_session(config)
        self.probes = make_probe_session(config)
        self.lean = UpstreamPool(
            config.max_connections_per_worker,
            config.keepalive_timeout_s,
            max_open_per_worker=config.max_connections_per_worker,
            budget=self.answers,
            streams=self.streams,
        )
        return self.session

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.probes is not None:
            await self.probes.close()
            self.probes = None
        if self.lean is not None:
            self.lean.close()
            self.lean = None

    def upstream(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("upstream session used outside the app lifespan")
        return self.session

    def prober(self) -> aiohttp.ClientSession:
        """The session of the gateway's own checks of its workers (`make_probe_session`)."""
        if self.probes is None:
            raise RuntimeError("probe session used outside the app lifespan")
        return self.probes


# A worker's answer carries about a dozen headers, a proxy in front of it a few more; aiohttp's
# default allows 128, each up to the line bound.
MAX_ANSWER_HEADERS = 64


def make_session(config: UpstreamConfig) -> aiohttp.ClientSession:
    """The one upstream client of the process: bounded connection pool, keep-alive, no cookies.
    An answer's status line and each of its headers may be as long as the lean client's whole
    head (`MAX_ANSWER_HEAD_BYTES`), not aiohttp's default 8 KB: vLLM's binary embeddings carry
    every input's offsets in one `metadata` header. aiohttp bounds the head per line, not in
    total, so the number of headers is bounded too (`MAX_ANSWER_HEADERS`): at most that many
    lines of that size."""
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=config.max_connections_per_worker,
        keepalive_timeout=config.keepalive_timeout_s,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=120.0),
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        max_line_size=MAX_ANSWER_HEAD_BYTES,
        max_field_size=MAX_ANSWER_HEAD_BYTES,
        max_headers=MAX_ANSWER_HEADERS,
    )


# A worker's checks at once: a health check and a model-card read per pool it serves, a scrape, a
# canary. They are few and short (each within its own timeout), so a handful of connections.
PROBE_CONNECTIONS_PER_WORKER = 8


def make_probe_session(config: UpstreamConfig) -> aiohttp.ClientSession:
    """The session of the gateway's own checks of its workers (health, model cards, scrapes,
    canaries), apart from the one client traffic uses: a check's timeout counts the wait for a
    pooled connection, so on the shared pool a client's open streams (`limit_per_host`) made a
    healthy worker's checks time out, and took it out of rotation for every tenant. Its own small
    pool per worker (`PROBE_CONNECTIONS_PER_WORKER`); no bound in all (`limit=0`), as a bound
    would let many workers' checks queue behind each other: the workers known bound it."""
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=PROBE_CONNECTIONS_PER_WORKER,
        keepalive_timeout=config.keepalive_timeout_s,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=120.0),  # as `make_session`
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        # The answer-head bounds of `make_session`: a worker (or a proxy in front of it) whose
        # answers pass aiohttp's 8,190-byte default line would fail every check, and be taken out
        # of rotation, while client traffic to it is served.
        max_line_size=MAX_ANSWER_HEAD_BYTES,
        max_field_size=MAX_ANSWER_HEAD_BYTES,
        max_headers=MAX_ANSWER_HEADERS,
    )
