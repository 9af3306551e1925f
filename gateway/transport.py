"""The process's upstream clients, which exist while the app lifespan runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from gateway.config import UpstreamConfig
from gateway.upstream import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_STREAM_BUFFER_BYTES,
    AnswerBudget,
    StreamBuffers,
    UpstreamPool,
)
from gateway.upstream_conn import MAX_ANSWER_HEAD_BYTES


@dataclass(slots=True)
class Transport:
    """The one aiohttp session of the process for client traffic (streams, https workers,
    render), the gateway's own session for its checks of the workers
    (`probes`: health, model cards, load scrapes, canaries), and the lean client for non-streamed
    POSTs to plain-HTTP workers (`gateway/upstream.py`; None: aiohttp carries everything). All are
    made by `open` at lifespan startup and closed by `close` at its end. Both clients read whole
    answers within `answers`, the process's budget for them (`limits.max_buffered_answer_bytes`),
    which outlives them; the lean client's streams count their unread bytes in `streams`
    (`limits.max_buffered_stream_bytes`; aiohttp keeps its own small per-stream buffer)."""

    session: aiohttp.ClientSession | None = None
    probes: aiohttp.ClientSession | None = None
    lean: UpstreamPool | None = None
    answers: AnswerBudget = field(default_factory=lambda: AnswerBudget(DEFAULT_BUDGET_BYTES))
    streams: StreamBuffers = field(default_factory=lambda: StreamBuffers(DEFAULT_STREAM_BUFFER_BYTES))

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
    )
