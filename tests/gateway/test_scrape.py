"""Prometheus page parsing, and the scraper loop against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import pytest
from aiohttp import web

from gateway.scrape import (
    MetricsScraper,
    ScrapeConfig,
    ScrapeError,
    WorkerMetrics,
    parse_metrics,
    parse_samples,
    worker_restarted,
)
from policies.base import WorkerId
from tests.support.loopback import serve_app
from tests.support.processes import running_emulator
from tests.support.wait import wait_until

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="org/m \\"q\\""} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
python_gc_objects_collected_total{generation="0"} 123.0
"""

DP_PAGE = """\
vllm:num_requests_running{engine="0"} 1
vllm:num_requests_running{engine="1"} 2
vllm:num_requests_waiting{engine="0"} 0
vllm:num_requests_waiting{engine="1"} 4
vllm:gpu_cache_usage_perc{engine="0"} 0.1
vllm:gpu_cache_usage_perc{engine="1"} 0.9
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1
"""

SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
sglang:num_running_reqs{model_name="m",tp_rank="0"} 5.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.25
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 500000.0
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 900.0
sglang:cached_tokens_total{cache_source="device",model_name="m"} 300.0
sglang:cached_tokens_total{cache_source="host",model_name="m"} 100.0
"""


def test_vllm_page() -> None:
    m = parse_metrics(VLLM_PAGE)
    assert m == WorkerMetrics(
        engine="vllm",
        num_requests_waiting=7,
        num_requests_running=3,
        kv_cache_usage=0.42,
        num_gpu_blocks=2048,
        block_size_tokens=16,
        kv_capacity_tokens=2048 * 16,
        prefix_cache_queries_tokens=1000.0,
        prefix_cache_hits_tokens=250.0,
    )


def test_data_parallel_engines_sum_counts_and_take_the_fullest_cache() -> None:
    m = parse_metrics(DP_PAGE)
    assert (m.num_requests_running, m.num_requests_waiting) == (3, 4)
    assert m.kv_cache_usage == 0.9  # deprecated name still read
    assert (m.num_gpu_blocks, m.block_size_tokens, m.kv_capacity_tokens) == (200, 16, 3200)
    assert m.prefix_cache_hits_tokens is None


def test_sglang_page() -> None:
    m = parse_metrics(SGLANG_PAGE)
    assert m.engine == "sglang"
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (5, 2, 0.25)
    assert m.kv_capacity_tokens == 500_000 and m.num_gpu_blocks is None
    assert (m.prefix_cache_queries_tokens, m.prefix_cache_hits_tokens) == (900.0, 400.0)


def test_unprofiled_cache_and_garbage_lines_are_tolerated() -> None:
    page = (
        "garbage without value\n"
        "vllm:num_requests_waiting{broken 3\n"
        'vllm:num_requests_running{engine="0"} notanumber\n'
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="0"} 2 1700000000000\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n'
        "\n"
    )
    m = parse_metrics(page)
    assert m.num_requests_waiting == 2 and m.num_requests_running is None
    assert m.num_gpu_blocks is None and m.block_size_tokens == 16 and m.kv_capacity_tokens is None


def test_non_finite_and_negative_values_are_ignored() -> None:
    page = (
        "vllm:num_requests_waiting +Inf\n"
        "vllm:num_requests_running 1e400\n"
        "vllm:kv_cache_usage_perc -0.5\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="-100"} 1\n'
        'sglang:max_total_num_tokens{engine="0"} 1e308\n'
    )
    m = parse_metrics(page)  # must not raise OverflowError
    assert m.engine == "vllm"
    assert (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage) == (None, None, None)
    assert m.num_gpu_blocks is None and m.kv_capacity_tokens is None
    # Two finite samples whose sum overflows to infinity.
    huge = 'sglang:max_total_num_tokens{engine="0"} 1e308\nsglang:max_total_num_tokens{engine="1"} 1e308\n'
    assert parse_metrics(huge).kv_capacity_tokens is None


def test_a_new_process_is_told_by_its_start_time_or_a_counter_gone_down() -> None:
    def page(queries: float, hits: float, start: str = "") -> WorkerMetrics:
        text = f"vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\n"
        return parse_metrics(text + start)

    one = page(100, 40, "process_start_time_seconds 1.7e9\n")
    assert one.process_start_s == 1.7e9
    assert not worker_restarted(one, page(150, 40, "process_start_time_seconds 1.7e9\n"))
    assert worker_restarted(one, page(150, 40, "process_start_time_seconds 1.7e9\n".replace("9", "8", 1)))
    assert worker_restarted(one, page(10, 40))  # no start time now: the counters tell
    assert worker_restarted(page(100, 40), page(100, 39))
    assert not worker_restarted(page(100, 40), parse_metrics("vllm:num_requests_running 1\n"))  # not shown
    # Several start times (one per process behind a shared page) say nothing.
    starts = 'process_start_time_seconds{pid="1"} 5\nprocess_start_time_seconds{pid="2"} 6\n'
    two = parse_metrics(starts + "vllm:num_requests_running 1\n")
    assert two.process_start_s is None


def test_unknown_page_gives_an_empty_record() -> None:
    assert parse_metrics("up 1\nprocess_cpu_seconds_total 3\n") == WorkerMetrics()
    assert parse_metrics("") == WorkerMetrics()


def test_label_escapes() -> None:
    (s,) = parse_samples('x{a="q\\"uo,te",b="back\\\\slash"} 1', frozenset({"x"}))
    assert s.labels == {"a": 'q"uo,te', "b": "back\\slash"}


# ---------------------------------------------------------------- the loop, over HTTP


@dataclass
class Worker:
    page: str = VLLM_PAGE
    status: int = 200
    delay_s: float = 0.0
    hits: int = 0


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, str]]:
    w = Worker()

    async def metrics(_: web.Request) -> web.Response:
        w.hits += 1
        if w.delay_s:
            await asyncio.sleep(w.delay_s)
        return web.Response(text=w.page, status=w.status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await serve_app(app)
    try:
        yield w, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


W = WorkerId("w1")


async def test_loop_scrapes_ages_and_survives_failures(worker: tuple[Worker, str]) -> None:
    w, url = worker
    clock = [100.0]
    updates: list[WorkerId] = []
    scraper = MetricsScraper(
        # A timeout far beyond any scheduling delay: the only failures are the worker's HTTP 500s.
        ScrapeConfig(interval_s=0.02, timeout_s=10.0, max_age_s=5.0),
        clock=lambda: clock[0],
        on_update=lambda wid, _: updates.append(wid),
    )
    await scraper.start()
    try:
        scraper.add(W, url + "/")
        await wait_until(lambda: scraper.fresh(W) is not None)
        assert scraper.fresh(W) == parse_metrics(VLLM_PAGE)
        assert updates and updates[0] == W
        w.status = 500
        state = scraper.state(W)
        assert state is not None
        await wait_until(lambda: state.consecutive_failures >= 2)
        assert state.last_error == "HTTP 500"
        assert scraper.fresh(W) is not None  # the last good one is still young
        clock[0] += 6.0
        assert scraper.fresh(W) is None  # ... until it ages out
        w.status = 200
        w.page = DP_PAGE
        await wait_until(lambda: scraper.fresh(W) is not None)
        assert scraper.fresh(W) == parse_metrics(DP_PAGE)
        assert scraper.fresh(WorkerId("unknown")) is None
    finally:
        await scraper.stop()


async def test_loop_survives_an_unexpected_exception(
    worker: tuple[Worker, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = worker
    scraper = MetricsScraper(ScrapeConfig(interval_s=0.01, timeout_s=0.5))
    real = scraper.scrape_once
    calls = [0]

    async def flaky(base_url: str, headers: Mapping[str, str] | None = None) -> WorkerMetrics:
        calls[0] += 1
        if calls[0] <= 2:
            raise OverflowError("boom")
        return await real(base_url, headers)

    monkeypatch.setattr(scraper, "scrape_once", flaky)
    await scraper.start()
    try:
        scraper.add(W, url)
        await wait_until(lambda: scraper.fresh(W) is not None)
        state = scraper.state(W)
        assert state is not None and state.failures == 2 and state.consecutive_failures == 0
    finally:
        await scraper.stop()


async def test_large_page_is_read_whole(worker: tuple[Worker, str]) -> None:
    w, url = worker
    filler = "".join(f'histogram_bucket{{le="{i}",pad="{"x" * 40}"}} {i}\n' for i in range(20_000))
    w.page = filler + VLLM_PAGE  # the interesting lines come after ~1.4 MB
    scraper = MetricsScraper()
    await scraper.start()
    try:
        assert await scraper.scrape_once(url) == parse_metrics(VLLM_PAGE)
    finally:
        await scraper.stop()


async def test_slow_and_oversized_pages_fail_cleanly(worker: tuple[Worker, str]) -> None:
    w, url = worker
    # Each scraper fails one way only: the one with a small body limit has all the time it needs
    # to see the page is too large, the one with a short timeout gets a page that never comes.
    oversized = MetricsScraper(ScrapeConfig(timeout_s=10.0, max_body_bytes=64))
    slow = MetricsScraper(ScrapeConfig(timeout_s=0.1))
    await oversized.start()
    await slow.start()
    try:
        with pytest.raises(ScrapeError, match="larger than 64"):
            await oversized.scrape_once(url)
        w.delay_s = 1.0
        with pytest.raises(TimeoutError):
            await slow.scrape_once(url)
    finally:
        await oversized.stop()
        await slow.stop()


async def test_remove_and_stop_cancel_the_tasks(worker: tuple[Worker, str]) -> None:
    w, url = worker
    scraper = MetricsScraper(ScrapeConfig(interval_s=0.01))
    with pytest.raises(RuntimeError):
        scraper.add(W, url)
    await scraper.start()
    scraper.add(W, url)
    await wait_until(lambda: w.hits >= 2)
    scraper.remove(W)
    # A second target scraped at the same interval is the clock: its pages 404 (not counted as
    # hits), and while it fails a few times the removed worker had every chance to be scraped.
    witness = WorkerId("witness")
    scraper.add(witness, url + "/elsewhere")

    def witness_failures() -> int:
        state = scraper.state(witness)
        return state.failures if state is not None else 0

    await wait_until(lambda: witness_failures() >= 2)  # a scrape in flight at removal has landed
    hits = w.hits
    await wait_until(lambda: witness_failures() >= 5)
    assert w.hits == hits and scraper.state(W) is None
    await scraper.stop()


@pytest.mark.e2e
async def test_scrapes_the_emulated_vllm_worker() -> None:
    with running_emulator("--kv-blocks", "1234", "--block-size", "32") as base:
        scraper = MetricsScraper(ScrapeConfig(timeout_s=2.0))
        await scraper.start()
        try:
            m = await scraper.scrape_once(base)
        finally:
            await scraper.stop()
    assert m.engine == "vllm"
    assert (m.num_gpu_blocks, m.block_size_tokens, m.kv_capacity_tokens) == (1234, 32, 1234 * 32)
    assert m.num_requests_running == 0 and m.num_requests_waiting == 0
    assert m.kv_cache_usage is not None and 0.0 <= m.kv_cache_usage <= 1.0


def _calls_to_parse(page: str) -> int:
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        parse_metrics(page)
    finally:
        sys.setprofile(None)
    return calls


def test_escapes_cost_no_work_per_escape() -> None:
    # A hostile worker's page: every line a family the gateway reads, with a long escaped label.
    # Parsing must not run code per escaped character, or one worker's page under the size limit
    # keeps the loop busy for a large part of every scrape interval.
    def page(escapes: int) -> str:
        label = "\\\\" * escapes + '\\"' * escapes + "\\n" * escapes
        return f'vllm:num_requests_waiting{{k="{label}"}} 1\n' * 20

    assert _calls_to_parse(page(2000)) == _calls_to_parse(page(2))
    (s,) = parse_samples('x{k="\\\\\\"\\n\\\\n\\q"} 1', frozenset({"x"}))
    assert s.labels == {"k": '\\"\n\\nq'}
