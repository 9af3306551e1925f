"""A decode worker's half-open trial in a vLLM prefill/decode pool: its request's prefill leg is an
earlier attempt of the same request, to a worker of the other role, which compares nothing. So a
decode leg's held 5xx with no other decode worker tried is the trial's only attempt of its role,
and counts as a failed trial (`outcome.HeldVerdicts.alone`): `failure_threshold` of them in a row
open the breaker again. Before, the prefill leg made every decode leg a second attempt, so a lone
broken decode worker stayed half-open for ever and took every request after its prefill leg.

The part an attempt played counts, not its worker's role: in a pool of mixed workers (vLLM's
`holder_prefill` mode) a mixed worker's decode leg follows another mixed worker's prefill leg, and
counted by role it was never alone.

The gateway runs in-process in front of a scripted prefill worker and a decode worker answering
500 to every leg (P/D pools send no canaries: client requests are the trials)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
from aiohttp import web

from gateway.auth import hash_api_key
from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config.pool import BreakerConfig
from gateway.leg import Leg
from gateway.outcome import Attempt, HeldVerdicts
from gateway.worker import Worker
from policies.base import RouteDecision, RouteRequest, RoutingPolicy, WorkerId, WorkerView
from policies.baselines import RoundRobin
from policies.pools import available
from tests.support.inprocess import InProcessGateway, gateway_in_process
from tests.support.loopback import Handler, healthy, serve_app
from tests.support.wait import wait_until

SECRET = b"k"
KEY = {"authorization": "Bearer sk-t"}
BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
THRESHOLD = 2


async def _prefill(_: web.Request) -> web.Response:
    return web.json_response(
        {"type": "message", "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}
    )


async def _broken(_: web.Request) -> web.Response:
    return web.json_response(
        {"error": {"message": "engine failed", "type": "InternalServerError"}}, status=500
    )


async def _worker(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/messages", handler)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _pd_gateway(
    handlers: Sequence[Handler],
    members: Callable[[list[str]], dict[str, Any]],
    policy: Callable[[list[str]], RoutingPolicy],
) -> AsyncIterator[tuple[InProcessGateway, list[str]]]:
    """A gateway in front of one vLLM prefill/decode pool of workers answering with `handlers`
    (their URLs, in order, name the pool's `members` and choose its `policy`): no retries, a
    breaker opening at `THRESHOLD` failures with a short cooldown."""
    runners: list[web.AppRunner] = []
    try:
        urls = []
        for handler in handlers:
            runner, url = await _worker(handler)
            runners.append(runner)
            urls.append(url)
        pool = {
            "name": "p",
            "models": ["m"],
            **members(urls),
            "pd": {"protocol": "vllm", "conditional": False},
            "retry_attempts": 0,
            "breaker": {"failure_threshold": THRESHOLD, "cooldown_s": 0.2},
        }
        config = {
            "pools": [pool],
            "tenants": [{"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")]}],
            "scrape": {"enabled": False},
        }
        async with gateway_in_process(config, policy(urls), secret=SECRET) as gw:
            yield gw, urls
    finally:
        for runner in runners:
            await runner.cleanup()


def _opened(gw: InProcessGateway, url: str) -> CircuitBreaker:
    """`url`'s breaker, opened by a bad spell (`THRESHOLD` failures)."""
    breaker = gw.state.registry.pools["p"].workers[WorkerId(url)].breaker
    for _ in range(THRESHOLD):
        breaker.on_failure(time.monotonic(), trial=None)
    assert breaker.state(time.monotonic()) is BreakerState.OPEN
    return breaker


async def test_a_broken_decode_workers_failed_trials_open_its_breaker_again() -> None:
    def split(urls: list[str]) -> dict[str, Any]:
        return {"prefill_workers": [urls[0]], "decode_workers": [urls[1]]}

    async with _pd_gateway([_prefill, _broken], split, lambda _: RoundRobin()) as (gw, urls):
        assert await _failed_trials(gw.client, _opened(gw, urls[1])) == THRESHOLD


async def _failed_trials(client: httpx.AsyncClient, breaker: CircuitBreaker) -> int:
    """Send requests, one per half-open trial of `breaker`'s worker, until it opens again (at most
    twice the threshold): the trials it took. The breaker must end open."""
    trials = 0
    for _ in range(2 * THRESHOLD):
        await wait_until(lambda: breaker.allows(time.monotonic()), what="the decode worker's trial")
        resp = await client.post("/v1/messages", json=BODY, headers=KEY)
        assert resp.status_code >= 500, resp.text
        trials += 1
        if breaker.state(time.monotonic()) is BreakerState.OPEN:
            break
    assert breaker.state(time.monotonic()) is BreakerState.OPEN
    return trials  # as many failed trials in a row as open a closed breaker


def _prefill_leg(body: dict[str, Any]) -> bool:
    return bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))


