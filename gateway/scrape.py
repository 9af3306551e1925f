"""Scrape a worker's Prometheus `/metrics` page into a typed record of the numbers routing uses.

vLLM (`vllm/v1/metrics/loggers.py`): `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (0-1; `vllm:gpu_cache_usage_perc` before 0.9), the counters
`vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens; `gpu_` prefixed in old
builds) and the info gauge `vllm:cache_config_info{block_size=..., num_gpu_blocks=...}`.
SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`,
`sglang:max_total_num_tokens`, `sglang:prompt_tokens_total`, `sglang:cached_tokens_total`.

A worker behind data parallelism reports one series per engine (label `engine`): counts and
capacities are summed, usage is the maximum (the fullest engine is the one that will preempt).
The parser reads only the families it knows and ignores every other line, valid or not.

A worker restarted in place (same URL, a new process) starts with an empty KV cache. Health checks
see it only if it stays down for `failures_to_down` checks; a scrape sees it at once: its
`process_start_time_seconds` (prometheus_client's process collector) changed, or one of the
counters above went down (Prometheus reads a counter that decreases as a reset the same way).
`worker_restarted` is that test; the scraper flags such a result (`ScrapeResult.restarted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from policies.base import WorkerId

log = logging.getLogger("kvgate.scrape")


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """What one scrape of a worker said; a field is None when the page did not carry it."""

    engine: str | None = None
    num_requests_waiting: int | None = None
    num_requests_running: int | None = None
    kv_cache_usage: float | None = None
    num_gpu_blocks: int | None = None
    block_size_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    prefix_cache_queries_tokens: float | None = None
    prefix_cache_hits_tokens: float | None = None
    process_start_s: float | None = None  # `process_start_time_seconds`, Unix seconds


_COUNTERS = ("prefix_cache_queries_tokens", "prefix_cache_hits_tokens")


def worker_restarted(before: WorkerMetrics, after: WorkerMetrics) -> bool:
    """Whether `after` comes from another process than `before`: a new process start time, or a
    counter lower than it was."""
    started, now = before.process_start_s, after.process_start_s
    if started is not None and now is not None and started != now:
        return True
    for name in _COUNTERS:
        old, new = getattr(before, name), getattr(after, name)
        if old is not None and new is not None and new < old:
            return True
    return False


@dataclass(frozen=True, slots=True)
class Sample:
    """One parsed exposition line."""

    name: str
    labels: Mapping[str, str]
    value: float


# family name -> field; the first listed name that is present wins (newer names first).
_VLLM_FIELDS: dict[str, tuple[str, ...]] = {
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_requests_running": ("vllm:num_requests_running",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
}
_SGLANG_FIELDS: dict[str, tuple[str, ...]] = {
    "num_requests_waiting": ("sglang:num_queue_reqs",),
    "num_requests_running": ("sglang:num_running_reqs",),
    "kv_cache_usage": ("sglang:token_usage",),
    "kv_capacity_tokens": ("sglang:max_total_num_tokens",),
    "prefix_cache_queries_tokens": ("sglang:prompt_tokens_total",),
    "prefix_cache_hits_tokens": ("sglang:cached_tokens_total",),
}
_START = "process_start_time_seconds"
_MAX_FIELDS = frozenset({"kv_cache_usage"})
_INT_FIELDS = frozenset({"num_requests_waiting", "num_requests_running", "kv_capacity_tokens"})
_WANTED = frozenset(
    {n for names in (*_VLLM_FIELDS.values(), *_SGLANG_FIELDS.values()) for n in names}
    | {"vllm:cache_config_info", _START}
)


# One `key="value"` of a label set, after any separating spaces and commas. Possessive
# quantifiers: a broken label set fails in one pass, never by backtracking.
_LABEL = re.compile(r'[ ,]*+([^=]*+)="([^"\\]*+(?:\\.[^"\\]*+)*+)"')
# Stands in for an escaped backslash while the other escapes are read: a lone surrogate, which
# text decoded from bytes never holds.
_HELD = "\ud800"


def _unescape(raw: str) -> str:
    """The exposition format's escapes, read left to right: `\\\\`, `\\"`, `\\n` (any other
    escaped character stands for itself). Whole-string replaces only, so no Python code runs per
    escape: a page full of them costs what any other page of its size costs."""
    if _HELD in raw:  # not from a page (those are decoded from bytes): take it apart instead
        return "\\".join(p.replace("\\n", "\n").replace("\\", "") for p in raw.split("\\\\"))
    # Once escaped backslashes are held aside, every backslash left escapes the character after it.
    return raw.replace("\\\\", _HELD).replace("\\n", "\n").replace("\\", "").replace(_HELD, "\\")


def _parse_labels(text: str) -> dict[str, str] | None:
    """Parse `a="x",b="y\\"z"`; None when the label set is malformed."""
    labels: dict[str, str] = {}
    pos = 0
    while (m := _LABEL.match(text, pos)) is not None:
        key, raw = m.groups()
        labels[key.strip()] = _unescape(raw) if "\\" in raw else raw
        pos = m.end()
    return labels if not text[pos:].strip(" ,") else None


def parse_samples(text: str, wanted: frozenset[str] = _WANTED) -> Iterable[Sample]:
    """Yield the samples of the `wanted` families; skip comments, other families and broken lines."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            close = line.rfind("}")
            if close < brace or name not in wanted:
                continue
            rest = line[close + 1 :].split()
            labels = _parse_labels(line[brace + 1 : close])
        else:
            name = line[:space]
            rest = line[space + 1 :].split()
            labels = {}
        if name not in wanted or labels is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            # Every family read here is a count, a capacity or a fraction: a negative or
            # non-finite value (`+Inf`, `1e400`) is a broken exporter, not a number to route on.
            continue
        yield Sample(name, labels, value)


