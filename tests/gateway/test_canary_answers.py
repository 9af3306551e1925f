"""How a canary's answer is judged and told (`gateway/canary.py`): a busy worker's refusal
decides nothing, a whole answer passes only as a completion, a failed canary's log line says what
it rests on, and a canary names itself to its worker."""

from __future__ import annotations

import logging

import orjson
import pytest

from gateway.canary import CANARY_PROMPT, CanaryVerdict
from tests.gateway.canary_rig import COMPLETION_CHUNK, FAILED, POISON, WAIT_S, gateway
from tests.gateway.chat_rig import USAGE
from tests.support.wait import wait_until


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
            await rig.canaries_ended(CanaryVerdict.INCONCLUSIVE, n)
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


@pytest.mark.parametrize("status", [503, 529, 500])
async def test_a_busy_answer_to_a_request_leaves_its_worker_unsuspected(status: int) -> None:
    # A 503 or 529 says the worker is busy for everyone: its canary would be refused the same way,
    # so it raises no suspicion. A 500 (which a client's input can cause) does, for its canary.
    async with gateway("a", retry_attempts=0) as rig:
        rig.workers.chat_refusal = status
        assert (await rig.chat()).status_code in (502, 503)
        if status == 500:
            await wait_until(lambda: bool(rig.workers.canaries), timeout_s=WAIT_S, what="its canary")
        else:
            assert not rig.worker("p", "a").breaker.suspected and not rig.workers.canaries


@pytest.mark.parametrize("code", [503, 529, 500])
async def test_a_stream_ended_by_a_busy_error_event_leaves_its_worker_unsuspected(code: int) -> None:
    # SGLang ends a stream with code 503 when its queue is full: busy for everyone, as above.
    async with gateway("a", retry_attempts=0) as rig:
        rig.workers.stream_errors.add("a")
        rig.workers.stream_error_code = code
        assert (await rig.chat(stream=True)).status_code == 200
        if code == 500:
            await wait_until(lambda: bool(rig.workers.canaries), timeout_s=WAIT_S, what="its canary")
        else:
            assert not rig.worker("p", "a").breaker.suspected and not rig.workers.canaries
