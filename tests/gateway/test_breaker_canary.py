"""A worker's failure that no other worker's answer compared (a lone 5xx, its own error event in a
stream) counts against no worker by itself, since a client's input can cause it
(`outcome.HeldVerdicts`); it leaves the worker suspected, and the gateway's own canary decides
(`gateway/canary.py`): a one-token `/v1/completions` of a fixed prompt that no client shapes.

So a worker that fails everything while its `/health` passes is shut out even when nothing
retries its requests (`retry_attempts: 0`), and one ending every stream in its own error event
is shut out too; a tenant's input that fails a healthy worker never opens its breaker (the canary
passes); and a worker has one canary in flight at most, cancelled when it leaves its pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.breaker import BreakerState, CircuitBreaker
from gateway.canary import CANARY_PROMPT, Canaries, CanaryVerdict
from gateway.config.pool import BreakerConfig, CanaryConfig
from gateway.gauges import refresh_gauges
from tests.gateway.chat_rig import USAGE, ChatRig, chat_answer, chat_app, round_robin_gateway, served
from tests.support.wait import wait_until

SECRET = b"k"
KEYS = {"t": "sk", "u": "sk-u"}
POISON = "poison"  # a prompt every worker fails with a 500 (vLLM's GenerationError for one input)
FAILED = {"error": {"message": "GenerationError", "type": "InternalServerError", "code": 500}}
FIRST_CHUNK = {
    "id": "x",
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {"content": "p"}}],
}
COMPLETION_CHUNK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "OK"}]}
# Long enough for a canary to wait for anything the test does meanwhile; the waits are bounded.
WAIT_S = 30.0


@dataclass
class Workers:
    """Scripted workers. `broken`: 500 to every generation (chats and canaries alike);
    `stream_errors`: every stream ends, after its first event, with the worker's own error event;
    `POISON` gets a 500 from any worker. `held`: canaries wait for `release` before answering;
    `refusal`: every canary gets this status (`busy_event`: as the code of the worker's own error
    event, the first of a 200 stream, as SGLang streams a full queue); `whole`: every canary
    gets this whole 200 answer (body, content type) instead of a stream."""

    posts: list[str] = field(default_factory=list)
    canaries: list[str] = field(default_factory=list)
    canary_heads: list[tuple[str | None, str | None]] = field(default_factory=list)  # id, User-Agent
    broken: set[str] = field(default_factory=set)
    stream_errors: set[str] = field(default_factory=set)
    held: bool = False
    refusal: int | None = None
    busy_event: bool = False
    whole: tuple[bytes, str] | None = None  # every canary's answer: a whole body and its type
    release: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    most_in_flight: int = 0


def _stream(events: list[bytes]) -> web.Response:
    body = b"".join(b"data: " + data + b"\n\n" for data in events)
    return web.Response(body=body, content_type="text/event-stream")


def app_for(workers: Workers, name: str) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        workers.posts.append(name)
        if name in workers.broken or body["messages"][0]["content"] == POISON:
            return web.json_response(FAILED, status=500)
        stream = body.get("stream") is True
        if stream and name in workers.stream_errors:
            return _stream([orjson.dumps(FIRST_CHUNK), orjson.dumps(FAILED), b"[DONE]"])
        return chat_answer(stream, "ok")

    async def completions(request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        # The canary is the gateway's own: its fixed prompt, one token, streamed.
        assert (body["prompt"], body["max_tokens"], body["stream"]) == (CANARY_PROMPT, 1, True)
        workers.canaries.append(name)
        workers.canary_heads.append((request.headers.get("x-request-id"), request.headers.get("user-agent")))
        workers.in_flight += 1
        workers.most_in_flight = max(workers.most_in_flight, workers.in_flight)
        try:
            if workers.held:
                await workers.release.wait()
            if workers.refusal is not None:
                refused = {"error": {"message": "The request queue is full.", "code": workers.refusal}}
                if workers.busy_event:
                    return _stream([orjson.dumps(refused), b"[DONE]"])
                return web.json_response(refused, status=workers.refusal)
            if workers.whole is not None:
                body, content_type = workers.whole
                return web.Response(body=body, headers={"content-type": content_type})
            if name in workers.broken:
                return web.json_response(FAILED, status=500)
            if name in workers.stream_errors:
                return _stream([orjson.dumps(COMPLETION_CHUNK), orjson.dumps(FAILED), b"[DONE]"])
            return _stream([orjson.dumps(COMPLETION_CHUNK), b"[DONE]"])
        finally:
            workers.in_flight -= 1

    async def tokenize(_: web.Request) -> web.Response:
        # No engine needed: a worker failing every generation still answers it.
        return web.json_response({"count": 2, "max_model_len": 4096, "tokens": [1, 2]})

    app = chat_app(chat, completions)
    app.router.add_post("/tokenize", tokenize)
    return app


@dataclass
class Rig(ChatRig):
    workers: Workers

    async def chat(self, prompt: str = "hi", *, tenant: str = "t", stream: bool = False) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream}
        return await self.client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}
        )

    @property
    def canaries(self) -> Canaries:
        assert self.state.canaries is not None
        return self.state.canaries

    async def tokenize(self) -> httpx.Response:
        body = {"model": "m", "prompt": "x"}
        return await self.client.post(
            "/tokenize", json=body, headers={"authorization": f"Bearer {KEYS['t']}"}
        )

    async def canaries_passed(self, n: int) -> None:
        """Wait until `n` canaries have passed in all, and none is in flight."""
        counts = self.canaries.counts
        await wait_until(lambda: counts[CanaryVerdict.PASSED] >= n, timeout_s=WAIT_S)
        await wait_until(lambda: self.canaries.in_flight == 0, timeout_s=WAIT_S)

    def canary_series(self) -> dict[tuple[str, str], float]:
        """`kvgate_breaker_canaries_total` as scraped: (worker name, verdict) → count."""
        names = {url: name for name, url in self.urls.items()}
        refresh_gauges(self.state)  # as GET /metrics does
        page = self.state.routing.metrics.render().decode()
        return {
            (names[s.labels["worker"]], s.labels["verdict"]): s.value
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == "kvgate_breaker_canaries_total" and s.labels["pool"] == "p"
        }

    def failures(self, names: str) -> dict[str, int]:
        return {name: self.worker("p", name).breaker.failures for name in names}

    def closed(self, name: str) -> bool:
        return self.worker("p", name).breaker.closed


@contextlib.asynccontextmanager
async def gateway(names: str = "ab", **pool: Any) -> AsyncIterator[Rig]:
    """A gateway routing round robin over scripted workers `names` in one pool `p` (model `m`);
    `pool` overrides its config. Health checks only at the start: every worker stays healthy, so
    only breakers decide."""
    workers = Workers()
    try:
        async with served(names, lambda name: app_for(workers, name), handler_cancellation=True) as urls:
            config = {
                "name": "p",
                "models": ["m"],
                "workers": [urls[n] for n in names],
                "health": {"interval_s": 3600},
                **pool,
            }
            async with round_robin_gateway([config], KEYS, SECRET) as gw:
                yield Rig(gw.client, gw.state, urls, workers)
    finally:
        workers.release.set()


async def test_a_worker_failing_everything_without_retries_is_shut_out_by_its_canaries() -> None:
    # The breaker's defaults but its cooldown: three canaries failed in a row open it.
    async with gateway(retry_attempts=0, breaker={"cooldown_s": 3600}) as rig:
        rig.workers.broken.add("a")
        statuses = sorted([(await rig.chat()).status_code for _ in range(2)])
        assert statuses == [200, 502] and sorted(rig.workers.posts) == ["a", "b"]
        # One lone 500 was enough: the canaries go on, one an interval, until the breaker opens.
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 3 and set(rig.workers.canaries) == {"a"}
        assert rig.canary_series() == {("a", "failed"): 3.0}
        rig.workers.posts.clear()
        for _ in range(4):  # every tenant's requests now go to the healthy worker
            assert (await rig.chat(tenant="u")).status_code == 200
        assert rig.workers.posts == ["b"] * 4


async def test_a_canary_names_itself_to_its_worker(caplog: pytest.LogCaptureFixture) -> None:
    """Operators tell canaries apart in an engine's logs by their request id and User-Agent."""
    caplog.set_level(logging.INFO, logger="kvgate.canary")
    breaker = {"cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.broken.add("a")
        assert (await rig.chat()).status_code == 502
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        ids = [f"kvgate-canary-{n}" for n in (1, 2, 3)]
        assert rig.workers.canary_heads == [(i, "kvgate-canary") for i in ids]
    assert [getattr(r, "request_id", None) for r in caplog.records if r.name == "kvgate.canary"] == ids


async def test_a_tenants_input_that_fails_a_healthy_worker_never_opens_its_breaker() -> None:
    # Opens at the first failure counted: any wrong verdict shows as an open breaker.
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway(retry_attempts=0, breaker=breaker) as rig:
        for passed in range(2, 8, 2):
            for _ in range(4):  # round robin: two on each worker, each the request's only attempt
                assert (await rig.chat(POISON)).status_code == 502
            # Each worker's canary passes: the suspicion is cleared, nothing is counted.
            await rig.canaries_passed(passed)
            assert rig.failures("ab") == {"a": 0, "b": 0} and rig.closed("a") and rig.closed("b")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 0
        assert not any(rig.worker("p", name).breaker.suspected for name in "ab")
        rig.workers.posts.clear()
        for _ in range(4):  # another tenant's requests still go to both workers
            assert (await rig.chat(tenant="u")).status_code == 200
        assert sorted(rig.workers.posts) == ["a", "a", "b", "b"]


async def test_a_worker_ending_every_stream_in_its_own_error_event_is_shut_out() -> None:
    async with gateway(breaker={"cooldown_s": 3600}) as rig:
        rig.workers.stream_errors.add("a")
        for _ in range(2):  # one on each worker; `a`'s stream ends in its error event
            resp = await rig.chat(stream=True)
            assert resp.status_code == 200
        assert sorted(rig.workers.posts) == ["a", "b"]
        assert rig.failures("a") == {"a": 0}  # the error event itself counted against no worker
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert rig.canaries.counts[CanaryVerdict.FAILED] == 3
        rig.workers.posts.clear()
        for _ in range(4):
            resp = await rig.chat(tenant="u", stream=True)
            assert resp.status_code == 200 and b"upstream_stream_error" not in resp.content
        assert rig.workers.posts == ["b"] * 4


async def test_a_worker_has_one_canary_in_flight_at_most() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05, "timeout_s": 0.5}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.held = True  # canaries get no answer until released
        assert (await rig.chat(POISON)).status_code == 502
        await wait_until(lambda: rig.workers.canaries == ["a"], timeout_s=WAIT_S)
        for _ in range(3):  # more suspicions while its canary is in flight
            assert (await rig.chat(POISON)).status_code == 502
        assert rig.canaries.in_flight == 1
        # The first canary times out (which decides nothing), and only then is the next sent.
        await wait_until(lambda: len(rig.workers.canaries) == 2, timeout_s=WAIT_S)
        assert rig.canaries.counts == {CanaryVerdict.INCONCLUSIVE: 1}
        assert rig.workers.most_in_flight == 1 and rig.canaries.in_flight == 1
        rig.workers.held = False
        rig.workers.release.set()
        await wait_until(lambda: rig.canaries.counts[CanaryVerdict.PASSED] == 1, timeout_s=WAIT_S)
        assert rig.failures("a") == {"a": 0} and rig.closed("a") and rig.workers.most_in_flight == 1