def _label_int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        value = int(labels[key])
    except (KeyError, ValueError):
        return None  # vLLM writes "None" before the KV cache is profiled
    return value if value >= 0 else None


def parse_metrics(text: str) -> WorkerMetrics:
    """Reduce a Prometheus text page to a `WorkerMetrics` (empty when nothing is recognised)."""
    by_name: dict[str, list[Sample]] = {}
    for s in parse_samples(text):
        by_name.setdefault(s.name, []).append(s)
    engine = "vllm" if any(n.startswith("vllm:") for n in by_name) else None
    if engine is None and any(n.startswith("sglang:") for n in by_name):
        engine = "sglang"
    if engine is None:
        return WorkerMetrics()
    values: dict[str, float | int | None] = {}
    for fld, names in (_VLLM_FIELDS if engine == "vllm" else _SGLANG_FIELDS).items():
        samples = next((by_name[n] for n in names if n in by_name), None)
        if not samples:
            continue
        total = max(s.value for s in samples) if fld in _MAX_FIELDS else sum(s.value for s in samples)
        if not math.isfinite(total):
            continue  # finite samples can still sum to infinity
        values[fld] = int(total) if fld in _INT_FIELDS else total
    blocks: int | None = None
    block_size: int | None = None
    infos = by_name.get("vllm:cache_config_info", [])
    per_engine = [(_label_int(s.labels, "num_gpu_blocks"), _label_int(s.labels, "block_size")) for s in infos]
    if per_engine and all(b is not None for b, _ in per_engine):
        blocks = sum(b for b, _ in per_engine if b is not None)
    sizes = {bs for _, bs in per_engine if bs is not None}
    if len(sizes) == 1:
        block_size = sizes.pop()
    starts = by_name.get(_START, [])
    start = starts[0].value if len(starts) == 1 and math.isfinite(starts[0].value) else None
    capacity = values.get("kv_capacity_tokens")
    if capacity is None and blocks is not None and block_size is not None:
        capacity = blocks * block_size
    return WorkerMetrics(
        engine=engine,
        num_requests_waiting=_opt_int(values.get("num_requests_waiting")),
        num_requests_running=_opt_int(values.get("num_requests_running")),
        kv_cache_usage=_opt_float(values.get("kv_cache_usage")),
        num_gpu_blocks=blocks,
        block_size_tokens=block_size,
        kv_capacity_tokens=_opt_int(capacity),
        prefix_cache_queries_tokens=_opt_float(values.get("prefix_cache_queries_tokens")),
        prefix_cache_hits_tokens=_opt_float(values.get("prefix_cache_hits_tokens")),
        process_start_s=start,
    )


def _opt_int(v: float | int | None) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: float | int | None) -> float | None:
    return None if v is None else float(v)


# ---------------------------------------------------------------- scraper loop


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """How often and how patiently workers are scraped, and when a result is too old to use."""

    interval_s: float = 1.0
    timeout_s: float = 0.5
    max_age_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    path: str = "/metrics"


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """The last good scrape of a worker and when it was taken (monotonic seconds)."""

    metrics: WorkerMetrics
    scraped_at_s: float
    restarted: bool = False  # the worker is another process than at its previous good scrape

    def age_s(self, now_s: float) -> float:
        return now_s - self.scraped_at_s


