"""A worker's view is reused between requests; every change to what it shows must be visible."""

from __future__ import annotations

from gateway.config.pool import BreakerConfig, PoolConfig
from gateway.scrape import WorkerMetrics
from gateway.worker import Worker


def _worker() -> Worker:
    cfg = PoolConfig(
        name="p",
        models=["m"],
        workers=["http://a:1"],
        breaker=BreakerConfig(failure_threshold=1, cooldown_s=10),
    )
    w = Worker("http://a:1", cfg)
    w.healthy = True
    return w


def test_the_view_is_reused_until_the_worker_changes() -> None:
    w = _worker()
    first = w.view(1.0)
    assert w.view(2.0) is first and first.healthy and first.in_flight_requests == 0
    w.acquire(100, 10, 2.0)
    v = w.view(2.0)
    assert v.in_flight_requests == 1 and v.in_flight_prefill_tokens == 100 and v.in_flight_decode_tokens == 10
    w.first_token(100)
    assert w.view(2.0).in_flight_prefill_tokens == 0
    w.release(100, 10, prefill_done=True)
    assert w.view(2.0).in_flight_requests == 0
    w.healthy = False
    assert not w.view(2.0).healthy


def test_scraped_metrics_show_until_they_go_stale() -> None:
    w = _worker()
    assert w.view(1.0).num_requests_waiting is None
    w.note_metrics(WorkerMetrics(num_requests_waiting=4, num_requests_running=2), scraped_at_s=1.0)
    assert w.view(2.0).num_requests_waiting == 4
    assert w.view(5.9).num_requests_waiting == 4
    assert w.view(6.5).num_requests_waiting is None  # older than the 5 s default


def test_an_open_breaker_is_asked_each_time() -> None:
    w = _worker()
    assert w.view(0.0).healthy
    w.breaker.on_failure(1.0, trial=None)  # threshold 1: open for 10 s
    assert not w.view(2.0).healthy
    assert w.view(11.5).healthy  # half-open: one trial may go
    trial = w.acquire(1, 1, 11.5)  # the trial is in flight
    assert trial is not None
    assert not w.view(11.6).healthy
    w.breaker.on_success(trial=trial)
    w.release(1, 1, prefill_done=False)
    assert w.view(11.7).healthy and w.view(11.8).in_flight_requests == 0


def test_the_view_carries_the_gateways_in_flight_at_the_scrape() -> None:
    w = _worker()
    for _ in range(3):
        w.acquire(100, 10, 1.0)
    w.note_metrics(WorkerMetrics(num_requests_waiting=1, num_requests_running=2), scraped_at_s=1.0)
    w.release(100, 10, prefill_done=True)
    v = w.view(2.0)
    assert (v.in_flight_requests, v.in_flight_at_scrape, v.num_requests_running) == (2, 3, 2)


def test_the_decode_context_counts_prompts_past_their_first_token() -> None:
    # A request's prompt joins the decode batch's context at its first token (plus half its
    # maximum output, its mean generated length) and leaves it when it ends; a request that ends
    # before its first token never added any.
    w = _worker()
    w.acquire(1000, 100, 1.0)
    w.acquire(500, 10, 1.0)
    assert w.view(1.0).decode_context_tokens == 0
    w.first_token(1000, 100)
    v = w.view(1.1)
    assert v.decode_context_tokens == 1050 and v.in_flight_prefill_tokens == 500
    w.release(500, 10, prefill_done=False)
    assert w.view(1.2).decode_context_tokens == 1050
    w.release(1000, 100, prefill_done=True)
    assert w.view(1.3).decode_context_tokens == 0 and w.view(1.3).in_flight_requests == 0


def test_the_prefill_attention_counts_each_pending_prompt_with_its_predicted_match() -> None:
    # A prompt's attention is new·(matched + new/2) for the match its decision predicted, counted
    # from dispatch to its first token (or its end before one).
    w = _worker()
    w.acquire(120_000, 10, 1.0)  # a long miss
    w.acquire(10_000, 10, 1.0, matched_tokens=8_000)  # a hit with 2,000 new tokens
    assert w.view(1.0).in_flight_prefill_pairs == 120_000 * 60_000 + 2_000 * 9_000
    w.first_token(120_000, 10, now_s=1.5)
    assert w.view(1.5).in_flight_prefill_pairs == 2_000 * 9_000
    w.release(10_000, 10, prefill_done=False, matched_tokens=8_000)
    v = w.view(1.6)
    assert v.in_flight_prefill_pairs == 0 and v.in_flight_prefill_tokens == 0
    w.release(120_000, 10, prefill_done=True)  # past its first token: nothing more to take back
    assert w.view(1.7).in_flight_prefill_pairs == 0


def test_the_view_says_when_the_prefill_backlog_last_restarted() -> None:
    w = _worker()
    assert w.view(0.0).prefill_started_s is None
    w.acquire(100, 10, 1.0)  # an empty backlog starts with its first prompt
    w.acquire(50, 10, 1.5)  # joins a backlog already being worked on
    assert w.view(1.5).prefill_started_s == 1.0
    w.first_token(100, now_s=2.0)  # what is left is worked on from this first token at the earliest
    v = w.view(2.0)
    assert v.in_flight_prefill_tokens == 50 and v.prefill_started_s == 2.0
    w.first_token(50, now_s=2.5)
    assert w.view(2.5).prefill_started_s is None  # no backlog
    w.acquire(80, 10, 3.0)
    w.acquire(20, 10, 3.1)
    # A prompt that leaves unfinished may have taken the time since: no progress counts.
    w.release(80, 10, prefill_done=False)
    v = w.view(3.2)
    assert v.in_flight_prefill_tokens == 20 and v.prefill_started_s is None