class _Preferring(RoundRobin):
    """`first` whenever it is available: the healthy mixed worker prefills every split, so the
    broken one plays only decode legs."""

    def __init__(self, first: str) -> None:
        super().__init__()
        self._first = WorkerId(first)

    def select(self, req: RouteRequest, workers: Sequence[WorkerView], now_s: float) -> RouteDecision | None:
        chosen = next((w for w in available(workers) if w.worker_id == self._first), None)
        return super().select(req, workers, now_s) if chosen is None else self._decide(chosen, 0.0, "first")


async def test_a_broken_mixed_workers_failed_decode_leg_trials_open_its_breaker_again() -> None:
    legs: list[str] = []

    async def healthy(req: web.Request) -> web.Response:
        legs.append("prefill" if _prefill_leg(await req.json()) else "whole")
        return await _prefill(req)

    async def broken(req: web.Request) -> web.Response:
        legs.append("broken prefill" if _prefill_leg(await req.json()) else "broken decode")
        return await _broken(req)

    def both(urls: list[str]) -> dict[str, Any]:
        return {"workers": urls}  # both mixed: either plays either leg

    async with _pd_gateway([healthy, broken], both, lambda urls: _Preferring(urls[0])) as (gw, urls):
        assert await _failed_trials(gw.client, _opened(gw, urls[1])) == THRESHOLD
        assert legs == ["prefill", "broken decode"] * THRESHOLD  # each trial a decode leg


@dataclass
class _Leg:
    """What `HeldVerdicts` reads of an attempt and of its worker."""

    leg: Leg
    breaker: CircuitBreaker = field(
        default_factory=lambda: CircuitBreaker(BreakerConfig(failure_threshold=1, cooldown_s=5))
    )

    @property
    def worker(self) -> Worker:
        return cast(Worker, self)


def test_a_decode_leg_retried_whole_on_a_mixed_worker_that_fails_too_is_not_alone() -> None:
    # A mixed worker prefills, a decode worker's decode leg fails, the retry runs whole on another
    # mixed worker, which fails too: two answers failed, so neither half-open trial counts. By
    # role, the decode worker was the request's only one of its role.
    prefill, decode, whole = _Leg(Leg.PREFILL), _Leg(Leg.DECODE), _Leg(Leg.WHOLE)
    now_s = time.monotonic()
    verdicts = HeldVerdicts(cast(list[Attempt], [prefill, decode, whole]))
    for attempt in (decode, whole):
        attempt.breaker.on_failure(now_s - 10, trial=None)  # opened, and past its cooldown
        trial = attempt.breaker.on_dispatch(now_s)
        assert trial is not None
        attempt.breaker.on_abandon(trial=trial)  # its failure held: the trial's slot is freed
        verdicts.hold(attempt.worker, leg=attempt.leg)
    verdicts.acquit()
    assert [a.breaker.state(time.monotonic()) for a in (decode, whole)] == [BreakerState.HALF_OPEN] * 2
    # Alone, a decode leg after a prefill leg is a failed trial.
    alone = _Leg(Leg.DECODE)
    verdicts = HeldVerdicts(cast(list[Attempt], [prefill, alone]))
    alone.breaker.on_failure(now_s - 10, trial=None)
    alone.breaker.on_abandon(trial=alone.breaker.on_dispatch(now_s))
    verdicts.hold(alone.worker, leg=alone.leg)
    verdicts.acquit()
    assert alone.breaker.state(time.monotonic()) is BreakerState.OPEN