@dataclass(slots=True)
class ScrapeState:
    """Per-worker scraper state, for the admin API."""

    base_url: str
    headers: Mapping[str, str] = field(default_factory=dict)  # the worker's API key, if any
    last: ScrapeResult | None = None
    failures: int = 0
    consecutive_failures: int = 0
    last_error: str | None = None


@dataclass(slots=True)
class _Target:
    state: ScrapeState
    task: asyncio.Task[None]


class MetricsScraper:
    """One polling task per worker; `fresh(worker)` returns the last result unless it is stale.

    The aiohttp session is the gateway's session for its checks of the workers when given
    (`transport.make_probe_session`, apart from client traffic: a scrape's timeout counts the
    wait for a connection); otherwise the scraper owns one. A failed scrape keeps the previous
    result, which then ages out.
    """

    def __init__(
        self,
        config: ScrapeConfig | None = None,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_update: Callable[[WorkerId, ScrapeResult], None] | None = None,
    ) -> None:
        self._config = config or ScrapeConfig()
        self._session = session
        self._owns_session = session is None
        self._clock = clock
        self._on_update = on_update
        self._targets: dict[WorkerId, _Target] = {}

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        targets = list(self._targets.values())
        self._targets.clear()
        for t in targets:
            t.task.cancel()
        for t in targets:
            with contextlib.suppress(asyncio.CancelledError):
                await t.task
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def add(self, worker: WorkerId, base_url: str, headers: Mapping[str, str] | None = None) -> None:
        """Scrape `worker` from now on; `headers` go with every scrape (its pool's API key)."""
        if self._session is None:
            raise RuntimeError("MetricsScraper.add() before start()")
        self.remove(worker)
        state = ScrapeState(base_url=base_url.rstrip("/"), headers=dict(headers or {}))
        task = asyncio.create_task(self._loop(worker, state), name=f"scrape:{worker}")
        self._targets[worker] = _Target(state, task)

    def remove(self, worker: WorkerId) -> None:
        t = self._targets.pop(worker, None)
        if t is not None:
            t.task.cancel()

    def state(self, worker: WorkerId) -> ScrapeState | None:
        t = self._targets.get(worker)
        return t.state if t is not None else None

    def fresh(self, worker: WorkerId, now_s: float | None = None) -> WorkerMetrics | None:
        """The worker's last metrics if younger than `max_age_s`, else None."""
        t = self._targets.get(worker)
        if t is None or t.state.last is None:
            return None
        now = self._clock() if now_s is None else now_s
        if t.state.last.age_s(now) > self._config.max_age_s:
            return None
        return t.state.last.metrics

    async def scrape_once(self, base_url: str, headers: Mapping[str, str] | None = None) -> WorkerMetrics:
        """Fetch and parse one page; raises on HTTP errors, timeouts and oversized bodies."""
        assert self._session is not None
        cfg = self._config
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        url = base_url.rstrip("/") + cfg.path
        async with self._session.get(url, timeout=timeout, headers=headers) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            too_big = ScrapeError(f"metrics page larger than {cfg.max_body_bytes} bytes")
            if (resp.content_length or 0) > cfg.max_body_bytes:
                raise too_big
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > cfg.max_body_bytes:
                    raise too_big
        return parse_metrics(body.decode("utf-8", "replace"))

    async def _loop(self, worker: WorkerId, state: ScrapeState) -> None:
        while True:
            started = self._clock()
            try:
                metrics = await self.scrape_once(state.base_url, state.headers)
            except (aiohttp.ClientError, TimeoutError, ScrapeError) as exc:
                self._failed(worker, state, str(exc) or type(exc).__name__)
            except Exception as exc:
                # A parser bug or an unexpected page must not end this worker's scraping for good.
                self._failed(worker, state, f"unexpected {type(exc).__name__}: {exc}")
            else:
                before = state.last
                restarted = before is not None and worker_restarted(before.metrics, metrics)
                state.last = ScrapeResult(metrics, self._clock(), restarted)
                state.consecutive_failures = 0
                state.last_error = None
                if self._on_update is not None:
                    try:
                        self._on_update(worker, state.last)
                    except Exception:
                        log.exception("scrape update handler failed for %s", worker)
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self._config.interval_s - elapsed))

    @staticmethod
    def _failed(worker: WorkerId, state: ScrapeState, error: str) -> None:
        state.failures += 1
        state.consecutive_failures += 1
        state.last_error = error
        if state.consecutive_failures == 1:
            log.warning("scrape of %s failed: %s", worker, error)


class ScrapeError(RuntimeError):
    """A scrape that returned something other than a usable metrics page."""