async def test_a_workers_canary_is_cancelled_when_it_leaves_its_pool() -> None:
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway(retry_attempts=0, breaker=breaker) as rig:
        rig.workers.held = True
        rig.workers.broken.add("a")
        for _ in range(2):
            await rig.chat()
        await wait_until(lambda: rig.workers.canaries == ["a"], timeout_s=WAIT_S)
        a = rig.worker("p", "a")
        rig.state.registry.pools["p"].set_urls([rig.urls["b"]])  # discovery lost it
        await wait_until(lambda: rig.canaries.in_flight == 0, timeout_s=WAIT_S)
        assert sum(rig.canaries.counts.values()) == 0 and a.breaker.closed


async def test_failed_canaries_open_the_breaker_whatever_succeeds_between_them() -> None:
    """A worker failing every generation (and its canaries) while it answers `/tokenize`, which
    needs no engine: a tenant's tokenize calls between the canaries must not keep it in."""
    breaker = {"cooldown_s": 3600, "canary": {"interval_s": 0.3}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.broken.add("a")
        assert (await rig.chat()).status_code == 502
        counts = rig.canaries.counts
        for n in range(1, 3):  # after each failed canary, a success of the same worker
            await wait_until(lambda n=n: counts[CanaryVerdict.FAILED] >= n, timeout_s=WAIT_S)
            assert (await rig.tokenize()).status_code == 200
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
        assert counts[CanaryVerdict.FAILED] == 3 and rig.worker("p", "a").breaker.canary_failures == 3
        resp = await rig.chat(tenant="u")
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker_available"


@pytest.mark.parametrize(("status", "event"), [(503, False), (529, False), (503, True), (429, False)])
async def test_a_busy_workers_refusal_of_its_canary_decides_nothing(status: int, event: bool) -> None:
    """A worker whose queue is full (SGLang's 503 "The request queue is full.", as an answer or
    as its stream's error event; a proxy's 529; a rate limit's 429) refuses every client alike,
    and one tenant's load can fill it: its canary's refusal must not count on its breaker."""
    breaker = {"failure_threshold": 1, "cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.refusal, rig.workers.busy_event = status, event
        counts = rig.canaries.counts
        for n in range(1, 4):  # each lone 500 suspects the worker, and its canary is refused
            assert (await rig.chat(POISON)).status_code == 502
            await wait_until(lambda n=n: counts[CanaryVerdict.INCONCLUSIVE] == n, timeout_s=WAIT_S)
            await wait_until(lambda: rig.canaries.in_flight == 0, timeout_s=WAIT_S)
            assert counts[CanaryVerdict.FAILED] == 0 and rig.closed("a") and rig.failures("a") == {"a": 0}
        rig.workers.refusal = None  # the worker has room again: its next canary passes
        assert (await rig.chat(POISON)).status_code == 502
        await rig.canaries_passed(1)
        assert rig.closed("a") and not rig.worker("p", "a").breaker.suspected
        assert (await rig.chat(tenant="u")).status_code == 200


WHOLE_COMPLETION = orjson.dumps({**COMPLETION_CHUNK, "usage": USAGE})


@pytest.mark.parametrize(
    ("body", "content_type", "verdict"),
    [
        (WHOLE_COMPLETION, "application/json", CanaryVerdict.PASSED),
        (WHOLE_COMPLETION, "", CanaryVerdict.PASSED),
        (b"<html>502 Bad Gateway</html>", "text/html", CanaryVerdict.FAILED),
        (WHOLE_COMPLETION, "text/plain", CanaryVerdict.FAILED),
        (orjson.dumps(FAILED), "application/json", CanaryVerdict.FAILED),
        (orjson.dumps({**COMPLETION_CHUNK, "choices": []}), "application/json", CanaryVerdict.FAILED),
        (b"[]", "application/json", CanaryVerdict.FAILED),
        (b"not json", "application/json", CanaryVerdict.FAILED),
    ],
    ids=["json", "untyped", "html", "text", "error", "no_choices", "array", "not_json"],
)
async def test_a_whole_answer_to_a_canary_passes_only_as_a_completion(
    body: bytes, content_type: str, verdict: CanaryVerdict
) -> None:
    """A worker may answer the streamed canary with a whole answer: it passes when it is a JSON
    completion with its choices; anything else is malformed, as on a client's request."""
    breaker = {"failure_threshold": 1, "cooldown_s": 3600}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        rig.workers.whole = (body, content_type)
        assert (await rig.chat(POISON)).status_code == 502
        counts = rig.canaries.counts
        await wait_until(lambda: sum(counts.values()) == 1, timeout_s=WAIT_S)
        assert counts == {verdict: 1}
        assert rig.closed("a") is (verdict is CanaryVerdict.PASSED)


@pytest.mark.parametrize(
    ("how", "status", "stream_error", "message"),
    [
        ("refusal", 401, False, "worker refused the gateway's credentials for its canary"),
        ("refusal", 403, False, "worker refused the gateway's credentials for its canary"),
        ("broken", 500, False, "worker failed its canary"),
        ("stream_errors", 500, True, "worker failed its canary"),
    ],
)
async def test_a_failed_canarys_log_line_says_what_it_rests_on(
    caplog: pytest.LogCaptureFixture, how: str, status: int, stream_error: bool, message: str
) -> None:
    """The worker's status, or its own error event's code; a refusal of the gateway's credentials
    in words of its own (clients get 503 `no_worker_available` once the breaker opens); never
    any content."""
    caplog.set_level(logging.INFO, logger="kvgate.canary")
    breaker = {"failure_threshold": 1, "cooldown_s": 3600}
    async with gateway("a", retry_attempts=0, breaker=breaker) as rig:
        if how == "refusal":
            rig.workers.refusal = status
        else:
            getattr(rig.workers, how).add("a")
        assert (await rig.chat(POISON)).status_code == 502
        await wait_until(lambda: not rig.closed("a"), timeout_s=WAIT_S, what="a's breaker opened")
    (record,) = [r for r in caplog.records if r.name == "kvgate.canary"]
    assert record.levelno == logging.WARNING and record.getMessage().startswith(message)
    fields = {k: getattr(record, k) for k in ("verdict", "status", "stream_error", "cause")}
    assert fields == {"verdict": "failed", "status": status, "stream_error": stream_error, "cause": None}
    assert CANARY_PROMPT not in str(record.__dict__) and "GenerationError" not in str(record.__dict__)


async def test_a_worker_its_health_check_took_down_gets_no_canary_until_it_is_back() -> None:
    breaker = {"cooldown_s": 3600, "canary": {"interval_s": 0.05}}
    async with gateway("a", breaker=breaker) as rig:
        a = rig.worker("p", "a")
        a.breaker.suspect()  # as a lone 5xx leaves it, and its health check takes it down
        a.healthy = False
        rig.canaries.check(time.monotonic() + 3600)
        assert rig.canaries.in_flight == 0 and a.breaker.suspected and rig.workers.canaries == []
        a.healthy = True  # back: the suspicion it kept is settled by a canary
        await rig.canaries_passed(1)
        assert rig.workers.canaries == ["a"] and not a.breaker.suspected


def test_the_breakers_canary_bounds_and_verdicts() -> None:
    config = BreakerConfig(failure_threshold=2, cooldown_s=10, canary=CanaryConfig(interval_s=1))
    breaker = CircuitBreaker(config)
    assert not breaker.canary_due(0.0)  # nothing suspected
    breaker.suspect()
    assert breaker.canary_due(0.0)
    breaker.canary_sent(0.0)
    breaker.suspect()  # a suspicion while the canary is out waits for the interval
    assert not breaker.canary_due(0.5) and breaker.canary_due(1.0)
    breaker.on_canary(None, 1.0)  # a timeout or a 4xx: nothing decided
    assert breaker.failures == 0 and breaker.closed
    breaker.canary_sent(1.0)
    breaker.on_canary(False, 1.5)  # failed: counted, and the next canary stays due
    assert breaker.failures == 1 and breaker.suspected and breaker.canary_due(2.0)
    breaker.canary_sent(2.0)
    breaker.on_canary(False, 2.5)
    assert breaker.state(2.5) is BreakerState.OPEN and not breaker.canary_due(3.5)
    breaker.on_canary(False, 3.0)  # a verdict that finds the breaker open is dropped
    assert breaker.failures == 2
    # Half-open after the cooldown: a canary is due, and its failure re-opens the breaker.
    assert breaker.state(12.5) is BreakerState.HALF_OPEN and breaker.canary_due(12.5)
    breaker.canary_sent(12.5)
    breaker.on_canary(False, 13.0)
    assert breaker.state(13.0) is BreakerState.OPEN
    # A request's success closes it (a half-open trial, or a route needing no engine), but the
    # row of failed canaries goes on: the next one opens the breaker again.
    breaker.on_success()
    assert breaker.closed and breaker.failures == 0 and breaker.canary_failures == 3
    assert breaker.canary_due(13.5)
    breaker.canary_sent(13.5)
    breaker.on_canary(None, 14.0)  # inconclusive: the row neither ends nor grows, the canaries go on
    assert breaker.closed and breaker.suspected and breaker.canary_failures == 3
    breaker.canary_sent(15.0)
    breaker.on_canary(False, 15.5)
    assert breaker.state(15.5) is BreakerState.OPEN
    assert breaker.state(25.5) is BreakerState.HALF_OPEN
    breaker.on_success()
    breaker.canary_sent(30.0)  # a passed canary ends the row and clears the suspicion
    breaker.on_canary(True, 30.5)
    assert breaker.closed and not breaker.suspected and breaker.failures == 0
    assert breaker.canary_failures == 0
    breaker.on_canary(None, 31.0)  # outside a row, inconclusive leaves nothing suspected
    assert not breaker.suspected


def test_failed_canaries_in_a_row_open_the_breaker_across_request_successes() -> None:
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=3, cooldown_s=10))
    for n in range(1, 4):
        breaker.canary_sent(float(n))
        breaker.on_canary(False, n + 0.5)
        if n < 3:
            breaker.on_success()  # a /tokenize served between the canaries
            assert breaker.closed and breaker.failures == 0
    assert breaker.state(3.5) is BreakerState.OPEN and breaker.canary_failures == 3
